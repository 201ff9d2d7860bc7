"""The torch.profiler recorder's graph-replay node mapping, on synthetic Kineto traces."""
import json

import pytest

from analyzers.layers import analyze
from profiler.readers import read_kineto_json
from profiler.recorders import CAPTURE_RANGE, trim_to_capture
from profiler.recorders.torch_profiler import SYNTHETIC_NODE_BASE, map_graph_replays

STAGES = ("qkv_proj", "o_proj")


def _x(cat, name, ts, dur, **args):
    event = {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}
    if args:
        event["args"] = args
    return event


def kineto_trace(tmp_path, steps=2, node_ids=False, replay_kernels=4, launch="cudaLaunchKernel"):
    """Warm-up kernel, capture of two layers x two stages (one launch each), then ``steps`` graph replays.
    Times in µs. With ``node_ids``, kernels carry Kineto's graph node ids and run in an order that is not the
    capture order (two capture streams)."""
    events = [_x("user_annotation", "decode_step", 1, 5), _x("cuda_runtime", "cudaLaunchKernel", 2, 1, correlation=1),
              _x("kernel", "warm", 3, 1, correlation=1, device=0, stream=7)]
    events.append(_x("user_annotation", CAPTURE_RANGE, 100, 100))
    events.append(_x("user_annotation", "decode_step", 101, 98))
    corr = 10
    for layer, lo in ((1, 102), (2, 150)):
        events.append(_x("user_annotation", f"layer[{layer}]:mla", lo, 45))
        for s, stage in enumerate(STAGES):
            a = lo + 1 + 20 * s
            events.append(_x("user_annotation", stage, a, 15))
            events.append(_x("cuda_runtime", launch, a + 1, 2, correlation=corr))
            corr += 1
    events.append(_x("cuda_runtime", "cudaStreamSynchronize", 199, 0.5, correlation=corr))
    for step in range(steps):
        t0 = 300 + 100 * step
        launch_corr = 500 + step
        events.append(_x("user_annotation", "decode_step", t0, 5))
        events.append(_x("cuda_runtime", "cudaGraphLaunch", t0 + 1, 2, correlation=launch_corr))
        order = [1, 0, 3, 2] if node_ids else list(range(replay_kernels))
        for slot, i in enumerate(order[:replay_kernels]):
            args = {"correlation": launch_corr, "device": 0, "stream": 7}
            if node_ids:
                args["graph node id"] = 70 + i
                args["graph id"] = 3
            events.append(_x("kernel", f"k{i}", t0 + 10 + 10 * slot, 5 + i, **args))
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return read_kineto_json(path)


@pytest.mark.parametrize("node_ids", [False, True])
def test_replayed_kernels_map_to_the_stage_of_their_capture_time_launch(tmp_path, node_ids):
    trace = trim_to_capture(map_graph_replays(kineto_trace(tmp_path, steps=3, node_ids=node_ids)))
    assert trace.meta["graph_mapping"].startswith("ok: 4 node(s), 3 replay(s)")
    result = analyze(trace)
    assert result["steps"] == 3
    assert result["unattributed_kernels"] == 0
    by_layer = {l["layer"]: l for l in result["layers"]}
    assert by_layer[1]["kernels_per_step"] == 2 and by_layer[2]["kernels_per_step"] == 2
    # k{i} is the i-th captured launch: layer 1 runs k0 (qkv_proj) and k1 (o_proj), each 5+i µs long.
    assert {s["name"]: s["kernel_us"] for s in by_layer[1]["stages"]} == {"qkv_proj": 5.0, "o_proj": 6.0}
    assert {s["name"]: s["kernel_us"] for s in by_layer[2]["stages"]} == {"qkv_proj": 7.0, "o_proj": 8.0}


def test_start_order_mapping_gives_every_replay_the_same_synthetic_node_ids(tmp_path):
    trace = map_graph_replays(kineto_trace(tmp_path, steps=2))
    replayed = trace.kernels[trace.kernels["correlation_id"] >= 500]
    assert sorted(set(replayed["graph_node_id"])) == [SYNTHETIC_NODE_BASE + i for i in range(4)]
    assert sorted(trace.graph_nodes["correlation_id"]) == [10, 11, 12, 13]


def test_driver_launches_count_as_capture_time_launches(tmp_path):
    trace = map_graph_replays(kineto_trace(tmp_path, launch="cuLaunchKernelEx"))
    assert trace.meta["graph_mapping"].startswith("ok")


def test_replays_whose_kernel_count_differs_stay_unmapped_with_a_reason(tmp_path):
    trace = map_graph_replays(kineto_trace(tmp_path, replay_kernels=3))
    assert trace.meta["graph_mapping"].startswith("none: replays have [3] activities, the capture made 4")
    assert trace.graph_nodes.empty
    assert analyze(trim_to_capture(trace))["unattributed_kernels"] == 6


def test_a_trace_without_capture_range_is_left_unmapped(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [
        _x("cuda_runtime", "cudaLaunchKernel", 2, 1, correlation=1),
        _x("kernel", "k", 3, 1, correlation=1, device=0, stream=7)]}))
    trace = map_graph_replays(read_kineto_json(path))
    assert trace.meta["graph_mapping"].startswith("none: no kprof:graph_capture range")


def test_a_driver_launch_nested_in_its_runtime_launch_counts_once(tmp_path):
    trace = kineto_trace(tmp_path, steps=2, launch="cudaLaunchKernelExC")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    nested = [dict(e, name="cuLaunchKernelEx", cat="cuda_driver", ts=e["ts"] + 0.5, dur=e["dur"] - 1,
                   args={"correlation": e["args"]["correlation"] + 1000})
              for e in events if e.get("name") == "cudaLaunchKernelExC"][:2]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events + nested}))
    trace = trim_to_capture(map_graph_replays(read_kineto_json(tmp_path / "trace.json")))
    assert trace.meta["graph_mapping"].startswith("ok: 4 node(s), 2 replay(s)"), trace.meta["graph_mapping"]
    assert analyze(trace)["unattributed_kernels"] == 0


def test_memcpy_nodes_without_replay_activity_leave_the_kernels_mapped(tmp_path):
    """As on the H200: the captured step starts with two device-to-device copies (memcpy nodes) that Kineto does
    not report in the replays; the kernels must still map, by kind."""
    kineto_trace(tmp_path, steps=2)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    copies = [_x("cuda_runtime", "cudaMemcpyAsync", 101.2 + 0.2 * i, 0.1, correlation=900 + i) for i in range(2)]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events + copies}))
    trace = trim_to_capture(map_graph_replays(read_kineto_json(tmp_path / "trace.json")))
    assert trace.meta["graph_mapping"].startswith("ok: 4 node(s), 2 replay(s)"), trace.meta["graph_mapping"]
    assert "memcpy" in trace.meta["graph_mapping"]
    result = analyze(trace)
    assert result["unattributed_kernels"] == 0
    assert [l["kernels_per_step"] for l in result["layers"]] == [2.0, 2.0]


def test_launches_outside_the_stream_capture_make_no_nodes(tmp_path):
    """As on the H200: inside kprof's capture range, two fill kernels run before cudaStreamBeginCapture (buffers set
    up for the graph, run once); only launches between BeginCapture and EndCapture are graph nodes."""
    kineto_trace(tmp_path, steps=2)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    extra = [_x("cuda_runtime", "cudaLaunchKernel", 100.2 + 0.2 * i, 0.1, correlation=950 + i) for i in range(2)]
    extra += [_x("cuda_runtime", "cudaStreamBeginCapture", 100.8, 0.1, correlation=960),
              _x("cuda_runtime", "cudaStreamEndCapture", 198, 0.5, correlation=961)]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events + extra}))
    trace = trim_to_capture(map_graph_replays(read_kineto_json(tmp_path / "trace.json")))
    assert trace.meta["graph_mapping"].startswith("ok: 4 node(s), 2 replay(s)"), trace.meta["graph_mapping"]
    assert analyze(trace)["unattributed_kernels"] == 0
