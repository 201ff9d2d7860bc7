"""The CUPTI recorder's record-to-Trace conversion, on synthetic records shaped like cupti-python's."""
from types import SimpleNamespace as NS

import numpy as np
import pytest

from analyzers.layers import analyze
from profiler.recorders import CAPTURE_RANGE, CAPTURED_STEP, merge_traces, trim_to_capture
from profiler.recorders.cupti import (MARKER_END, MARKER_INSTANTANEOUS, MARKER_START, CuptiRecords, extract,
                                      marker_ranges, records_to_trace)

PID, TID = 4242, 4250
KINDS = {10: "kernel", 1: "memcpy", 2: "memset", 5: "runtime", 6: "driver", 7: "marker"}


def _marker_pair(records, mid, start, end, name, domain="kimi_decode", tid=TID):
    records.markers.append((mid, MARKER_START, start, name, domain, PID, tid))
    records.markers.append((mid, MARKER_END, end, None, domain, PID, tid))


def graph_records(steps=2, tid_in_nodes=TID) -> CuptiRecords:
    """Warm-up, then a capture of one step (two layers, two stages each, one kernel per stage), then ``steps``
    replays. Times in ns; node ids: 11..14 created at capture, 21..24 their clones at instantiation."""
    r = CuptiRecords(pid=PID)
    # Warm-up: an eager step whose kernel must be dropped by trim_to_capture.
    _marker_pair(r, 1, 100, 200, "decode_step")
    _marker_pair(r, 2, 110, 190, "layer[1]:kda")
    r.apis.append((PID, TID, 120, 130, "cudaLaunchKernel_v7000", 900))
    r.kernels.append(("kernel", 0, 7, 140, 150, "warm", 900, 0, 0, 0))
    # Capture.
    _marker_pair(r, 3, 1000, 2000, CAPTURE_RANGE, domain="kprof")
    _marker_pair(r, 4, 1010, 1990, "decode_step")
    node = 11
    for layer, (lo, hi) in enumerate(((1020, 1500), (1510, 1980)), start=1):
        _marker_pair(r, 10 * layer, lo, hi, f"layer[{layer}]:mla")
        for s, stage in enumerate(("qkv_proj", "o_proj")):
            a = lo + 10 + 200 * s
            _marker_pair(r, 10 * layer + s + 1, a, a + 100, stage)
            r.apis.append((PID, TID, a + 20, a + 40, "cuLaunchKernelEx", 1000 + node))
            r.nodes.append((1, node, -1, tid_in_nodes, 99, a + 30))
            node += 1
    for created in range(11, 15):
        r.nodes.append((2, created + 10, created, tid_in_nodes, 99, 2100))
    # Replays: every kernel carries the cudaGraphLaunch correlation id.
    for step in range(steps):
        t0 = 3000 + 1000 * step
        _marker_pair(r, 100 + step, t0, t0 + 50, "decode_step")
        r.apis.append((PID, TID, t0 + 10, t0 + 30, "cudaGraphLaunch_v10000", 5000 + step))
        for i, clone in enumerate(range(21, 25)):
            k0 = t0 + 100 + 100 * i
            r.kernels.append(("kernel", 0, 7, k0, k0 + 50 + i, f"k{i}", 5000 + step, 2, clone, clone - 10))
    return r


def test_marker_pairs_nested_push_pop_become_ranges_with_thread():
    r = CuptiRecords(pid=PID)
    _marker_pair(r, 1, 0, 100, "outer")
    _marker_pair(r, 2, 10, 50, "inner")
    ranges = marker_ranges(r.markers)
    assert sorted(ranges) == [(PID, TID, 0, 100, "outer", "kimi_decode"), (PID, TID, 10, 50, "inner", "kimi_decode")]


def test_marker_end_without_matching_id_closes_innermost_range_of_its_thread():
    markers = [(1, MARKER_START, 0, "a", None, PID, TID), (2, MARKER_START, 5, "b", None, PID, TID),
               (77, 0, 8, None, None, PID, TID), (78, 0, 9, None, None, PID, TID)]
    assert marker_ranges(markers) == [(PID, TID, 5, 8, "b", ""), (PID, TID, 0, 9, "a", "")]


def test_marker_instantaneous_unclosed_and_cross_thread_ranges_are_left_out():
    markers = [(1, MARKER_INSTANTANEOUS, 0, "mark", None, PID, TID),
               (2, MARKER_START, 1, "open", None, PID, TID),
               (3, MARKER_START, 2, "moved", None, PID, TID), (3, MARKER_END, 4, None, None, PID, TID + 1)]
    assert marker_ranges(markers) == []


def test_extract_copies_each_kind_into_a_row():
    pt = NS(process_id=PID, thread_id=TID)
    kernel = NS(kind=10, name="_Z3addPf", device_id=0, stream_id=7, start=5, end=9, correlation_id=3, graph_id=2,
                graph_node_id=21, source_graph_node_id=11)
    memcpy = NS(kind=1, copy_kind=8, device_id=0, stream_id=7, start=1, end=2, correlation_id=4, graph_id=0,
                graph_node_id=0)
    api = NS(kind=5, process_id=PID, thread_id=TID, start=1, end=3, cbid=211, correlation_id=3)
    marker = NS(kind=7, id=9, flags_=MARKER_START, timestamp=4, name="x", domain="d", object_id=NS(pt=pt))
    name = lambda kind, cbid: f"{kind}:{cbid}"  # noqa: E731
    assert extract(kernel, KINDS, name) == ("kernels", ("kernel", 0, 7, 5, 9, "_Z3addPf", 3, 2, 21, 11))
    assert extract(memcpy, KINDS, name) == ("kernels", ("memcpy", 0, 7, 1, 2, "Memcpy DtoD", 4, 0, 0, 0))
    assert extract(api, KINDS, name) == ("apis", (PID, TID, 1, 3, "runtime:211", 3))
    assert extract(marker, KINDS, name) == ("markers", (9, MARKER_START, 4, "x", "d", PID, TID))
    assert extract(NS(kind=99), KINDS, name) is None


def test_records_to_trace_maps_clones_to_their_capture_time_range():
    trace = records_to_trace(graph_records(), {"backend": "auto"})
    assert trace.meta["source"] == "cupti" and trace.meta["backend"] == "auto"
    nodes = trace.graph_nodes.set_index("graph_node_id")
    assert set(nodes.index) == {11, 12, 13, 14, 21, 22, 23, 24}
    assert (nodes.loc[21, ["tid", "start_ns"]] == nodes.loc[11, ["tid", "start_ns"]]).all()
    assert (trace.kernels["pid"] == PID).all()
    warm = trace.kernels[trace.kernels["name"] == "warm"]
    assert warm["graph_node_id"].tolist() == [-1] and warm["graph_id"].tolist() == [-1]


def test_every_replayed_kernel_lands_in_its_layer_and_stage():
    trace = trim_to_capture(records_to_trace(graph_records(steps=3)))
    result = analyze(trace)
    assert result["steps"] == 3
    assert result["unattributed_kernels"] == 0
    assert [(l["layer"], l["kind"], l["kernels_per_step"]) for l in result["layers"]] == [(1, "mla", 2.0),
                                                                                          (2, "mla", 2.0)]
    assert [s["name"] for s in result["layers"][0]["stages"]] == ["qkv_proj", "o_proj"]
    assert result["layers"][1]["kernel_us"] == pytest.approx((52 + 53) / 1000)


def test_source_graph_node_id_maps_replays_when_clone_callbacks_are_missing():
    records = graph_records()
    records.nodes = [n for n in records.nodes if n[2] < 0]
    trace = trim_to_capture(records_to_trace(records))
    assert analyze(trace)["unattributed_kernels"] == 0
    assert {21, 22, 23, 24} <= set(trace.graph_nodes["graph_node_id"])


def test_node_thread_ids_follow_the_kind_the_activity_records_use():
    records = graph_records()
    # The callback's gettid differs from the records' thread ids, its threading.get_ident matches them.
    records.nodes = [(g, n, o, 1, TID, ts) for g, n, o, _, _, ts in records.nodes]
    trace = trim_to_capture(records_to_trace(records))
    assert set(trace.graph_nodes["tid"]) == {TID}
    assert analyze(trace)["unattributed_kernels"] == 0


def test_trim_to_capture_drops_warm_up_and_renames_the_captured_step():
    trace = trim_to_capture(records_to_trace(graph_records(steps=2)))
    names = trace.ranges["name"].astype(str)
    assert "warm" not in set(trace.kernels["name"].astype(str))
    assert (names == "decode_step").sum() == 2 and (names == CAPTURED_STEP).sum() == 1
    assert trace.launches["start_ns"].min() >= 1000


def test_trim_to_capture_leaves_a_trace_without_capture_range_alone():
    records = CuptiRecords(pid=PID)
    records.kernels.append(("kernel", 0, 7, 1, 2, "k", 1, 0, 0, 0))
    trace = records_to_trace(records)
    assert trim_to_capture(trace) is trace


def test_merge_keeps_graph_node_ids_of_two_processes_apart():
    a = records_to_trace(graph_records())
    b = records_to_trace(graph_records())
    merged = merge_traces([a, b], {"source": "cupti"})
    ids = merged.graph_nodes["graph_node_id"]
    assert ids.is_unique and len(ids) == 2 * len(a.graph_nodes)
    replayed = merged.kernels[merged.kernels["graph_node_id"] >= 0]
    assert set(replayed["graph_node_id"]) <= set(ids)
    assert np.array_equal(np.sort(merged.kernels["start_ns"]), np.sort(np.r_[a.kernels.start_ns, b.kernels.start_ns]))


def test_records_to_trace_demangles_kernel_names_when_cxxfilt_exists():
    import shutil

    records = CuptiRecords(pid=PID)
    records.kernels.append(("kernel", 0, 7, 1, 2, "_Z3addPfS_", 1, 0, 0, 0))
    name = str(records_to_trace(records).kernels["name"].iloc[0])
    assert name == ("add(float*, float*)" if shutil.which("c++filt") else "_Z3addPfS_")


def test_instantiated_copy_reported_as_created_nodes_maps_to_the_capture():
    """As seen on the H200 (CUDA 13): cudaGraphInstantiate's copy arrives as GRAPHNODE_CREATED records (no clone
    records, no source node id on the kernels), numbered graph_id << 32 | index, plus extra non-kernel nodes."""
    records = graph_records(steps=2)
    captured = [n for n in records.nodes if n[2] < 0]
    renumber = {old: (1 << 32) | i for i, old in enumerate(range(11, 15))}
    copy = {old + 10: (2 << 32) | i for i, old in enumerate(range(11, 15))}
    records.nodes = [(g, renumber[node], -1, tid, ident, ts) for g, node, _, tid, ident, ts in captured]
    records.nodes += [(2, (2 << 32) | i, -1, TID, 99, 2100 + i) for i in range(6)]  # 4 copies, 2 extra nodes
    records.apis.append((PID, TID, 2090, 2200, "cudaGraphInstantiateWithFlags_v11040", 4000))
    records.kernels = [k[:8] + (copy.get(k[8], k[8]), 0) for k in records.kernels]
    trace = trim_to_capture(records_to_trace(records))
    result = analyze(trace)
    assert result["unattributed_kernels"] == 0
    assert [(l["layer"], l["kernels_per_step"]) for l in result["layers"]] == [(1, 2.0), (2, 2.0)]


def test_a_second_capture_is_not_taken_for_a_copy():
    records = graph_records(steps=1)
    # no instantiate call in the records: graph 2's nodes stay where they were created
    records.nodes = [(g, n, -1, tid, ident, ts) for g, n, _, tid, ident, ts in records.nodes]
    records.kernels = [k[:9] + (0,) for k in records.kernels]
    trace = records_to_trace(records)
    nodes = trace.graph_nodes.set_index("graph_node_id")
    assert nodes.loc[21, "start_ns"] == 2100


def test_clone_link_wins_over_the_clone_own_creation_record():
    records = graph_records(steps=2)
    # the copy's nodes arrive twice: created (at instantiation time) and cloned (with their original)
    records.nodes += [(2, created + 10, -1, TID, 99, 2100) for created in range(11, 15)]
    trace = trim_to_capture(records_to_trace(records))
    assert analyze(trace)["unattributed_kernels"] == 0
    assert trace.meta["graph_node_callbacks"] == {"created": 8, "cloned": 4}
