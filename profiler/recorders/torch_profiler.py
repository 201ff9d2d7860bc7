"""The torch.profiler recorder: Kineto's trace, plus the node mapping that attributes CUDA-graph replays.

Kineto records ``record_function`` ranges, kernels and launch calls, but nothing that ties a kernel replayed from a
CUDA graph to the launch that created its node: every replayed kernel carries the ``cudaGraphLaunch`` correlation
id. kprof therefore records the graph capture too, inside a ``kprof:graph_capture`` range, and maps replays to it
(:func:`map_graph_replays`):

1. The *capture-time launches* are the node-creating calls (kernel launches, async memcpy/memset) made on the
   capturing thread inside the capture range, in call order; a call nested in another one (a runtime launch and
   the driver launch it makes) counts once. During stream capture nothing runs on the GPU, so
   these calls have no kernels of their own; the ranges around them name their layer and stage.
2. For each ``cudaGraphLaunch`` after the capture, its GPU activities are ordered by graph node id when Kineto
   reports ``graph node id`` (node ids are handed out in creation order, and instantiation clones nodes in that
   order), else by start time.
3. The i-th activity of a replay is the node made by the i-th capture-time launch. A ``graph_nodes`` row maps it
   to that launch's correlation id.

Assumption, checked on every replay: for each kind (kernel, memcpy, memset) the replay has as many GPU activities
as there were capture-time launches of that kind (one node per launch), or none at all. On the H200 (torch 2.11)
Kineto reported 139 activities per replay of a graph of 139 kernel and 2 memcpy nodes: the memcpy nodes had no
activity. A kind missing from a replay is left out and named in ``meta["graph_mapping"]``. Ordering by start time is only right for a graph captured from one stream (its nodes form a
chain); with several capture streams it needs Kineto's node ids. A replay whose activity count differs is left
unmapped, and ``meta["graph_mapping"]`` says why.
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from profiler.recorders import CAPTURE_RANGE

# Calls that add a node to a graph under stream capture.
NODE_CALL = re.compile(r"^(cuda|cu)(LaunchKernel|LaunchCooperativeKernel|LaunchKernelEx|Memcpy\w*Async|Memset\w*Async"
                       r"|MemsetD\w*Async)")
GRAPH_LAUNCH = re.compile(r"^(cuda|cu)GraphLaunch")
SYNTHETIC_NODE_BASE = 1 << 50


def map_graph_replays(trace, capture_range: str = CAPTURE_RANGE):
    """Return ``trace`` with ``graph_nodes`` (and kernel ``graph_node_id`` where Kineto had none) mapping each
    replayed activity to its capture-time launch; see the module docstring. ``meta["graph_mapping"]`` records
    ``"ok: N node(s), M replay(s)"`` or the reason nothing was mapped."""
    meta = dict(trace.meta)
    ranges, launches, kernels = trace.ranges, trace.launches, trace.kernels.copy()
    marks = ranges[ranges["name"].astype(str) == capture_range]
    if marks.empty:
        meta["graph_mapping"] = f"none: no {capture_range} range in the trace"
        return _with(trace, kernels, trace.graph_nodes, meta)
    mark = marks.iloc[0]
    names = launches["name"].astype(str)
    inside = ((launches["start_ns"] >= mark.start_ns) & (launches["end_ns"] <= mark.end_ns)
              & (launches["pid"] == mark.pid) & (launches["tid"] == mark.tid))
    inside &= _stream_capture_window(launches, inside, names)
    captured = _outermost(launches[inside & names.str.match(NODE_CALL)])
    graph_launches = launches[names.str.match(GRAPH_LAUNCH) & (launches["start_ns"] >= mark.end_ns)]
    replayed = kernels["correlation_id"].isin(graph_launches["correlation_id"]) & (kernels["correlation_id"] >= 0)
    if captured.empty or not replayed.any():
        meta["graph_mapping"] = (f"none: {len(captured)} capture-time launch(es), "
                                 f"{int(replayed.sum())} replayed activity(ies)")
        return _with(trace, kernels, trace.graph_nodes, meta)

    captured = captured.reset_index(drop=True)
    n = len(captured)
    call_kinds = captured["name"].astype(str).map(_call_kind).to_numpy()
    positions_by_kind = {kind: np.flatnonzero(call_kinds == kind) for kind in ("kernel", "memcpy", "memset")}
    by_node_id = bool((kernels.loc[replayed, "graph_node_id"] >= 0).all())
    order_key = ["graph_node_id", "start_ns"] if by_node_id else ["start_ns"]
    node_ids: dict[int, int] = {}  # graph_node_id -> capture position
    unrecorded: set[str] = set()
    mapped, skipped = 0, 0
    new_ids = kernels["graph_node_id"].to_numpy().copy()
    for _, group in kernels[replayed].groupby("correlation_id", sort=False):
        group = group.sort_values(order_key, kind="stable")
        position = _replay_positions(group["kind"].astype(str).to_numpy(), positions_by_kind, unrecorded)
        if position is None:
            skipped += 1
            continue
        if by_node_id:
            for node_id, pos in zip(group["graph_node_id"].to_numpy(), position):
                if node_ids.setdefault(int(node_id), int(pos)) != pos:
                    meta["graph_mapping"] = "none: Kineto's graph node ids do not follow the capture order"
                    return _with(trace, trace.kernels.copy(), trace.graph_nodes, meta)
        else:
            new_ids[group.index.to_numpy()] = SYNTHETIC_NODE_BASE + position
            node_ids.update((SYNTHETIC_NODE_BASE + int(p), int(p)) for p in position)
        mapped += 1
    if not by_node_id:
        kernels["graph_node_id"] = new_ids
    if mapped == 0:
        meta["graph_mapping"] = (f"none: replays have {sorted(set(kernels[replayed].groupby('correlation_id').size()))} "
                                 f"activities, the capture made {n} node-creating launch(es)")
        return _with(trace, trace.kernels.copy(), trace.graph_nodes, meta)
    calls = captured
    positions = np.fromiter(node_ids.values(), dtype=np.int64, count=len(node_ids))
    graph_nodes = pd.DataFrame({
        "graph_id": -1,
        "graph_node_id": np.fromiter(node_ids.keys(), dtype=np.int64, count=len(node_ids)),
        "correlation_id": calls["correlation_id"].to_numpy()[positions],
        "pid": calls["pid"].to_numpy()[positions],
        "tid": calls["tid"].to_numpy()[positions],
        "start_ns": calls["start_ns"].to_numpy()[positions],
        "end_ns": calls["end_ns"].to_numpy()[positions],
    })
    meta["graph_mapping"] = (f"ok: {len(node_ids)} node(s), {mapped} replay(s) mapped by "
                             f"{'graph node id' if by_node_id else 'start order'}"
                             + (f", {skipped} replay(s) with another activity count left unmapped" if skipped else "")
                             + (f"; no replay activity recorded for the {'/'.join(sorted(unrecorded))} node(s)"
                                if unrecorded else ""))
    return _with(trace, kernels, graph_nodes, meta)


def _stream_capture_window(launches: pd.DataFrame, inside: pd.Series, names: pd.Series) -> pd.Series:
    """Launch calls between ``cudaStreamBeginCapture`` and ``cudaStreamEndCapture`` when the capture range holds
    both: work launched in the range but before or after the stream capture (buffers zeroed or filled for the graph)
    runs once and makes no node. All calls when the range does not hold them."""
    begins = launches[inside & names.str.startswith("cudaStreamBeginCapture")]
    ends = launches[inside & names.str.startswith("cudaStreamEndCapture")]
    if begins.empty or ends.empty:
        return pd.Series(True, index=launches.index)
    return (launches["start_ns"] >= begins["end_ns"].min()) & (launches["end_ns"] <= ends["start_ns"].max())


def _call_kind(name: str) -> str:
    return "memcpy" if "Memcpy" in name else "memset" if "Memset" in name else "kernel"


def _replay_positions(kinds: np.ndarray, positions_by_kind: dict, unrecorded: set) -> np.ndarray | None:
    """Capture position of each activity of one replay (in replay order), matched kind by kind: the i-th kernel of
    the replay is the i-th kernel launch of the capture, likewise for memcpy and memset. A kind with capture-time
    calls but no activity in the replay is one Kineto does not record for graph replays (it drops their memcpy
    nodes); it is noted in `unrecorded`. None when the counts do not match."""
    position = np.full(len(kinds), -1, dtype=np.int64)
    for kind, calls in positions_by_kind.items():
        rows = np.flatnonzero(kinds == kind)
        if rows.size == 0:
            if calls.size:
                unrecorded.add(kind)
            continue
        if rows.size != calls.size:
            return None
        position[rows] = calls
    return None if (position < 0).any() else position


def _outermost(calls: pd.DataFrame) -> pd.DataFrame:
    """Calls in start order without those nested in another one: a runtime launch that Kineto also reports as the
    driver launch it makes (cudaLaunchKernelExC around cuLaunchKernelEx) creates one node, not two."""
    calls = calls.sort_values(["start_ns", "end_ns"], ascending=[True, False], kind="stable")
    ends = calls["end_ns"].to_numpy()
    covered = np.zeros(len(calls), dtype=bool)
    if len(calls) > 1:
        covered[1:] = ends[1:] <= np.maximum.accumulate(ends)[:-1]
    return calls[~covered]


def _with(trace, kernels, graph_nodes, meta):
    from analyzers.trace import Trace

    return Trace(kernels=kernels, launches=trace.launches, ranges=trace.ranges.drop(columns="depth"),
                 graph_nodes=graph_nodes, meta=meta)


def profile():
    """A ``torch.profiler.profile`` that records what kprof reads (CPU ranges and launches, CUDA activity)."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    return torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
