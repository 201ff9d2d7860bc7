"""Layer metrics on traces built as DataFrames, and the streaming Kineto reader on awkward JSON."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from analyzers.intervals import union_length_by_group
from analyzers.layers import analyze, kernel_layers, owned_ns, step_metrics
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
    assert (layer["kernel_us"], layer["busy_us"], layer["span_us"], layer["own_us"]) == (0.045, 0.04, 0.11, 0.04)
    assert layer["stages"] == [{"name": "router", "kernels_per_step": 1.0, "kernel_us": 0.01, "busy_us": 0.01,
                                "span_us": 0.01, "own_us": 0.01}]


def test_a_kernel_launched_early_counts_its_overlap_once_in_own_time():
    """Programmatic dependent launch: layer 2's first kernel starts 20 ns before layer 1's last one ends and waits.
    Busy time counts those 20 ns in both layers; own time only in layer 1, so the layers' own times add up to the
    step's busy time (1000..1160)."""
    trace = _trace([("decode_step", 0, 500), ("layer[1]:kda", 10, 100), ("qkv_proj", 20, 30),
                    ("layer[2]:kda", 100, 200), ("attn_res", 110, 120)],
                   [(1, 21, 22), (2, 111, 112), (3, 115, 116)],
                   [(1, 7, 1000, 1100), (2, 7, 1080, 1150), (3, 7, 1150, 1160)])
    first, second = analyze(trace)["layers"]
    assert (first["busy_us"], first["own_us"]) == (0.1, 0.1)
    assert (second["busy_us"], second["own_us"], second["span_us"]) == (0.08, 0.06, 0.08)
    assert (second["stages"][0]["busy_us"], second["stages"][0]["own_us"]) == (0.08, 0.06)
    assert round(first["own_us"] + second["own_us"], 3) == 0.16


def test_owned_time_goes_to_the_earliest_started_kernel_of_each_step():
    kernels = pd.DataFrame({"step": [0, 0, 0, 0, 1, 1, 1],
                            "start_ns": [5, 0, 20, 8, 0, 0, 3],
                            "end_ns": [30, 10, 25, 9, 4, 6, 3]})
    # step 0: [0, 10) to the second row, [10, 30) to the first, the rest inside those; step 1: ties by row order
    assert owned_ns(kernels).tolist() == [20, 10, 0, 0, 4, 2, 0]
    assert owned_ns(kernels.iloc[:0]).tolist() == []


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


def test_own_times_of_the_committed_pdl_capture_add_up_to_each_step():
    """The committed batch-1 latency_specialized capture runs under programmatic dependent launch: a layer's first
    kernel starts before the layer before it ends. Per step the layers' own times add up to the step's busy time,
    while their busy times count the overlaps twice."""
    trace = read_trace(Path(__file__).parents[1] / "examples/captures/latency_specialized_tp16_b1.kprof")
    kernels = kernel_layers(trace)
    layers, stages = step_metrics(kernels)
    attributed = kernels[(kernels["step"] >= 0) & (kernels["layer"] >= 0)]
    steps = attributed["step"].astype("category")
    busy = union_length_by_group(steps.cat.codes.to_numpy(), attributed["start_ns"], attributed["end_ns"],
                                 len(steps.cat.categories))
    own = layers.groupby("step", sort=True)["own_ns"].sum().to_numpy()
    assert (own == busy).all()
    assert (layers["own_ns"] <= layers["busy_ns"]).all() and (layers["own_ns"] < layers["busy_ns"]).any()
    assert layers.groupby("step")["busy_ns"].sum().gt(pd.Series(busy, index=steps.cat.categories)).any()
    per_layer = stages.groupby(["step", "layer"])["own_ns"].sum()  # the stages split their layer's own time
    assert (per_layer <= layers.set_index(["step", "layer"])["own_ns"].loc[per_layer.index]).all()
