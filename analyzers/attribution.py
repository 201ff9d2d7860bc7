"""Kernel-to-range attribution, as Nsight Systems defines it.

A GPU activity belongs to the innermost range that, on the thread that launched it, encloses its launch call (the
runtime or driver API call with the same correlation id): ``range.start <= call.start`` and
``call.end <= range.end``. GPU-time overlap plays no part, so a kernel that runs after its range closed still
belongs to it.

Kernels replayed from a CUDA graph share one launch (``cudaGraphLaunch``). When ``trace.graph_nodes`` maps their
graph node to the launch made while the graph was captured, the range open around that capture-time launch is
their *source* range (it carries the layer and stage); the replay launch still decides the step. Without a
mapping the replay launch decides both.
"""
from __future__ import annotations

import numpy as np
import pandas as pd


def _thread_codes(*frames: pd.DataFrame) -> list[np.ndarray]:
    """One integer code per (pid, tid), consistent across the given frames."""
    pairs = pd.concat([f[["pid", "tid"]] for f in frames], ignore_index=True)
    codes = pairs.groupby(["pid", "tid"], sort=False).ngroup().to_numpy()
    out, offset = [], 0
    for frame in frames:
        out.append(codes[offset:offset + len(frame)])
        offset += len(frame)
    return out


def _sorted_ranges(ranges: pd.DataFrame, threads: np.ndarray) -> np.ndarray:
    """Order ranges by thread, then start, enclosing before enclosed (longer first at equal starts)."""
    start = ranges["start_ns"].to_numpy()
    end = ranges["end_ns"].to_numpy()
    return np.lexsort((np.arange(len(ranges)), -end, start, threads))


def _nest_sorted(threads: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Parent position and depth of each range, arrays in the order of :func:`_sorted_ranges`."""
    n = len(start)
    parent = [-1] * n
    depth = [0] * n
    thr, ends = threads.tolist(), end.tolist()
    for k in range(1, n):
        if thr[k] != thr[k - 1]:
            continue
        candidate = k - 1
        # The innermost enclosing range is the latest-starting range that still covers this one; walking up the
        # enclosers of the previous range finds it, also when ranges overlap without nesting (start/end ranges).
        while candidate != -1 and ends[candidate] < ends[k]:
            candidate = parent[candidate]
        if candidate != -1:
            parent[k] = candidate
            depth[k] = depth[candidate] + 1
    return np.asarray(parent, dtype=np.int64), np.asarray(depth, dtype=np.int64)


def range_nesting(ranges: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """For each range (row position), the position of its innermost enclosing range on the same thread (-1 for
    none) and its depth (0 for outermost)."""
    if len(ranges) == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    (threads,) = _thread_codes(ranges)
    order = _sorted_ranges(ranges, threads)
    parent_sorted, depth_sorted = _nest_sorted(
        threads[order], ranges["start_ns"].to_numpy()[order], ranges["end_ns"].to_numpy()[order])
    parent = np.full(len(ranges), -1, dtype=np.int64)
    depth = np.empty(len(ranges), dtype=np.int64)
    has_parent = parent_sorted >= 0
    parent[order[has_parent]] = order[parent_sorted[has_parent]]
    depth[order] = depth_sorted
    return parent, depth


def innermost_ranges(ranges: pd.DataFrame, calls: pd.DataFrame) -> np.ndarray:
    """For each call (a frame with ``pid``, ``tid``, ``start_ns``, ``end_ns``), the row position in ``ranges`` of the
    innermost range on the same thread that encloses ``[start_ns, end_ns]``, or -1."""
    result = np.full(len(calls), -1, dtype=np.int64)
    if len(ranges) == 0 or len(calls) == 0:
        return result
    range_threads, call_threads = _thread_codes(ranges, calls)
    order = _sorted_ranges(ranges, range_threads)
    threads = range_threads[order]
    start = ranges["start_ns"].to_numpy()[order]
    end = ranges["end_ns"].to_numpy()[order]
    parent, _ = _nest_sorted(threads, start, end)
    call_start = calls["start_ns"].to_numpy()
    call_end = calls["end_ns"].to_numpy()

    bounds = np.searchsorted(threads, np.arange(threads.max() + 2))
    candidate = np.full(len(calls), -1, dtype=np.int64)
    for thread in np.unique(call_threads):
        if thread > threads.max():
            continue  # a thread without ranges
        lo, hi = bounds[thread], bounds[thread + 1]
        rows = np.flatnonzero(call_threads == thread)
        # The last range starting at or before the call; if it ended too early, its enclosers are next in line.
        pos = np.searchsorted(start[lo:hi], call_start[rows], side="right") - 1
        candidate[rows] = np.where(pos >= 0, pos + lo, -1)
    while True:
        short = np.flatnonzero(candidate >= 0)
        short = short[end[candidate[short]] < call_end[short]]
        if short.size == 0:
            break
        candidate[short] = parent[candidate[short]]
    found = candidate >= 0
    result[found] = order[candidate[found]]
    return result


def launch_calls(trace) -> pd.DataFrame:
    """The launch call of each row of ``trace.kernels`` (``pid``, ``tid``, ``start_ns``, ``end_ns``; -1 where the
    correlation id matches no launch), joined on the correlation id, and on the process when every kernel has one."""
    kernels, launches = trace.kernels, trace.launches
    keys = ["correlation_id"]
    if len(kernels) and (kernels["pid"] >= 0).all():
        keys.append("pid")
    calls = launches.loc[launches["correlation_id"] >= 0, ["pid", "tid", "start_ns", "end_ns", "correlation_id"]]
    calls = calls.drop_duplicates(keys, keep="first").assign(call_pid=calls["pid"])
    if "pid" not in keys:
        calls = calls.drop(columns="pid")
    joined = kernels[keys].merge(calls, on=keys, how="left")
    out = pd.DataFrame({
        "pid": joined["call_pid"], "tid": joined["tid"], "start_ns": joined["start_ns"], "end_ns": joined["end_ns"],
    })
    return out.fillna(-1).astype("int64")


def capture_calls(trace) -> pd.DataFrame:
    """For each row of ``trace.kernels``, the capture-time launch call of its CUDA-graph node (-1 where the kernel
    is not a graph node or ``trace.graph_nodes`` does not map it)."""
    nodes = trace.graph_nodes
    nodes = nodes[nodes["graph_node_id"] >= 0].drop_duplicates("graph_node_id", keep="first")
    launches = trace.launches
    launches = launches[launches["correlation_id"] >= 0].drop_duplicates("correlation_id", keep="first")
    by_call = nodes[["graph_node_id", "correlation_id"]].merge(
        launches[["correlation_id", "pid", "tid", "start_ns", "end_ns"]], on="correlation_id", how="left")
    nodes = nodes.reset_index(drop=True)
    matched = by_call["tid"].notna().to_numpy()
    anchor = pd.DataFrame({"graph_node_id": nodes["graph_node_id"]})
    for column in ("pid", "tid", "start_ns", "end_ns"):
        # int64 throughout: epoch nanoseconds do not survive a round trip through float64
        anchor[column] = np.where(matched, by_call[column].fillna(-1).astype("int64").to_numpy(),
                                  nodes[column].to_numpy())
    joined = trace.kernels[["graph_node_id"]].merge(anchor, on="graph_node_id", how="left")
    joined.loc[trace.kernels["graph_node_id"].to_numpy() < 0, ["pid", "tid", "start_ns", "end_ns"]] = -1
    return joined[["pid", "tid", "start_ns", "end_ns"]].fillna(-1).astype("int64")


def attribute(trace) -> pd.DataFrame:
    """Attribute every row of ``trace.kernels`` to ranges.

    Returns a frame aligned with ``trace.kernels`` (same row order) with the row positions in ``trace.ranges`` of:
    ``launch_range``, the innermost range around the launch call (-1: none, or no launch call in the trace);
    ``capture_range``, the innermost range around the capture-time launch of the kernel's graph node (-1: not a
    mapped graph node); ``range``, the kernel's source range: ``capture_range`` where there is one, else
    ``launch_range``.
    """
    calls = launch_calls(trace)
    launch_range = innermost_ranges(trace.ranges, calls)
    launch_range[calls["tid"].to_numpy() < 0] = -1
    captures = capture_calls(trace)
    capture_range = innermost_ranges(trace.ranges, captures)
    capture_range[captures["tid"].to_numpy() < 0] = -1
    return pd.DataFrame({
        "launch_range": launch_range,
        "capture_range": capture_range,
        "range": np.where(capture_range >= 0, capture_range, launch_range),
    })
