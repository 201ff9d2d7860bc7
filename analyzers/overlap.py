"""Overlap of two kinds of GPU work, per decode step and per layer: communication against compute by default.

Input is a frame of labelled GPU activities, one row per kernel, memcpy or memset, with ``step``, ``layer``,
``layer_kind``, ``stage``, ``name``, ``kind``, ``device``, ``start_ns``, ``end_ns`` and ``klass`` (see
:func:`analyzers.layers.activity_layers`). Times are measured on each device separately and summed over devices.

For a decode step and two sets of activities A (the *target*, e.g. communication) and B (the *cover*, e.g.
compute):

``a_ns``        length of the union of A's intervals;
``b_ns``        length of the union of B's intervals;
``overlap_ns``  time during which A and B both run: the intersection of the two unions;
``hidden_pct``  ``100 * overlap / a``: the share of A hidden under B, HolisticTraceAnalysis's
                ``comp_comm_overlap_pctg`` when A is communication and B compute (NaN when A is empty).

Per layer, A and B are the layer's own activities, but the overlap counts B anywhere in the same step: a layer's
all-reduce hidden under the next layer's compute is hidden. For the whole step (all activities of the step, in a
layer or not) this is exactly HTA's definition restricted to the step.

:func:`comm_kernel_overlap` gives Nsight Systems' ``nccl_gpu_overlap_trace`` view instead: for each communication
kernel, the part of its own duration that overlaps compute on its device, summed by kernel name.
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from analyzers.classes import COMMUNICATION, COMPUTE
from analyzers.intervals import merge_by_group

STEP_KEYS = ["step"]
LAYER_KEYS = ["step", "layer", "layer_kind"]


def select(activities: pd.DataFrame, selector: str) -> np.ndarray:
    """Rows matching a selector: ``class:NAME``, ``stage:NAME``, ``kernel:REGEX`` (kernel name, ``re.search``),
    or a bare name, which is a class if some row has that class and a stage otherwise."""
    how, _, what = selector.partition(":")
    if not what:
        how, what = ("class", selector) if (activities["klass"] == selector).any() else ("stage", selector)
    if how == "class":
        return (activities["klass"] == what).to_numpy()
    if how == "stage":
        return (activities["stage"] == what).to_numpy()
    if how == "kernel":
        try:
            regex = re.compile(what)
        except re.error as exc:
            raise ValueError(f"invalid kernel pattern {what!r}: {exc}") from None
        names = activities["name"].astype("category")
        hits = np.array([bool(regex.search(str(c))) for c in names.cat.categories], dtype=bool)
        return hits[names.cat.codes.to_numpy()] if len(hits) else np.zeros(len(activities), dtype=bool)
    raise ValueError(f"unknown selector {selector!r}: use class:NAME, stage:NAME or kernel:REGEX")


def covered_length(starts, ends, cover_starts, cover_ends) -> np.ndarray:
    """For each query interval, how much of it lies under the union of the cover intervals."""
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    _, c_start, c_end = merge_by_group(np.zeros(len(cover_starts), dtype=np.int64),
                                        np.asarray(cover_starts, dtype=np.int64),
                                        np.asarray(cover_ends, dtype=np.int64))
    if c_start.size == 0 or starts.size == 0:
        return np.zeros(starts.size, dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(c_end - c_start)])

    def covered_before(t: np.ndarray) -> np.ndarray:  # union length of the cover in (-inf, t)
        i = np.searchsorted(c_start, t, side="right") - 1
        inside = np.clip(t - c_start[np.maximum(i, 0)], 0, (c_end - c_start)[np.maximum(i, 0)])
        return np.where(i >= 0, cum[np.maximum(i, 0)] + inside, 0)

    return np.maximum(covered_before(ends) - covered_before(starts), 0)


def hidden_under(activities: pd.DataFrame, target: np.ndarray, cover: np.ndarray,
                 keys: list[str]) -> pd.DataFrame:
    """Per group of ``keys`` (which must start with ``step``): ``a_ns``, the union length of the target rows, and
    ``overlap_ns``, how much of that union runs while some cover row of the same step and device runs; summed
    over devices. Groups without target rows are absent."""
    acts = activities[["step", "device", "start_ns", "end_ns", *[k for k in keys if k != "step"]]]
    step_device = acts.groupby(["step", "device"], sort=False).ngroup().to_numpy()
    t = acts[target]
    group_frame = t[keys + ["device"]]
    grouped = group_frame.groupby(keys + ["device"], sort=True)
    codes = grouped.ngroup().to_numpy()
    index = grouped.size().index
    g, s, e = merge_by_group(codes, t["start_ns"].to_numpy(), t["end_ns"].to_numpy())
    a_ns = np.zeros(len(index), dtype=np.int64)
    np.add.at(a_ns, g, e - s)
    # The (step, device) of each merged interval: every row of a group shares it.
    first_row = pd.Series(np.arange(len(codes))).groupby(codes).first().to_numpy()
    group_sd = step_device[target][first_row] if len(first_row) else np.empty(0, dtype=np.int64)
    interval_sd = group_sd[g] if g.size else np.empty(0, dtype=np.int64)
    covered = np.zeros(g.size, dtype=np.int64)
    cover_sd = step_device[cover]
    cover_start = acts["start_ns"].to_numpy()[cover]
    cover_end = acts["end_ns"].to_numpy()[cover]
    order = np.argsort(cover_sd, kind="stable")
    cover_sd, cover_start, cover_end = cover_sd[order], cover_start[order], cover_end[order]
    bounds = np.searchsorted(cover_sd, np.unique(interval_sd))
    uppers = np.searchsorted(cover_sd, np.unique(interval_sd), side="right")
    for sd, lo, hi in zip(np.unique(interval_sd), bounds, uppers):
        if hi == lo:
            continue
        rows = np.flatnonzero(interval_sd == sd)
        covered[rows] = covered_length(s[rows], e[rows], cover_start[lo:hi], cover_end[lo:hi])
    overlap_ns = np.zeros(len(index), dtype=np.int64)
    np.add.at(overlap_ns, g, covered)
    out = pd.DataFrame({"a_ns": a_ns, "overlap_ns": overlap_ns}, index=index).reset_index()
    return out.groupby(keys, sort=True)[["a_ns", "overlap_ns"]].sum().reset_index()


def union_by(activities: pd.DataFrame, rows: np.ndarray, keys: list[str]) -> pd.DataFrame:
    """Per group of ``keys``: ``ns``, the union length of the selected rows, summed over devices."""
    t = activities[rows]
    grouped = t.groupby(keys + ["device"], sort=True)
    codes = grouped.ngroup().to_numpy()
    g, s, e = merge_by_group(codes, t["start_ns"].to_numpy(), t["end_ns"].to_numpy())
    ns = np.zeros(grouped.ngroups, dtype=np.int64)
    np.add.at(ns, g, e - s)
    out = pd.DataFrame({"ns": ns}, index=grouped.size().index).reset_index()
    return out.groupby(keys, sort=True)[["ns"]].sum().reset_index()


def step_overlap(activities: pd.DataFrame, target: np.ndarray, cover: np.ndarray,
                 keys: list[str] = STEP_KEYS) -> pd.DataFrame:
    """Per step (``keys=STEP_KEYS``) or per step and layer (``LAYER_KEYS``), over the groups that ran at least one
    activity: ``a_ns``, ``b_ns``, ``overlap_ns`` and ``hidden_pct`` (see the module docstring)."""
    in_step = (activities["step"] >= 0).to_numpy()
    if keys != STEP_KEYS:
        in_step = in_step & (activities["layer"] >= 0).to_numpy()
    acts = activities[in_step]
    target, cover = target[in_step], cover[in_step]
    groups = acts[keys].drop_duplicates().sort_values(keys).reset_index(drop=True)
    a = hidden_under(acts, target, cover, keys)
    b = union_by(acts, cover, keys).rename(columns={"ns": "b_ns"})
    out = groups.merge(a, on=keys, how="left").merge(b, on=keys, how="left")
    out[["a_ns", "overlap_ns", "b_ns"]] = out[["a_ns", "overlap_ns", "b_ns"]].fillna(0).astype("int64")
    with np.errstate(divide="ignore", invalid="ignore"):
        out["hidden_pct"] = np.where(out["a_ns"] > 0, 100.0 * out["overlap_ns"] / out["a_ns"].where(out["a_ns"] > 0),
                                     np.nan)
    return out


def _us(ns) -> float:
    return round(float(ns) / 1000.0, 3)


def _pct(value) -> float | None:
    return None if value is None or pd.isna(value) else round(float(value), 2)


def summarize(per_step: pd.DataFrame, names=("a_us", "b_us", "overlap_us", "hidden_pct")) -> dict:
    """Medians over the rows of a :func:`step_overlap` frame as a dict with the given key names; the percentage is
    the median over the rows where the target ran, None where it never did."""
    a, b, both, pct = names
    if len(per_step) == 0:
        return {a: 0.0, b: 0.0, both: 0.0, pct: None}
    ran = per_step["hidden_pct"].dropna()
    return {a: _us(per_step["a_ns"].median()), b: _us(per_step["b_ns"].median()),
            both: _us(per_step["overlap_ns"].median()), pct: _pct(ran.median()) if len(ran) else None}


COMM_NAMES = ("comm_us", "compute_us", "overlap_us", "comm_hidden_pct")


def comm_compute(activities: pd.DataFrame) -> tuple[dict, dict[tuple[int, str], dict]]:
    """Communication against compute: the whole-step medians ``{"comm_us", "compute_us", "overlap_us",
    "comm_hidden_pct"}`` and the same per (layer, layer_kind)."""
    comm = (activities["klass"] == COMMUNICATION).to_numpy()
    compute = (activities["klass"] == COMPUTE).to_numpy()
    return pair_summary(activities, comm, compute, COMM_NAMES)


def pair_summary(activities: pd.DataFrame, target: np.ndarray, cover: np.ndarray,
                 names=("a_us", "b_us", "overlap_us", "hidden_pct")) -> tuple[dict, dict[tuple[int, str], dict]]:
    """Whole-step and per-layer medians of :func:`step_overlap` for any two sets of activities."""
    whole = summarize(step_overlap(activities, target, cover, STEP_KEYS), names)
    per_layer = step_overlap(activities, target, cover, LAYER_KEYS)
    layers = {(int(layer), str(kind)): summarize(frame, names)
              for (layer, kind), frame in per_layer.groupby(["layer", "layer_kind"], sort=True)}
    return whole, layers


def comm_kernel_overlap(activities: pd.DataFrame) -> pd.DataFrame:
    """Nsight Systems' per-kernel view: for each communication kernel name, ``count``, ``kernel_us`` (summed
    duration), ``overlap_us`` (summed part of each kernel's duration that overlaps compute on its device) and
    ``overlap_pct`` (``100 * overlap / duration``), over the whole trace, sorted by kernel time."""
    comm = activities[(activities["klass"] == COMMUNICATION).to_numpy()]
    compute = activities[(activities["klass"] == COMPUTE).to_numpy()]
    covered = np.zeros(len(comm), dtype=np.int64)
    for device in comm["device"].unique():
        rows = (comm["device"] == device).to_numpy()
        cover = compute[(compute["device"] == device).to_numpy()]
        covered[rows] = covered_length(comm["start_ns"].to_numpy()[rows], comm["end_ns"].to_numpy()[rows],
                                       cover["start_ns"].to_numpy(), cover["end_ns"].to_numpy())
    frame = pd.DataFrame({"name": comm["name"].astype(str).to_numpy(),
                          "dur_ns": (comm["end_ns"] - comm["start_ns"]).to_numpy(), "overlap_ns": covered})
    out = frame.groupby("name", sort=True).agg(count=("dur_ns", "size"), dur_ns=("dur_ns", "sum"),
                                               overlap_ns=("overlap_ns", "sum")).reset_index()
    out["kernel_us"] = out["dur_ns"] / 1000.0
    out["overlap_us"] = out["overlap_ns"] / 1000.0
    out["overlap_pct"] = np.where(out["dur_ns"] > 0, 100.0 * out["overlap_ns"] / out["dur_ns"].clip(lower=1), np.nan)
    out = out.sort_values(["kernel_us", "name"], ascending=[False, True]).reset_index(drop=True)
    return out[["name", "count", "kernel_us", "overlap_us", "overlap_pct"]]


def comm_kernel_records(activities: pd.DataFrame) -> list[dict]:
    """:func:`comm_kernel_overlap` as JSON-ready records (µs rounded to the ns, percent to 0.01)."""
    return [{"name": r.name, "count": int(r.count), "kernel_us": round(float(r.kernel_us), 3),
             "overlap_us": round(float(r.overlap_us), 3), "overlap_pct": _pct(r.overlap_pct)}
            for r in comm_kernel_overlap(activities).itertuples(index=False)]
