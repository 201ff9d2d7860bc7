"""Recorders: record a running program's GPU activity into a :class:`~analyzers.trace.Trace`.

``cupti``           in-process, through cupti-python (kernels, memcpy/memset, runtime and driver calls, NVTX ranges,
                    CUDA-graph node creation);
``torch_profiler``  in-process, through torch.profiler (Kineto), with a capture-time node mapping for CUDA graphs;
``nsys``            out-of-process, through Nsight Systems and its SQLite export.

:func:`trim_to_capture` is the post-processing all three share: it keeps the recorded capture and replays and drops
the warm-up that came before.
"""
from __future__ import annotations

# numpy and pandas are imported inside the functions: the start-up hook imports this package in every process of a
# recorded program, and should cost little there.
CAPTURE_RANGE = "kprof:graph_capture"
STEP_RANGE = "decode_step"
CAPTURED_STEP = "captured_step"


class RecorderError(RuntimeError):
    """A recorder that cannot run or cannot produce a trace; the message is one line meant for the user."""


def trim_to_capture(trace, capture_range: str = CAPTURE_RANGE, step_range: str = STEP_RANGE):
    """Keep what happened from the recorded graph capture on, and rename the step range open during the capture.

    The workload warms up (eagerly, and with a first capture) before it opens ``capture_range`` around the graph
    capture it records. Kernels, launches and ranges that start before that range are warm-up and are dropped, so
    they do not count as decode steps. The ``step_range`` ranges inside ``capture_range`` launched no kernel (a
    capture only records), so they are renamed ``captured_step``: analyses then count replayed steps only, while
    the layer and stage ranges under them still attribute the replayed kernels. A trace without ``capture_range``
    is returned unchanged.
    """
    import numpy as np

    from analyzers.trace import Trace

    ranges = trace.ranges
    names = ranges["name"].astype(str)
    marks = ranges[names == capture_range]
    if marks.empty:
        return trace
    start = int(marks["start_ns"].min())
    end = int(marks["end_ns"].max())
    kernels = trace.kernels[trace.kernels["start_ns"] >= start]
    launches = trace.launches[trace.launches["start_ns"] >= start]
    keep = (ranges["start_ns"] >= start).to_numpy()
    ranges = ranges[keep].copy()
    names = names[keep]
    inside = ((ranges["start_ns"] >= start) & (ranges["end_ns"] <= end) & (names == step_range)).to_numpy()
    ranges["name"] = np.where(inside, CAPTURED_STEP, names.to_numpy())
    return Trace(kernels=kernels, launches=launches, ranges=ranges.drop(columns="depth"),
                 graph_nodes=trace.graph_nodes, meta=trace.meta)


def merge_traces(traces: list, meta: dict):
    """One trace from several processes' traces. Graph node ids are only unique within a process, so each
    process's ids are moved into their own range (process index in the bits above 40)."""
    import numpy as np
    import pandas as pd

    from analyzers.trace import Trace

    if len(traces) == 1:
        only = traces[0]
        return Trace(kernels=only.kernels, launches=only.launches, ranges=only.ranges.drop(columns="depth"),
                     graph_nodes=only.graph_nodes, meta=meta)
    kernels, nodes = [], []
    for index, trace in enumerate(traces):
        offset = (index + 1) << 40
        k = trace.kernels.copy()
        k["graph_node_id"] = np.where(k["graph_node_id"] >= 0, k["graph_node_id"] + offset, -1)
        kernels.append(k)
        g = trace.graph_nodes.copy()
        g["graph_node_id"] = g["graph_node_id"] + offset
        nodes.append(g)

    def cat(frames):
        frames = [f.astype({c: str for c in f.columns if isinstance(f[c].dtype, pd.CategoricalDtype)}) for f in frames]
        return pd.concat(frames, ignore_index=True)

    return Trace(kernels=cat(kernels), launches=cat([t.launches for t in traces]),
                 ranges=cat([t.ranges.drop(columns="depth") for t in traces]), graph_nodes=cat(nodes), meta=meta)
