"""One hand-built decode trace written in each input format (Kineto JSON, Nsight Systems SQLite, .kprof) must give
the same, hand-computed, per-layer numbers."""
from __future__ import annotations

import gzip
import json
import math
import sqlite3
from dataclasses import dataclass, field

import pandas as pd
import pytest

from analyzers.layers import analyze
from analyzers.trace import Trace
from profiler.readers import read_trace

PID, TID = 4242, 100


@dataclass
class Scenario:
    """Times in µs. ranges: (name, start, end); launches: (correlation, start, dur, api); kernels: (correlation,
    stream, start, end, name, kind, graph node); capture: (graph node as replayed, node at capture, capture call
    correlation)."""

    ranges: list = field(default_factory=list)
    launches: list = field(default_factory=list)
    kernels: list = field(default_factory=list)
    capture: list = field(default_factory=list)


def eager() -> Scenario:
    """Three decode steps of two layers; kernels on two streams, one running after its range closed, a nested
    sub-range, a repeated stage, a kernel outside any stage, a memcpy, and kernels outside layers and steps."""
    s = Scenario()
    for step, o_proj_us in enumerate((10, 6, 20)):
        o = 1000 * step
        s.ranges += [("decode_step", o, o + 100), ("layer[0]:kda", o + 1, o + 50), ("attn_res", o + 2, o + 10),
                     ("qkv_proj", o + 10, o + 30), ("gemm", o + 13, o + 20), ("attn_res", o + 30, o + 40),
                     ("layer[1]:mla", o + 50, o + 95), ("o_proj", o + 51, o + 60)]
        c = 100 * step
        s.launches += [(c + 1, o + 3, 1, "cudaLaunchKernel"), (c + 2, o + 11, 1, "cudaLaunchKernel"),
                       (c + 3, o + 12, 1, "cuLaunchKernel"), (c + 5, o + 14, 1, "cudaLaunchKernel"),
                       (c + 10, o + 15, 1, "cudaMemcpyAsync"), (c + 4, o + 31, 1, "cudaLaunchKernel"),
                       (c + 6, o + 52, 1, "cudaLaunchKernel"), (c + 7, o + 80, 1, "cudaLaunchKernel"),
                       (c + 8, o + 96, 1, "cudaLaunchKernel")]
        s.kernels += [(c + 1, 7, o + 20, o + 25, "rmsnorm", "kernel", -1),
                      (c + 2, 7, o + 26, o + 30, "gemm_a", "kernel", -1),
                      (c + 3, 8, o + 27, o + 33, "gemm_b", "kernel", -1),
                      (c + 5, 7, o + 36, o + 40, "gemm_a", "kernel", -1),
                      (c + 10, 7, o + 41, o + 42, "Memcpy DtoD", "memcpy", -1),
                      (c + 4, 7, o + 34, o + 36, "rmsnorm", "kernel", -1),
                      (c + 6, 7, o + 60, o + 60 + o_proj_us, "gemm_o", "kernel", -1),
                      (c + 7, 7, o + 71 + o_proj_us - 10, o + 72 + o_proj_us - 10, "add", "kernel", -1),
                      (c + 8, 7, o + 97, o + 98, "sample", "kernel", -1)]
    s.launches.append((999, 5000, 1, "cudaLaunchKernel"))
    s.kernels.append((999, 7, 5001, 5002, "stray", "kernel", -1))
    return s


EAGER_EXPECTED = {
    "steps": 3,
    "unattributed_kernels": 4,
    "layers": [
        {"layer": 0, "kind": "kda", "kernels_per_step": 5.0, "kernel_us": 21.0, "busy_us": 18.0, "span_us": 20.0,
         "own_us": 18.0,
         "stages": [
             {"name": "attn_res", "kernels_per_step": 2.0, "kernel_us": 7.0, "busy_us": 7.0, "span_us": 16.0,
              "own_us": 7.0},
             {"name": "qkv_proj", "kernels_per_step": 3.0, "kernel_us": 14.0, "busy_us": 11.0, "span_us": 14.0,
              "own_us": 11.0}]},
        {"layer": 1, "kind": "mla", "kernels_per_step": 2.0, "kernel_us": 11.0, "busy_us": 11.0, "span_us": 12.0,
         "own_us": 11.0,
         "stages": [
             {"name": "o_proj", "kernels_per_step": 1.0, "kernel_us": 10.0, "busy_us": 10.0, "span_us": 10.0,
              "own_us": 10.0}]},
    ],
}


def graph() -> Scenario:
    """Layers captured into a CUDA graph, then two decode steps that each replay it with one cudaGraphLaunch."""
    s = Scenario()
    s.ranges += [("layer[0]:kda", 10, 40), ("qkv_proj", 11, 20), ("o_proj", 20, 30),
                 ("layer[1]:mla", 40, 60), ("mla_core", 41, 50)]
    for node, at in ((1, 12), (2, 14), (3, 22), (4, 42)):
        s.launches.append((500 + node, at, 1, "cudaLaunchKernel"))
        s.capture.append((100 + node, node, 500 + node))
    for step in range(2):
        o = 1000 + 1000 * step
        s.ranges.append(("decode_step", o, o + 100))
        s.launches.append((600 + step, o + 5, 2, "cudaGraphLaunch"))
        s.kernels += [(600 + step, 7, o + 10, o + 15, "gemm_q", "kernel", 101),
                      (600 + step, 7, o + 15, o + 18, "gemm_kv", "kernel", 102),
                      (600 + step, 9, o + 16, o + 20, "gemm_o", "kernel", 103),
                      (600 + step, 7, o + 21, o + 30, "mla_decode", "kernel", 104)]
    return s


GRAPH_EXPECTED = {
    "steps": 2,
    "unattributed_kernels": 0,
    "layers": [
        {"layer": 0, "kind": "kda", "kernels_per_step": 3.0, "kernel_us": 12.0, "busy_us": 10.0, "span_us": 10.0,
         "own_us": 10.0,
         "stages": [
             {"name": "qkv_proj", "kernels_per_step": 2.0, "kernel_us": 8.0, "busy_us": 8.0, "span_us": 8.0,
              "own_us": 8.0},
             {"name": "o_proj", "kernels_per_step": 1.0, "kernel_us": 4.0, "busy_us": 4.0, "span_us": 4.0,
              "own_us": 2.0}]},
        {"layer": 1, "kind": "mla", "kernels_per_step": 1.0, "kernel_us": 9.0, "busy_us": 9.0, "span_us": 9.0,
         "own_us": 9.0,
         "stages": [
             {"name": "mla_core", "kernels_per_step": 1.0, "kernel_us": 9.0, "busy_us": 9.0, "span_us": 9.0,
              "own_us": 9.0}]},
    ],
}


# --- writers ---------------------------------------------------------------------------------------------------

def _grid(corr: int) -> tuple[int, int, int]:
    """The grid the fixtures give the kernel of launch `corr`."""
    return (corr % 5 + 1, 2, 1)


def write_kineto(s: Scenario, path, gz: bool = False) -> None:
    events = [{"ph": "M", "name": "process_name", "pid": PID, "tid": 0, "ts": 0, "args": {"name": "python"}}]
    for name, start, end in s.ranges:
        events.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": PID, "tid": TID, "ts": start,
                       "dur": end - start, "args": {"External id": 1}})
        # GPU-side projections of record_function: they must not drive attribution.
        events.append({"ph": "X", "cat": "gpu_user_annotation", "name": name, "pid": 0, "tid": 7, "ts": start,
                       "dur": end - start + 500})
    for corr, start, dur, api in s.launches:
        cat = "cuda_driver" if api.startswith("cu") and not api.startswith("cuda") else "cuda_runtime"
        events.append({"ph": "X", "cat": cat, "name": api, "pid": PID, "tid": TID, "ts": start + 0.25,
                       "dur": dur - 0.5, "args": {"cbid": 211, "correlation": corr, "External id": 7}})
        events.append({"ph": "s", "id": corr, "pid": PID, "tid": TID, "ts": start + 0.25, "cat": "ac2g",
                       "name": "ac2g"})
    for corr, stream, start, end, name, kind, node in s.kernels:
        args = {"External id": 7, "device": 0, "stream": stream, "correlation": corr}
        if kind == "kernel":
            args["grid"] = list(_grid(corr))
        if node >= 0:
            args.update({"graph id": 1, "graph node id": node})
        cat = {"kernel": "kernel", "memcpy": "gpu_memcpy", "memset": "gpu_memset"}[kind]
        events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": start,
                       "dur": end - start, "args": args})
        events.append({"ph": "f", "id": corr, "pid": 0, "tid": stream, "ts": start, "cat": "ac2g", "name": "ac2g",
                       "bp": "e"})
    document = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}],
                "distributedInfo": {"rank": 0}, "traceEvents": events, "traceName": "test"}
    text = json.dumps(document, indent=1)
    if gz:
        with gzip.open(path, "wt") as stream:
            stream.write(text)
    else:
        path.write_text(text)


def write_nsys(s: Scenario, path) -> None:
    gtid = (PID << 24) | TID
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT, end INT, deviceId INT, contextId INT, streamId INT,
            correlationId INT, globalPid INT, demangledName INT, shortName INT, mangledName INT, graphId INT,
            graphNodeId INT, gridX INT, gridY INT, gridZ INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INT, end INT, deviceId INT, streamId INT, correlationId INT,
            globalPid INT, copyKind INT, bytes INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT, end INT, eventClass INT, globalTid INT,
            correlationId INT, nameId INT, returnValue INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_DRIVER (start INT, end INT, eventClass INT, globalTid INT,
            correlationId INT, nameId INT, returnValue INT);
        CREATE TABLE NVTX_EVENTS (start INT, end INT, eventType INT, rangeId INT, category INT, color INT,
            text TEXT, globalTid INT, endGlobalTid INT, textId INT, domainId INT);
        CREATE TABLE CUDA_GRAPH_NODE_EVENTS (start INT, end INT, globalTid INT, graphNodeId INT,
            originalGraphNodeId INT, nameId INT);
        CREATE TABLE TARGET_INFO_GPU (id INT, name TEXT);
        INSERT INTO TARGET_INFO_GPU VALUES (0, 'NVIDIA H200');
    """)
    strings: dict[str, int] = {}

    def sid(text: str) -> int:
        if text not in strings:
            strings[text] = len(strings) + 1
            db.execute("INSERT INTO StringIds VALUES (?, ?)", (strings[text], text))
        return strings[text]

    ns = lambda us: int(round(us * 1000))  # noqa: E731
    db.execute("INSERT INTO NVTX_EVENTS (eventType, text, domainId, globalTid) VALUES (75, 'kimi_decode', 1, ?)", (gtid,))
    for i, (name, start, end) in enumerate(s.ranges):
        # Alternate inline text and interned text, as nsys does for registered strings.
        text, text_id = (name, None) if i % 2 else (None, sid(name))
        db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, textId, globalTid, domainId) "
                   "VALUES (?, ?, 59, ?, ?, ?, 1)", (ns(start), ns(end), text, text_id, gtid))
    # A start/end range that ends on another thread is not a per-thread range: it must be ignored.
    db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, endGlobalTid, domainId) "
               "VALUES (0, 99000000, 60, 'layer[9]:dense', ?, ?, 1)", (gtid, gtid + 1))
    for corr, start, dur, api in s.launches:
        table = "DRIVER" if api.startswith("cu") and not api.startswith("cuda") else "RUNTIME"
        db.execute(f"INSERT INTO CUPTI_ACTIVITY_KIND_{table} (start, end, globalTid, correlationId, nameId) "
                   "VALUES (?, ?, ?, ?, ?)", (ns(start + 0.25), ns(start + dur - 0.25), gtid, corr, sid(api)))
    for corr, stream, start, end, name, kind, node in s.kernels:
        if kind == "memcpy":
            db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?, ?, 0, ?, ?, ?, 8, 64)",
                       (ns(start), ns(end), stream, corr, PID << 24))
            continue
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 1, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   (ns(start), ns(end), stream, corr, PID << 24, sid(name), sid(name[:4]), sid("_Z" + name),
                    1 if node >= 0 else None, node if node >= 0 else None, *_grid(corr)))
    launch_at = {corr: start for corr, start, _, _ in s.launches}
    for replayed, captured, corr in s.capture:
        at = ns(launch_at[corr] + 0.4)
        db.execute("INSERT INTO CUDA_GRAPH_NODE_EVENTS VALUES (?, ?, ?, ?, NULL, 1)", (at, at + 100, gtid, captured))
        db.execute("INSERT INTO CUDA_GRAPH_NODE_EVENTS VALUES (900000, 900100, ?, ?, ?, 2)", (gtid, replayed, captured))
    db.commit()
    db.close()


def write_kprof(s: Scenario, path) -> None:
    ns = lambda us: int(round(us * 1000))  # noqa: E731
    kernels = pd.DataFrame([{"kind": kind, "device": 0, "stream": stream, "pid": PID, "start_ns": ns(start),
                             "end_ns": ns(end), "name": name, "correlation_id": corr,
                             "graph_id": 1 if node >= 0 else -1, "graph_node_id": node}
                            for corr, stream, start, end, name, kind, node in s.kernels])
    launches = pd.DataFrame([{"pid": PID, "tid": TID, "start_ns": ns(start + 0.25), "end_ns": ns(start + dur - 0.25),
                              "name": api, "correlation_id": corr} for corr, start, dur, api in s.launches])
    ranges = pd.DataFrame([{"pid": PID, "tid": TID, "start_ns": ns(start), "end_ns": ns(end), "name": name,
                            "domain": "kimi_decode"} for name, start, end in s.ranges])
    nodes = pd.DataFrame([{"graph_id": 1, "graph_node_id": replayed, "correlation_id": corr}
                          for replayed, _, corr in s.capture], columns=["graph_id", "graph_node_id", "correlation_id"])
    nodes = nodes.assign(pid=-1, tid=-1, start_ns=-1, end_ns=-1)
    Trace(kernels=kernels, launches=launches, ranges=ranges, graph_nodes=nodes,
          meta={"source": "cupti", "gpu": "NVIDIA H200", "versions": {"cuda": "12.8"}, "backend": "auto",
                "config": {"batch": 1}}).save(path)


WRITERS = {
    "kineto.json": write_kineto,
    "kineto.json.gz": lambda s, p: write_kineto(s, p, gz=True),
    "nsys.sqlite": write_nsys,
    "run.kprof": write_kprof,
}


def _body(result: dict) -> dict:
    return {k: result[k] for k in ("steps", "unattributed_kernels", "layers")}


# --- tests -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("filename", list(WRITERS))
def test_eager_layers_match_hand_computed_numbers_in_every_format(tmp_path, filename):
    path = tmp_path / filename.replace(".", "_trace.", 1)
    WRITERS[filename](eager(), path)
    result = analyze(read_trace(path))
    assert result["schema"] == "kprof.analyze/1"
    assert _body(result) == EAGER_EXPECTED


@pytest.mark.parametrize("filename", ["nsys.sqlite", "run.kprof"])
def test_graph_replay_kernels_attributed_through_capture_time_ranges(tmp_path, filename):
    path = tmp_path / filename
    WRITERS[filename](graph(), path)
    assert _body(analyze(read_trace(path))) == GRAPH_EXPECTED


def test_graph_replay_without_node_mapping_counts_kernels_as_unattributed(tmp_path):
    # Kineto traces carry no capture-time mapping: replayed kernels fall under the range around cudaGraphLaunch.
    path = tmp_path / "graph.json"
    write_kineto(graph(), path)
    trace = read_trace(path)
    assert sorted(trace.kernels["graph_node_id"].unique()) == [101, 102, 103, 104]
    assert _body(analyze(trace)) == {"steps": 2, "unattributed_kernels": 8, "layers": []}


def test_kineto_reader_keeps_kernels_launches_and_cpu_ranges_only(tmp_path):
    path = tmp_path / "t.json"
    write_kineto(eager(), path)
    trace = read_trace(path)
    assert len(trace.kernels) == 28 and (trace.kernels["kind"] == "memcpy").sum() == 3
    assert len(trace.launches) == 28
    assert set(trace.ranges["domain"]) == {"user_annotation"} and len(trace.ranges) == 24
    assert trace.ranges.loc[trace.ranges["name"] == "gemm", "depth"].tolist() == [3, 3, 3]
    first = trace.kernels.iloc[0]
    assert (first["start_ns"], first["end_ns"], first["stream"], first["correlation_id"]) == (20_000, 25_000, 7, 1)
    assert trace.meta["gpu"] == "NVIDIA H200" and trace.meta["source"] == "kineto_json"


@pytest.mark.parametrize("filename", ["kineto.json", "nsys.sqlite"])
def test_readers_keep_each_kernels_ctas(tmp_path, filename):
    """A kernel's grid (Kineto's ``args.grid``, nsys's gridX / gridY / gridZ) becomes its CTAs; copies have none."""
    path = tmp_path / filename
    WRITERS[filename](eager(), path)
    trace = read_trace(path)
    k = trace.kernels
    kernels = k[k["kind"] == "kernel"]
    assert len(kernels) and (kernels["ctas"] == [math.prod(_grid(c)) for c in kernels["correlation_id"]]).all()
    assert (k.loc[k["kind"] != "kernel", "ctas"] == -1).all()
    trace.save(tmp_path / "run.kprof")  # and the .kprof file keeps them
    assert Trace.load(tmp_path / "run.kprof").kernels["ctas"].tolist() == k["ctas"].tolist()


def test_kineto_reader_leaves_ctas_unknown_without_a_usable_grid(tmp_path):
    events = [{"ph": "X", "cat": "kernel", "name": f"k{i}", "pid": 0, "tid": 7, "ts": 10 * i, "dur": 5,
               "args": {"stream": 7, "correlation": i, **({"grid": grid} if grid is not None else {})}}
              for i, grid in enumerate([[4, 3, 2], None, [0, 1, 1], [2, 2]])]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert read_trace(path).kernels.sort_values("correlation_id")["ctas"].tolist() == [24, -1, -1, -1]


def test_nsys_reader_decodes_names_threads_and_domains(tmp_path):
    path = tmp_path / "t.sqlite"
    write_nsys(eager(), path)
    trace = read_trace(path)
    assert set(trace.kernels["name"]) >= {"rmsnorm", "gemm_a", "Memcpy DtoD"}
    assert set(trace.launches["tid"]) == {TID} and set(trace.launches["pid"]) == {PID}
    assert set(trace.kernels["pid"]) == {PID}
    assert set(trace.ranges["domain"]) == {"kimi_decode"}
    assert "layer[9]:dense" not in set(trace.ranges["name"])
    assert trace.meta["gpu"] == "NVIDIA H200"


def test_nsys_reader_tolerates_missing_optional_tables(tmp_path):
    path = tmp_path / "kernels_only.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT);
        INSERT INTO StringIds VALUES (1, 'k');
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT, end INT, deviceId INT, streamId INT, correlationId INT,
            shortName INT);
        INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (100, 300, 0, 7, 1, 1), (200, 400, 0, 8, 2, 1);
    """)
    db.commit()
    db.close()
    result = analyze(read_trace(path))
    assert _body(result) == {"steps": 1, "unattributed_kernels": 2, "layers": []}


def test_kprof_round_trip_keeps_every_table_and_the_metadata(tmp_path):
    path = tmp_path / "run.kprof"
    write_kprof(graph(), path)
    trace = Trace.load(path)
    trace.save(tmp_path / "again.kprof")
    again = Trace.load(tmp_path / "again.kprof")
    for table in ("kernels", "launches", "ranges", "graph_nodes"):
        pd.testing.assert_frame_equal(getattr(trace, table), getattr(again, table))
    assert again.meta == {"source": "cupti", "gpu": "NVIDIA H200", "versions": {"cuda": "12.8"}, "backend": "auto",
                          "config": {"batch": 1}}
    assert str(again.kernels["start_ns"].dtype) == "int64"
