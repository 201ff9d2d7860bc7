"""The start-up hook (`kprof capture -- python SCRIPT`) and the CUPTI session, with a stand-in `cupti` module.

The stand-in implements the part of cupti-python's API the recorder calls. Its program-side helper
``simulate_capture()`` plays a graph capture: it fires the GRAPHNODE_CREATED callback on the calling thread at
CUPTI time 1500, inside the ``qkv_proj`` range that its activity flush later reports, along with two replays.
"""
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

import profiler.capture as capture
from analyzers.layers import analyze
from analyzers.trace import Trace
from profiler.capture import HOOK_DIR, collect_hook_records, hook_env
from profiler.cli import app
from test_capture_cupti import graph_records

FAKE_CUPTI = textwrap.dedent('''
    import enum, os, threading
    from types import SimpleNamespace as NS

    class ActivityKind(enum.IntEnum):
        CONCURRENT_KERNEL = 10; MEMCPY = 1; MEMSET = 2; RUNTIME = 5; DRIVER = 6; MARKER = 7
    class ActivityThreadIdType(enum.IntEnum):
        DEFAULT = 0; SYSTEM = 1
    class CallbackDomain(enum.IntEnum):
        RUNTIME_API = 1; DRIVER_API = 2; RESOURCE = 3
    class CallbackIdResource(enum.IntEnum):
        GRAPHNODE_CREATED = 13; GRAPHNODE_CLONED = 20
    class GraphData:
        @staticmethod
        def from_ptr(ptr):
            return NS(node=ptr, graph=1, original_node=0)

    _state = {"kinds": set(), "thread_id_type": 0}
    def set_thread_id_type(kind): _state["thread_id_type"] = int(kind)
    def activity_register_callbacks(requested, completed): _state["completed"] = completed
    def activity_enable(kind): _state["kinds"].add(int(kind))
    def activity_disable(kind): _state["kinds"].discard(int(kind))
    def subscribe(callback, userdata): _state["callback"] = callback; return 7
    def enable_callback(enable, subscriber, domain, cbid): pass
    def unsubscribe(subscriber): pass
    def get_timestamp(): return 1500
    def get_graph_node_id(node): return node
    def get_graph_id(graph): return graph
    def get_callback_name(domain, cbid): return {1: "cudaLaunchKernel_v7000", 2: "cudaGraphLaunch_v10000"}[cbid]

    def simulate_capture():
        """What a program's graph capture triggers: one node created on this thread."""
        _state["tid"] = threading.get_native_id()
        _state["callback"](None, CallbackDomain.RESOURCE, CallbackIdResource.GRAPHNODE_CREATED,
                           NS(resource_descriptor=31))

    def _marker(mid, flags, ts, name, tid):
        return NS(kind=7, id=mid, flags_=flags, timestamp=ts, name=name, domain="kimi_decode",
                  object_id=NS(pt=NS(process_id=os.getpid(), thread_id=tid)))

    def activity_flush_all(flag):
        tid = _state.get("tid")
        if tid is None or not _state["kinds"]:
            return
        pid = os.getpid()
        acts = []
        for mid, (start, end, name) in enumerate([(1000, 2000, "kprof:graph_capture"), (1100, 1900, "decode_step"),
                                                  (1200, 1800, "layer[3]:mla"), (1400, 1600, "qkv_proj"),
                                                  (3000, 3100, "decode_step"), (4000, 4100, "decode_step")]):
            acts += [_marker(mid, 2, start, name, tid), _marker(mid, 4, end, None, tid)]
        acts.append(NS(kind=5, process_id=pid, thread_id=tid, start=1450, end=1550, cbid=1, correlation_id=40))
        for step, t0 in enumerate((3000, 4000)):
            acts.append(NS(kind=5, process_id=pid, thread_id=tid, start=t0 + 10, end=t0 + 20, cbid=2,
                           correlation_id=50 + step))
            acts.append(NS(kind=10, name="gemv", device_id=0, stream_id=7, start=t0 + 30, end=t0 + 45,
                           correlation_id=50 + step, graph_id=2, graph_node_id=61, source_graph_node_id=31))
        _state["completed"](acts)
''')

PROGRAM = textwrap.dedent("""
    import sys
    from cupti import cupti
    cupti.simulate_capture()
    print("program ran with", sys.argv[1:])
""")


@pytest.fixture
def fake_cupti(tmp_path, monkeypatch):
    package = tmp_path / "fake" / "cupti"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from . import cupti\n")
    (package / "cupti.py").write_text(FAKE_CUPTI)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    return tmp_path / "fake"


def run_python(code, env, cwd):
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_hook_records_a_program_and_writes_its_records_at_exit(tmp_path, fake_cupti):
    out = tmp_path / "hook"
    out.mkdir()
    done = run_python(PROGRAM + "\n", hook_env(out, "/nonexistent/libcupti.so"), tmp_path)
    assert done.returncode == 0, done.stderr
    files = list(out.iterdir())
    assert [f.name for f in files] == [f"records.{files[0].name.split('.')[1]}.pkl"]
    records = pickle.loads(files[0].read_bytes())
    assert len(records.kernels) == 2 and len(records.nodes) == 1 and records.errors == []


def test_hook_env_puts_the_hook_first_and_sets_the_injection_path(tmp_path):
    env = hook_env(tmp_path, "/x/libcupti.so.13")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(HOOK_DIR)
    assert env["NVTX_INJECTION64_PATH"] == "/x/libcupti.so.13"
    assert env["KPROF_HOOK_DIR"] == str(tmp_path)


def test_hook_is_inert_without_its_directory_and_chains_the_next_sitecustomize(tmp_path, monkeypatch):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.CHAINED = True\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HOOK_DIR), str(other)]))
    env.pop("KPROF_HOOK_DIR", None)
    done = run_python("import builtins, sys; print(builtins.CHAINED, 'profiler.recorders.cupti' in sys.modules)",
                      env, tmp_path)
    assert done.stdout.split() == ["True", "False"], done.stderr


def test_hook_failure_is_reported_and_the_program_still_runs(tmp_path, monkeypatch):
    out = tmp_path / "hook"
    out.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "empty"))  # no cupti anywhere
    env = hook_env(out, "/nonexistent/libcupti.so")
    done = run_python("print('still here')", env, tmp_path)
    if done.stdout.strip() != "still here":
        pytest.fail(done.stderr)
    errors = list(out.glob("error.*.txt"))
    if not errors:
        pytest.skip("cupti-python is importable here")
    assert "cupti-python is not installed" in errors[0].read_text()
    assert "kprof: hook:" in done.stderr


def test_collect_hook_records_merges_processes(tmp_path):
    for pid in (11, 12):
        records = graph_records()
        records.pid = pid
        (tmp_path / f"records.{pid}.pkl").write_bytes(pickle.dumps(records))
    trace = collect_hook_records(tmp_path, {"profiler": "cupti"})
    assert trace.meta["processes"] == 2 and trace.meta["source"] == "cupti"
    assert set(trace.kernels["pid"]) == {11, 12}
    assert trace.graph_nodes["graph_node_id"].is_unique


def test_collect_hook_records_without_records_names_the_hook_error(tmp_path):
    (tmp_path / "error.5.txt").write_text("CUPTI could not start: ERROR_NOT_INITIALIZED")
    with pytest.raises(capture.CaptureError, match="recorded no GPU kernels: CUPTI could not start"):
        collect_hook_records(tmp_path, {})


def test_capture_script_end_to_end_with_the_hook(tmp_path, fake_cupti, monkeypatch):
    lib = tmp_path / "libcupti.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("KPROF_CUPTI_LIB", str(lib))
    monkeypatch.setattr(capture, "cuda_available", lambda: True)
    script = tmp_path / "serve.py"
    script.write_text(PROGRAM)
    output = tmp_path / "prod.kprof"
    result = CliRunner().invoke(app, ["capture", "-o", str(output), "--", sys.executable, str(script), "--flag"])
    assert result.exit_code == 0, result.output
    assert "program ran with ['--flag']" in result.output
    trace = Trace.load(output)
    assert trace.meta["profiler"] == "cupti" and trace.meta["config"]["command"][-1] == "--flag"
    result = analyze(trace)
    assert result["unattributed_kernels"] == 0
    assert [(l["layer"], l["kernels_per_step"], [s["name"] for s in l["stages"]]) for l in result["layers"]] == [
        (3, 1.0, ["qkv_proj"])]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_capture_script_reports_a_failing_program(tmp_path, fake_cupti, monkeypatch):
    lib = tmp_path / "libcupti.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("KPROF_CUPTI_LIB", str(lib))
    monkeypatch.setattr(capture, "cuda_available", lambda: True)
    result = CliRunner().invoke(app, ["capture", "-o", str(tmp_path / "a.kprof"), "--", sys.executable, "-c",
                                      "print('loading model'); raise SystemExit('bad flag')"])
    assert result.exit_code == 1
    assert "failed (exit 1); its last lines:" in result.output and "  | bad flag" in result.output
    assert not (tmp_path / "a.kprof").exists()
