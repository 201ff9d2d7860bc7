"""Per-layer and per-stage kernel metrics of decode steps, from ranges named by the instrumentation contract.

Ranges nest as ``decode_step`` > ``layer[{i}]:{kind}`` > stage (``qkv_proj``, ``allreduce``, ...). For each decode
step and each layer (and each stage inside a layer, aggregated by stage name), over the kernel rows attributed to
it (see :mod:`analyzers.attribution`):

``kernels``    number of kernel rows (memcpy/memset rows are not counted);
``kernel_ns``  sum of kernel durations;
``busy_ns``    length of the union of the kernel intervals, across every stream and device;
``span_ns``    last kernel end minus first kernel start;
``own_ns``     the part of the busy time in which no kernel of the step that started earlier was running: each
               moment of the step's busy time belongs to the earliest-started kernel running then, so the layers'
               (and the stages') own times add up to the step's busy time. Under programmatic dependent launch a
               kernel starts while the one before it finishes and waits for it; ``busy_ns`` then counts that
               overlap in both layers (or stages), ``own_ns`` in the earlier one only. Without overlap across
               layers a layer's ``own_ns`` is its ``busy_ns``.

The reported value is the median over the steps in which the layer (or stage) ran at least one kernel. The step of a
kernel is the ``decode_step`` range around its launch call (for a CUDA-graph replay, around ``cudaGraphLaunch``);
its layer and stage come from its source range (the capture-time range of a mapped graph node). A trace without
``decode_step`` ranges is one step. A kernel with no step or no layer is *unattributed*.
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from analyzers.attribution import attribute, range_nesting
from analyzers.classes import PREFETCH, ClassTable, classify
from analyzers.intervals import union_length_by_group
from analyzers.overlap import comm_compute, comm_kernel_records
from analyzers.prefetch import prefetch_effect
from analyzers.trace import KINDS

SCHEMA = "kprof.analyze/1"
STEP_RANGE = "decode_step"
DEFAULT_LAYER_REGEX = r"^layer\[(?P<index>\d+)\]:(?P<kind>\w+)$"
METRICS = ("kernels", "kernel_ns", "busy_ns", "span_ns", "own_ns")


def compile_layer_regex(pattern: str) -> re.Pattern:
    """Compile a layer-range pattern: it must have a group ``index`` (or a first group) that matches the layer
    number; an optional group ``kind`` names the layer kind. It is applied with ``re.search`` to range names."""
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"invalid layer regex {pattern!r}: {exc}") from None
    if "index" not in regex.groupindex and regex.groups == 0:
        raise ValueError(f"layer regex {pattern!r} needs a group for the layer number, e.g. (?P<index>\\d+)")
    return regex


def label_ranges(ranges: pd.DataFrame, layer_regex: str = DEFAULT_LAYER_REGEX,
                 step_range: str = STEP_RANGE) -> pd.DataFrame:
    """For each range (aligned with ``ranges``): ``step`` (row position of the enclosing-or-self step range, -1),
    ``layer`` (layer number, -1), ``layer_kind`` ("" if none), ``stage`` (name of the range directly under the
    layer on the path to this one, "" if none; a ``prefetch`` range is its own stage however deep it sits in the
    layer: a prefetch launched from inside another stage is not that stage's work)."""
    regex = compile_layer_regex(layer_regex)
    group = "index" if "index" in regex.groupindex else 1
    names = ranges["name"].astype("category")
    categories = [str(c) for c in names.cat.categories]
    matches = [regex.search(c) for c in categories]
    cat_layer = np.array([int(m.group(group)) if m and m.group(group) is not None else -1 for m in matches],
                         dtype=np.int64)
    cat_kind = np.array([(m.group("kind") or "") if m and "kind" in regex.groupindex else "" for m in matches],
                        dtype=object)
    codes = names.cat.codes.to_numpy()
    is_layer = cat_layer[codes] >= 0 if len(categories) else np.zeros(len(ranges), dtype=bool)
    is_step = (names == step_range).to_numpy()
    is_prefetch = (names == PREFETCH).to_numpy()  # the prefetch stage is named as its class

    parent, depth = range_nesting(ranges)
    n = len(ranges)
    step = np.full(n, -1, dtype=np.int64)
    layer_pos = np.full(n, -1, dtype=np.int64)
    stage_pos = np.full(n, -1, dtype=np.int64)
    own = np.arange(n)
    for level in range(int(depth.max()) + 1 if n else 0):
        rows = np.flatnonzero(depth == level)
        up = parent[rows]
        has_up = up >= 0
        up_safe = np.where(has_up, up, 0)
        step[rows] = np.where(is_step[rows], own[rows], np.where(has_up, step[up_safe], -1))
        layer_pos[rows] = np.where(is_layer[rows], own[rows], np.where(has_up, layer_pos[up_safe], -1))
        under_layer = (has_up & is_layer[up_safe]) | (is_prefetch[rows] & (layer_pos[rows] >= 0))
        stage_pos[rows] = np.where(is_layer[rows], -1,
                                   np.where(under_layer, own[rows], np.where(has_up, stage_pos[up_safe], -1)))
    has_layer = layer_pos >= 0
    layer = np.full(n, -1, dtype=np.int64)
    layer[has_layer] = cat_layer[codes[layer_pos[has_layer]]]
    kind = np.full(n, "", dtype=object)
    kind[has_layer] = cat_kind[codes[layer_pos[has_layer]]]
    stage = np.full(n, "", dtype=object)
    has_stage = stage_pos >= 0
    stage[has_stage] = np.asarray(categories, dtype=object)[codes[stage_pos[has_stage]]]
    return pd.DataFrame({"step": step, "layer": layer, "layer_kind": kind, "stage": stage})


def kernel_layers(trace, layer_regex: str = DEFAULT_LAYER_REGEX, step_range: str = STEP_RANGE,
                  kinds: tuple[str, ...] = ("kernel",)) -> pd.DataFrame:
    """The rows of ``trace.kernels`` whose ``kind`` is in ``kinds`` (default: kernels only) with their ``step``,
    ``layer``, ``layer_kind`` and ``stage`` (-1 / "" where there is none), plus ``name``, ``start_ns``, ``end_ns``,
    ``kind``, ``device`` and ``stream``."""
    labels = label_ranges(trace.ranges, layer_regex, step_range)
    attribution = attribute(trace)
    is_kernel = trace.kernels["kind"].isin(kinds).to_numpy()
    kernels = trace.kernels.loc[is_kernel, ["name", "start_ns", "end_ns", "kind", "device", "stream"]]
    kernels = kernels.reset_index(drop=True)
    launch_range = attribution["launch_range"].to_numpy()[is_kernel]
    source_range = attribution["range"].to_numpy()[is_kernel]

    def take(column: str, rows: np.ndarray, missing, dtype):
        out = np.full(len(rows), missing, dtype=dtype)
        found = rows >= 0
        out[found] = labels[column].to_numpy()[rows[found]]
        return out

    if (labels["step"] >= 0).any():
        kernels["step"] = take("step", launch_range, -1, np.int64)
    else:
        kernels["step"] = 0
    kernels["layer"] = take("layer", source_range, -1, np.int64)
    kernels["layer_kind"] = take("layer_kind", source_range, "", object)
    kernels["stage"] = take("stage", source_range, "", object)
    return kernels


def activity_layers(trace, layer_regex: str = DEFAULT_LAYER_REGEX, step_range: str = STEP_RANGE,
                    classes: ClassTable | None = None) -> pd.DataFrame:
    """Every GPU activity (kernels, memcpy and memset) labelled as in :func:`kernel_layers`, plus its class
    (``klass``, see :mod:`analyzers.classes`). The input of :mod:`analyzers.overlap` and :mod:`analyzers.prefetch`."""
    activities = kernel_layers(trace, layer_regex, step_range, kinds=KINDS)
    activities["klass"] = classify(activities, classes)
    return activities


def owned_ns(kernels: pd.DataFrame) -> np.ndarray:
    """Per kernel row (aligned with ``kernels``): the nanoseconds of its interval in which no kernel of the same
    ``step`` that started earlier (ties: the earlier row) was running. Within a step these add up to the length of
    the union of its kernel intervals. Only the rows given take part."""
    if kernels.empty:
        return np.zeros(0, dtype=np.int64)
    step = kernels["step"].to_numpy()
    start = kernels["start_ns"].to_numpy(dtype=np.int64)
    end = np.maximum(kernels["end_ns"].to_numpy(dtype=np.int64), start)
    order = np.lexsort((np.arange(len(start)), start, step))
    s, e, g = start[order], end[order], step[order]
    # the latest end among the step's earlier-started kernels: after s it covers [s, that end) without a gap
    ends = pd.Series(e).groupby(g).cummax().to_numpy()
    before = np.empty_like(ends)
    before[0] = np.iinfo(np.int64).min
    before[1:] = ends[:-1]
    before[np.r_[True, g[1:] != g[:-1]]] = np.iinfo(np.int64).min  # a step's first kernel: nothing before it
    owned = np.empty(len(start), dtype=np.int64)
    owned[order] = np.clip(e - np.maximum(s, before), 0, None)
    return owned


def _per_step(kernels: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    grouped = kernels.groupby(keys, sort=True)
    codes = grouped.ngroup().to_numpy()
    per_step = grouped.agg(kernels=("start_ns", "size"), first_ns=("start_ns", "min"), last_ns=("end_ns", "max"))
    duration = kernels["end_ns"] - kernels["start_ns"]
    per_step["kernel_ns"] = duration.groupby([kernels[k] for k in keys], sort=True).sum().to_numpy()
    per_step["own_ns"] = kernels["own_ns"].groupby([kernels[k] for k in keys], sort=True).sum().to_numpy()
    per_step["busy_ns"] = union_length_by_group(codes, kernels["start_ns"], kernels["end_ns"], len(per_step))
    per_step["span_ns"] = per_step["last_ns"] - per_step["first_ns"]
    return per_step.reset_index()


def step_metrics(kernels: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per-step metrics of labelled kernels (from :func:`kernel_layers`): one frame keyed by (``step``, ``layer``,
    ``layer_kind``) and one by (``step``, ``layer``, ``layer_kind``, ``stage``), each with ``kernels``,
    ``kernel_ns``, ``busy_ns``, ``span_ns``, ``own_ns`` and ``first_ns`` (first kernel start). Unattributed kernels
    are left out (also of the own times), and so are kernels outside any stage from the stage frame."""
    attributed = kernels[(kernels["step"] >= 0) & (kernels["layer"] >= 0)].copy()
    attributed["own_ns"] = owned_ns(attributed)
    layers = _per_step(attributed, ["step", "layer", "layer_kind"])
    staged = attributed[attributed["stage"] != ""]
    stages = _per_step(staged, ["step", "layer", "layer_kind", "stage"])
    return layers, stages


def _us(ns: float) -> float:
    return round(float(ns) / 1000.0, 3)


def _medians(per_step: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    medians = per_step.groupby(keys, sort=True)[list(METRICS)].median()
    medians["first_ns"] = per_step.groupby(keys, sort=True)["first_ns"].min()
    return medians.reset_index()


def analyze(trace, layer_regex: str = DEFAULT_LAYER_REGEX, step_range: str = STEP_RANGE,
            classes: ClassTable | None = None) -> dict:
    """Per-layer metrics of ``trace`` as the ``kprof.analyze/1`` document (a JSON-ready dict)::

        {"schema": "kprof.analyze/1", "capture": {...}, "steps": int, "unattributed_kernels": int,
         "layers": [{"layer": int, "kind": str|None, "kernels_per_step": float, "kernel_us": float,
                     "busy_us": float, "span_us": float, "own_us": float,
                     "stages": [{"name": str, "kernels_per_step": float, "kernel_us": float, "busy_us": float,
                                 "span_us": float, "own_us": float}]}],
         "overlap": {"comm_us": float, "compute_us": float, "overlap_us": float, "comm_hidden_pct": float|None,
                     "layers": [{"layer", "kind", "comm_us", "compute_us", "overlap_us", "comm_hidden_pct"}],
                     "comm_kernels": [{"name", "count", "kernel_us", "overlap_us", "overlap_pct"}]},
         "prefetch": {"prefetch_us", "hidden_us", "exposed_us", "hidden_pct",
                      "layers": [{"layer", "kind", "prefetch_us", "hidden_us", "exposed_us", "hidden_pct"}]}}

    Values are medians over steps, in microseconds; layers are ordered by number then kind, stages by first start.
    ``unattributed_kernels`` counts, over the whole trace, the kernel rows not in any (step, layer). ``overlap``
    and ``prefetch`` follow :mod:`analyzers.overlap` and :mod:`analyzers.prefetch`, with kernel classes from
    ``classes`` (default table when None).
    """
    activities = activity_layers(trace, layer_regex, step_range, classes)
    kernels = activities[(activities["kind"] == "kernel").to_numpy()].reset_index(drop=True)
    names = trace.ranges["name"]
    n_steps = int((names == step_range).sum()) or 1
    unattributed = int(((kernels["step"] < 0) | (kernels["layer"] < 0)).sum())
    layer_steps, stage_steps = step_metrics(kernels)
    layer_medians = _medians(layer_steps, ["layer", "layer_kind"])
    stage_medians = _medians(stage_steps, ["layer", "layer_kind", "stage"]).sort_values(["layer", "layer_kind", "first_ns"])
    stages_by_layer = {key: frame for key, frame in stage_medians.groupby(["layer", "layer_kind"], sort=False)}

    def metrics(row) -> dict:
        return {"kernels_per_step": float(row.kernels), "kernel_us": _us(row.kernel_ns),
                "busy_us": _us(row.busy_ns), "span_us": _us(row.span_ns), "own_us": _us(row.own_ns)}

    overlap, layer_overlap = comm_compute(activities)
    prefetch, layer_prefetch = prefetch_effect(activities)
    layers = []
    for row in layer_medians.itertuples(index=False):
        stages = stages_by_layer.get((row.layer, row.layer_kind))
        layers.append({
            "layer": int(row.layer),
            "kind": row.layer_kind or None,
            **metrics(row),
            "stages": [] if stages is None else [{"name": s.stage, **metrics(s)} for s in stages.itertuples(index=False)],
        })
    return {
        "schema": SCHEMA,
        "capture": dict(trace.meta),
        "steps": n_steps,
        "unattributed_kernels": unattributed,
        "layers": layers,
        "overlap": {**overlap,
                    "layers": [{"layer": layer, "kind": kind or None, **values}
                               for (layer, kind), values in sorted(layer_overlap.items())],
                    "comm_kernels": comm_kernel_records(activities)},
        "prefetch": {**prefetch, "layers": [{"layer": layer, "kind": kind or None, **values}
                                            for (layer, kind), values in sorted(layer_prefetch.items())]},
    }
