"""Layer metrics on traces built as DataFrames, and the streaming Kineto reader on awkward JSON."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from analyzers.layers import analyze, kernel_layers
from analyzers.trace import Trace
from profiler.readers import kineto_json, read_trace


def _trace(ranges, launches, kernels) -> Trace:
    """ranges: (name, start, end); launches: (correlation, start, end); kernels: (correlation, stream, start, end),
    all on thread 1 of process 1, in ns."""
    return Trace(
        ranges=pd.DataFrame([{"pid": 1, "tid": 1, "start_ns": s, "end_ns": e, "name": n} for n, s, e in ranges],
                            columns=["pid", "tid", "start_ns", "end_ns", "name"]),
        launches=pd.DataFrame([{"pid": 1, "tid": 1, "start_ns": s, "end_ns": e, "name": "cudaLaunchKernel",
                                "correlation_id": c} for c, s, e in launches]),
        kernels=pd.DataFrame([{"kind": "kernel", "stream": st, "start_ns": s, "end_ns": e, "name": f"k{c}",
                               "correlation_id": c} for c, st, s, e in kernels]),
    )


def test_without_decode_step_ranges_the_whole_trace_is_one_step():
    trace = _trace([("layer[3]:dense", 0, 100), ("router", 10, 20), ("layer[3]:dense", 200, 300)],
                   [(1, 11, 12), (2, 30, 31), (3, 210, 211)],
                   [(1, 7, 1000, 1010), (2, 7, 1005, 1030), (3, 8, 1100, 1110)])
    result = analyze(trace)
    assert (result["steps"], result["unattributed_kernels"]) == (1, 0)
    [layer] = result["layers"]
    assert (layer["layer"], layer["kind"], layer["kernels_per_step"]) == (3, "dense", 3.0)
    assert (layer["kernel_us"], layer["busy_us"], layer["span_us"]) == (0.045, 0.04, 0.11)
    assert layer["stages"] == [{"name": "router", "kernels_per_step": 1.0, "kernel_us": 0.01, "busy_us": 0.01,
                                "span_us": 0.01}]


def test_a_prefetch_range_inside_another_stage_is_its_own_stage():
    """A prefetch launched from inside kda_core (to run beside it) is the prefetch stage; other ranges nested in a
    stage still roll up into it, and a prefetch range outside every layer labels nothing."""
    trace = _trace([("decode_step", 0, 1000), ("layer[1]:kda", 10, 500), ("kda_core", 20, 100),
                    ("prefetch", 30, 40), ("cublas", 50, 60), ("prefetch", 600, 610)],
                   [(1, 31, 32), (2, 51, 52), (3, 70, 71), (4, 601, 602)],
                   [(1, 7, 2000, 2100), (2, 7, 2010, 2020), (3, 8, 2030, 2040), (4, 9, 2200, 2210)])
    labels = kernel_layers(trace)
    assert labels["stage"].tolist() == ["prefetch", "kda_core", "kda_core", ""]
    assert labels["layer"].tolist() == [1, 1, 1, -1]
    [layer] = analyze(trace)["layers"]
    assert {st["name"]: st["kernels_per_step"] for st in layer["stages"]} == {"prefetch": 1.0, "kda_core": 2.0}


def test_kernels_without_ranges_or_launches_are_counted_unattributed_not_dropped():
    trace = _trace([], [(1, 0, 1)], [(1, 7, 10, 20), (2, 7, 30, 40)])  # kernel 2 has no launch call
    result = analyze(trace)
    assert (result["steps"], result["unattributed_kernels"], result["layers"]) == (1, 2, [])


def test_kernels_launched_in_a_layer_outside_any_decode_step_are_unattributed():
    trace = _trace([("layer[0]:kda", 0, 50), ("decode_step", 100, 200), ("layer[0]:kda", 110, 150)],
                   [(1, 10, 11), (2, 120, 121)], [(1, 7, 300, 310), (2, 7, 320, 330)])
    labels = kernel_layers(trace)
    assert labels["step"].tolist() == [-1, 1] and labels["layer"].tolist() == [0, 0]
    assert analyze(trace)["unattributed_kernels"] == 1


def test_launch_must_lie_inside_the_range_on_the_same_thread():
    trace = _trace([("decode_step", 0, 100), ("layer[0]:kda", 10, 50)], [(1, 49, 51)], [(1, 7, 60, 70)])
    assert kernel_layers(trace)["layer"].tolist() == [-1]  # the call ends after the layer range closed
    other_thread = trace.launches.assign(tid=2, start_ns=20, end_ns=21)
    trace = Trace(kernels=trace.kernels, launches=other_thread, ranges=trace.ranges)
    assert kernel_layers(trace)["step"].tolist() == [-1]


def test_streaming_reader_cuts_batches_only_between_events(tmp_path, monkeypatch):
    # Tiny read chunks force many batch boundaries; names and args hold '}, {' and nested objects that look like
    # event boundaries.
    monkeypatch.setattr(kineto_json, "_CHUNK", 97)
    events = []
    for c in range(1, 40):
        events.append({"args": {"nested": [{"a": 1}, {"b": {"c": 2}}], "correlation": c}, "ph": "X",
                       "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": c * 10.0,
                       "dur": 1.0})
        events.append({"ph": "X", "cat": "kernel", "name": f'tricky}}, {{"ph": "X"}} \\" kernel {c}', "pid": 0,
                       "tid": 7, "ts": c * 10.0 + 5.5, "dur": 2.25,
                       "args": {"device": 0, "stream": 7, "correlation": c, "grid": [1, 1, 1]}})
    path = tmp_path / "tricky.json"
    path.write_text(json.dumps({"meta": {"x": "]}"}, "traceEvents": events, "after": [1, {"y": 2}]}))
    trace = read_trace(path)
    assert len(trace.kernels) == 39 and len(trace.launches) == 39
    assert trace.kernels["name"].iloc[0] == 'tricky}, {"ph": "X"} \\" kernel 1'
    assert trace.kernels["start_ns"].tolist() == [c * 10_000 + 5_500 for c in range(1, 40)]
    assert (trace.kernels["end_ns"] - trace.kernels["start_ns"]).eq(2_250).all()


@pytest.mark.parametrize("layout", ["array", "bom"])
def test_kineto_reader_accepts_the_array_format_and_a_byte_order_mark(tmp_path, layout):
    events = [{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1.0, "dur": 1.0,
               "args": {"correlation": 1}}]
    text = json.dumps(events if layout == "array" else {"traceEvents": events})
    path = tmp_path / "t.json"
    path.write_bytes((b"\xef\xbb\xbf" if layout == "bom" else b"") + text.encode())
    assert read_trace(path).kernels["stream"].tolist() == [7]
