"""Kernel classes: which GPU activities are communication, compute, memory traffic or prefetch.

A :class:`ClassTable` assigns every GPU activity one class, in this order:

1. its stage, when the stage is in ``stages`` (by default the ``allreduce`` stage is communication and the
   ``prefetch`` stage is prefetch, whatever their kernels are named);
2. the first ``(class, pattern)`` rule whose pattern matches the activity name (``re.search``, case-insensitive);
3. ``memory`` for memcpy/memset rows, ``compute`` for kernels.

The default rules cover NCCL kernels, custom and one-shot/two-shot all-reduce kernels (vLLM ``cross_device_reduce``,
TensorRT-LLM ``allreduce``), NVSHMEM, memcpy/memset kernels and kernels named as prefetches. A table can be read from
a JSON file (see :func:`load_class_table`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

COMMUNICATION, COMPUTE, MEMORY, PREFETCH = "communication", "compute", "memory", "prefetch"

DEFAULT_RULES: tuple[tuple[str, str], ...] = (
    (COMMUNICATION, r"nccl"),
    (COMMUNICATION, r"cross_device_reduce|custom_?all_?reduce|one_?shot|two_?shot|all_?reduce|allgather|all_gather"
                    r"|reduce_?scatter|all_?to_?all|lamport"),
    (COMMUNICATION, r"nvshmem"),
    (PREFETCH, r"prefetch"),
    (MEMORY, r"^memcpy|^memset|\bmemcpy|\bmemset"),
)
DEFAULT_STAGES: dict[str, str] = {"allreduce": COMMUNICATION, "prefetch": PREFETCH}


@dataclass(frozen=True)
class ClassTable:
    """Ordered name rules and stage overrides; see the module docstring for how a class is chosen."""

    rules: tuple[tuple[str, str], ...] = DEFAULT_RULES
    stages: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_STAGES))

    def __post_init__(self) -> None:
        for klass, pattern in self.rules:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"invalid pattern {pattern!r} for class {klass!r}: {exc}") from None

    @property
    def names(self) -> list[str]:
        """Every class this table can assign, defaults first."""
        seen = [COMMUNICATION, COMPUTE, MEMORY, PREFETCH]
        for klass in [k for k, _ in self.rules] + list(self.stages.values()):
            if klass not in seen:
                seen.append(klass)
        return seen


def load_class_table(path: str | Path) -> ClassTable:
    """Read a class table from JSON: ``{"rules": [["communication", "nccl|my_allreduce"], ...],
    "stages": {"allreduce": "communication"}, "extend": true}``. With ``"extend": true`` (the default) the rules
    are tried before the default rules and the stages update the default stages; with ``false`` they replace them.
    Raises ``ValueError`` with a one-line message for a file that is not such a table."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read class table {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"class table {path.name} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) - {"rules", "stages", "extend"}:
        raise ValueError(f"class table {path.name}: expected an object with 'rules', 'stages' and 'extend'")
    rules, stages = doc.get("rules", []), doc.get("stages", {})
    if not (isinstance(rules, list) and all(isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r)
                                            for r in rules)):
        raise ValueError(f"class table {path.name}: 'rules' must be a list of [class, pattern] pairs")
    if not (isinstance(stages, dict) and all(isinstance(v, str) for v in stages.values())):
        raise ValueError(f"class table {path.name}: 'stages' must map stage names to class names")
    rules = tuple((k, p) for k, p in rules)
    if doc.get("extend", True):
        return ClassTable(rules=rules + DEFAULT_RULES, stages={**DEFAULT_STAGES, **stages})
    return ClassTable(rules=rules, stages=dict(stages))


def classify(activities: pd.DataFrame, table: ClassTable | None = None) -> np.ndarray:
    """The class of each row of ``activities`` (a frame with ``name``, ``kind`` and ``stage``), as an object array."""
    table = table or ClassTable()
    n = len(activities)
    names = activities["name"].astype("category")
    categories = [str(c) for c in names.cat.categories]
    by_name = np.full(len(categories), "", dtype=object)
    compiled = [(klass, re.compile(pattern, re.IGNORECASE)) for klass, pattern in table.rules]
    for i, name in enumerate(categories):
        for klass, regex in compiled:
            if regex.search(name):
                by_name[i] = klass
                break
    codes = names.cat.codes.to_numpy()
    out = by_name[codes] if n else np.empty(0, dtype=object)
    fallback = np.where(activities["kind"].astype(str).to_numpy() == "kernel", COMPUTE, MEMORY)
    out = np.where(out == "", fallback, out).astype(object)
    if "stage" in activities.columns and table.stages:
        stage = activities["stage"].astype(str).to_numpy()
        override = pd.Series(stage).map(table.stages).to_numpy()
        has = pd.notna(override)
        out[has] = override[has]
    return out
