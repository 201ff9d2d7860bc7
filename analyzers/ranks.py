"""Tensor-parallel runs: one capture per rank, read together and merged into one ``kprof.analyze/1`` document.

A run of N ranks is given as a folder of captures, a glob pattern, or one capture (a run of one rank). Each file's
rank comes from its metadata (``rank``, as ``kimi_decode.dist_bench`` and ``kprof capture`` write it), else from a
``.rankR.`` part of its name, else from its place in name order.

The merged document is what one decode step of the whole run costs. The ranks run each layer in lockstep (its
all-reduces wait for every rank), so a layer or stage takes as long as its slowest rank: per layer and stage the
times (``kernel_us``, ``busy_us``, ``span_us``, ``own_us``) are the maximum over ranks. Kernel counts, overlap and
prefetch figures are means over ranks (microseconds per rank and step), with the percentages recomputed from those
means, so a merged ``comm_hidden_pct`` is the share of all ranks' communication hidden under compute.
"""
from __future__ import annotations

import glob
import re
from pathlib import Path

from analyzers.trace import TraceError

TIMES = ("kernel_us", "busy_us", "span_us", "own_us")
_RANK_IN_NAME = re.compile(r"\.rank(\d+)\.")


class RankError(TraceError):
    """The files given do not form one run (no file, two files for one rank, different layers)."""


def run_files(path: str | Path) -> list[Path]:
    """The capture files of one run: a folder's ``*.kprof`` files (else all its files), a glob pattern's matches,
    or the one file."""
    text = str(path)
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.kprof")) or sorted(f for f in p.iterdir() if f.is_file())
        if not files:
            raise RankError(f"{p}: the folder holds no captures")
        return files
    if any(c in text for c in "*?[") and not p.exists():
        files = sorted(Path(f) for f in glob.glob(text))
        if not files:
            raise RankError(f"{text}: no file matches")
        return files
    return [p]


def rank_of(meta: dict, path: Path, position: int) -> int:
    rank = meta.get("rank")
    if isinstance(rank, int) and rank >= 0:
        return rank
    found = _RANK_IN_NAME.search(path.name)
    return int(found.group(1)) if found else position


def order_ranks(metas: list[dict], paths: list[Path]) -> list[int]:
    """The rank of each file; two files of one rank are an error."""
    ranks = [rank_of(m, p, i) for i, (m, p) in enumerate(zip(metas, paths))]
    seen: dict[int, Path] = {}
    for rank, path in zip(ranks, paths):
        if rank in seen:
            raise RankError(f"{seen[rank].name} and {path.name} are both rank {rank}")
        seen[rank] = path
    return ranks


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 3) if values else None


def _pct(part, whole) -> float | None:
    return round(100.0 * part / whole, 2) if part is not None and whole else None


def _merge_rows(rows_per_rank: list[list[dict]], key, times_max: bool) -> list[dict]:
    """Rows matched by ``key`` over ranks: TIMES as the maximum (``times_max``) and every other number as the mean;
    a row missing on a rank counts as zero there."""
    n = len(rows_per_rank)
    order, by_key = [], {}
    for rows in rows_per_rank:
        for row in rows:
            k = key(row)
            if k not in by_key:
                order.append(k)
                by_key[k] = []
            by_key[k].append(row)
    merged = []
    for k in order:
        rows = by_key[k]
        out = {}
        for name, value in rows[0].items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or name == "layer":
                out[name] = value
            elif times_max and name in TIMES:
                out[name] = round(max(r[name] for r in rows), 3)
            else:
                out[name] = round(sum(r.get(name) or 0 for r in rows) / n, 3)
        merged.append(out)
    return merged


def _merge_overlap(docs: list[dict]) -> dict:
    parts = [d["overlap"] for d in docs]
    out = {name: _mean([p.get(name) for p in parts]) for name in ("comm_us", "compute_us", "overlap_us")}
    out["comm_hidden_pct"] = _pct(out["overlap_us"], out["comm_us"])
    out["layers"] = _merge_rows([p["layers"] for p in parts], lambda r: (r["layer"], r["kind"]), False)
    for row in out["layers"]:
        row["comm_hidden_pct"] = _pct(row.get("overlap_us"), row.get("comm_us"))
    kernels = _merge_rows([p["comm_kernels"] for p in parts], lambda r: r["name"], False)
    for row in kernels:
        row["overlap_pct"] = _pct(row.get("overlap_us"), row.get("kernel_us"))
    out["comm_kernels"] = sorted(kernels, key=lambda r: -(r.get("kernel_us") or 0))
    return out


def _merge_prefetch(docs: list[dict]) -> dict:
    parts = [d["prefetch"] for d in docs]
    out = {name: _mean([p.get(name) for p in parts]) or 0.0 for name in ("prefetch_us", "hidden_us", "exposed_us")}
    out["hidden_pct"] = _pct(out["hidden_us"], out["prefetch_us"])
    out["layers"] = _merge_rows([p["layers"] for p in parts], lambda r: (r["layer"], r["kind"]), False)
    for row in out["layers"]:
        row["hidden_pct"] = _pct(row.get("hidden_us"), row.get("prefetch_us"))
    return out


def merge_ranks(docs: list[dict], ranks: list[int]) -> dict:
    """One analyze document for the run from its ranks' documents (see the module docstring). The ranks must hold
    the same layers."""
    if len(docs) == 1:
        return docs[0]
    layer_sets = [[(l["layer"], l["kind"]) for l in d["layers"]] for d in docs]
    for rank, layers in zip(ranks[1:], layer_sets[1:]):
        if layers != layer_sets[0]:
            raise RankError(f"rank {rank} holds other layers than rank {ranks[0]}: "
                            f"{len(layers)} vs {len(layer_sets[0])} layers, not the same run")
    layers = []
    for i in range(len(docs[0]["layers"])):
        row = _merge_rows([[d["layers"][i]] for d in docs], lambda r: 0, True)[0]
        row.pop("stages", None)
        row["stages"] = _merge_rows([d["layers"][i]["stages"] for d in docs], lambda s: s["name"], True)
        layers.append(row)
    capture = dict(docs[0]["capture"])
    capture["ranks"] = sorted(ranks)
    capture.pop("rank", None)
    return {
        "schema": docs[0]["schema"],
        "capture": capture,
        "steps": min(d["steps"] for d in docs),
        "unattributed_kernels": sum(d["unattributed_kernels"] for d in docs),
        "layers": layers,
        "overlap": _merge_overlap(docs),
        "prefetch": _merge_prefetch(docs),
    }
