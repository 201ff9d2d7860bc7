"""`kprof capture` error paths, the child-process protocol and Ctrl-C, with stand-in children (no GPU needed)."""
import json
import os
import sys
import textwrap
import time

import pytest
from typer.testing import CliRunner

import profiler.capture as capture
from analyzers.trace import Trace
from profiler.capture import CaptureError, WorkloadOptions, capture_workload, cupti_library, run_child
from profiler.cli import app

runner = CliRunner()

# A stand-in for `python -m profiler.workload`: reads the same JSON, reports progress, then does what MODE says.
FAKE_CHILD = textwrap.dedent("""
    import json, os, sys, time
    args = json.loads(sys.argv[1])
    mode = os.environ["FAKE_MODE"]
    rank, world = args.get("rank", 0), args.get("world", 1)
    open(os.environ["FAKE_PID_FILE"] + (f".{rank}" if world > 1 else ""), "w").write(str(os.getpid()))
    if mode == "rank1-fails":  # rank 0 waits for rank 1 in a collective that never completes
        mode = "fail" if rank == 1 else "wait"
        deadline = time.monotonic() + 10  # rank 1 fails only once rank 0 is running, as in a real collective
        while rank == 1 and not os.path.exists(os.environ["FAKE_PID_FILE"] + ".0") and time.monotonic() < deadline:
            time.sleep(0.01)
    def progress(phase, done, total):
        print("KPROF-PROGRESS " + json.dumps({"phase": phase, "done": done, "total": total}), flush=True)
    progress("warm-up", 1, 1)
    for i in range(30):
        print(f"child line {i}", flush=True)
    if mode == "fail":
        print("RuntimeError: CUDA out of memory", file=sys.stderr, flush=True)
        sys.exit(3)
    if mode == "hang":
        open(args["output"], "wb").write(b"half a capture")
        progress("replay", 1, 50)
        time.sleep(60)
    if mode == "wait":
        open(args["output"], "wb").write(b"half a capture")
        time.sleep(60)
    import pandas as pd
    from analyzers.trace import Trace
    kernels = pd.DataFrame({"kind": ["kernel"], "start_ns": [1], "end_ns": [2], "name": ["k"]})
    progress("replay", args["steps"], args["steps"])
    Trace(kernels=kernels, meta={"backend": args["backend"], "command_line": args["command_line"], "rank": rank,
                                 "world": world, "port": args.get("port")}).save(args["output"])
""")


@pytest.fixture
def fake_child(tmp_path, monkeypatch):
    script = tmp_path / "fake_child.py"
    script.write_text(FAKE_CHILD)
    monkeypatch.setattr(capture, "workload_command", lambda args: [sys.executable, str(script), json.dumps(args)])
    monkeypatch.setattr(capture, "cuda_available", lambda: True)
    monkeypatch.setenv("FAKE_PID_FILE", str(tmp_path / "child.pid"))

    def mode(value):
        monkeypatch.setenv("FAKE_MODE", value)
    return mode


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def one_error_line(result):
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kprof: error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize("profiler", ["torch", "cupti", "nsys"])
@pytest.mark.parametrize("script", [False, True], ids=["workload", "script"])
def test_no_cuda_device_is_one_line_and_exit_2(tmp_path, monkeypatch, profiler, script):
    """Said before anything about the profiler: on a machine without a GPU, installing cupti-python or Nsight
    Systems would not help."""
    if script and profiler == "torch":
        pytest.skip("--profiler torch records only kprof's own workload")
    monkeypatch.setattr(capture, "cuda_available", lambda: False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no nsys
    monkeypatch.setattr(capture, "cupti_library", lambda *a: pytest.fail("the profiler was checked first"))
    tail = ["--", sys.executable, "-c", "pass"] if script else []
    result = runner.invoke(app, ["capture", "--profiler", profiler, "-o", str(tmp_path / "a.kprof"), *tail])
    assert result.exit_code == 2
    assert "no CUDA device" in one_error_line(result)
    assert list(tmp_path.iterdir()) == []


def test_unknown_profiler_is_a_usage_error(tmp_path):
    result = runner.invoke(app, ["capture", "--profiler", "ncu", "-o", str(tmp_path / "a.kprof")])
    assert result.exit_code == 2
    assert "ncu" in result.output


def test_unknown_backend_names_the_available_ones(tmp_path):
    result = runner.invoke(app, ["capture", "--backend", "fastest", "-o", str(tmp_path / "a.kprof")])
    assert result.exit_code == 2
    assert "unknown backend 'fastest'; available: auto" in one_error_line(result)


def test_missing_nsys_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(capture, "cuda_available", lambda: True)
    monkeypatch.setenv("PATH", str(tmp_path))
    result = runner.invoke(app, ["capture", "--profiler", "nsys", "-o", str(tmp_path / "a.kprof")])
    assert result.exit_code == 2
    assert "nsys (Nsight Systems) is not on the PATH" in one_error_line(result)


def test_missing_cupti_python_says_how_to_install_it(tmp_path, monkeypatch):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho '{\"path\": null, \"error\": \"import: ModuleNotFoundError: No module named "
                      "cupti\"}'\n")
    python.chmod(0o755)
    monkeypatch.delenv("KPROF_CUPTI_LIB", raising=False)
    with pytest.raises(CaptureError, match="cupti-python is not installed"):
        cupti_library(str(python))


def test_cupti_library_override_must_exist(tmp_path, monkeypatch):
    monkeypatch.setenv("KPROF_CUPTI_LIB", str(tmp_path / "libcupti.so"))
    with pytest.raises(CaptureError, match="is not a file"):
        cupti_library()
    (tmp_path / "libcupti.so").write_bytes(b"")
    assert cupti_library() == str(tmp_path / "libcupti.so")


@pytest.mark.parametrize("where", ["missing-dir", "is-dir"])
def test_unwritable_output_is_one_line(tmp_path, where):
    output = tmp_path / "nope" / "a.kprof" if where == "missing-dir" else tmp_path
    result = runner.invoke(app, ["capture", "--profiler", "torch", "-o", str(output)])
    assert result.exit_code == 2
    assert f"cannot write {output}" in one_error_line(result)


def test_failing_child_shows_its_last_lines_and_leaves_nothing(tmp_path, fake_child):
    fake_child("fail")
    result = runner.invoke(app, ["capture", "--profiler", "torch", "-o", str(tmp_path / "a.kprof")])
    assert result.exit_code == 1
    assert "kprof: error: the capture process failed (exit 3); its last lines:" in result.output
    assert "  | RuntimeError: CUDA out of memory" in result.output
    assert "child line 29" in result.output and "child line 5\n" not in result.output
    assert leftovers(tmp_path) == [] and not (tmp_path / "a.kprof").exists()


def test_successful_child_output_is_renamed_into_place(tmp_path, fake_child):
    fake_child("ok")
    result = runner.invoke(app, ["capture", "--profiler", "torch", "--steps", "7", "-o", str(tmp_path / "a.kprof")])
    assert result.exit_code == 0, result.output
    trace = Trace.load(tmp_path / "a.kprof")
    assert trace.meta["backend"] == "auto"
    assert leftovers(tmp_path) == []


def test_progress_lines_reach_the_callback_and_other_lines_the_tail(tmp_path, fake_child):
    fake_child("ok")
    seen = []
    capture_workload(WorkloadOptions(steps=5), "torch", tmp_path / "a.kprof", "kprof capture",
                     lambda phase, done, total: seen.append((phase, done, total)))
    assert seen == [("warm-up", 1, 1), ("replay", 5, 5)]
    assert Trace.load(tmp_path / "a.kprof").meta["command_line"] == "kprof capture"


def test_ctrl_c_stops_the_child_and_removes_the_partial_capture(tmp_path, fake_child):
    fake_child("hang")

    def progress(phase, done, total):
        if phase == "replay":
            raise KeyboardInterrupt

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        capture_workload(WorkloadOptions(), "torch", tmp_path / "a.kprof", "", progress)
    assert time.monotonic() - started < 30
    pid = int((tmp_path / "child.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not (tmp_path / "a.kprof").exists()
    assert leftovers(tmp_path) == []


def test_run_child_reports_a_missing_program():
    with pytest.raises(CaptureError, match="cannot run no-such-program-kprof"):
        run_child(["no-such-program-kprof"], dict(os.environ))


def test_script_mode_refuses_the_torch_profiler(tmp_path):
    result = runner.invoke(app, ["capture", "--profiler", "torch", "-o", str(tmp_path / "a.kprof"), "--",
                                 "python", "serve.py"])
    assert result.exit_code == 2
    assert "--profiler torch needs kprof's own workload" in one_error_line(result)


@pytest.mark.slow
def test_cpu_decode_slice_capture_with_the_torch_profiler(tmp_path, monkeypatch):
    """The real child process end to end on the CPU (tiny model, eager steps, no kernels)."""
    monkeypatch.setattr(capture, "cuda_available", lambda: False)
    options = WorkloadOptions(model="tiny", tp=1, layers=2, context=64, steps=3, device="cpu")
    capture_workload(options, "torch", tmp_path / "cpu.kprof", "kprof capture (test)")
    trace = Trace.load(tmp_path / "cpu.kprof")
    names = trace.ranges["name"].astype(str)
    assert (names == "decode_step").sum() == 3
    assert {"layer[1]:kda", "layer[2]:kda", "kprof:graph_capture"} <= set(names)
    assert trace.meta["profiler"] == "torch" and trace.meta["config"]["steps"] == 3
    assert trace.meta["versions"]["torch"] != "absent"
    assert leftovers(tmp_path) == []


# ---- several ranks at once (--gpus) ---------------------------------------------------------------------------------
def test_several_ranks_write_one_capture_each(tmp_path, fake_child, monkeypatch):
    fake_child("ok")
    monkeypatch.setattr(capture, "cuda_device_count", lambda: 4)
    result = runner.invoke(app, ["capture", "--profiler", "torch", "--tp", "4", "--gpus", "4", "-o",
                                 str(tmp_path / "run.kprof")])
    assert result.exit_code == 0, result.output
    metas = [Trace.load(tmp_path / f"run.rank{r}.kprof").meta for r in range(4)]
    assert [m["rank"] for m in metas] == [0, 1, 2, 3] and {m["world"] for m in metas} == {4}
    assert len({m["port"] for m in metas}) == 1  # one rendezvous for the group
    assert not (tmp_path / "run.kprof").exists() and leftovers(tmp_path) == []
    assert f"wrote {tmp_path / 'run.rank3.kprof'}" in result.output


def test_a_failing_rank_stops_the_others_at_once_and_leaves_nothing(tmp_path, fake_child, monkeypatch):
    fake_child("rank1-fails")
    monkeypatch.setattr(capture, "cuda_device_count", lambda: 2)
    started = time.monotonic()
    result = runner.invoke(app, ["capture", "--profiler", "torch", "--tp", "2", "--gpus", "2", "-o",
                                 str(tmp_path / "run.kprof")])
    assert time.monotonic() - started < 20  # rank 0 would wait 60 s
    assert result.exit_code == 1
    assert "kprof: error: rank 1's capture process failed (exit 3); its last lines:" in result.output
    assert "RuntimeError: CUDA out of memory" in result.output
    pid = int((tmp_path / "child.pid.0").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert sorted(p.name for p in tmp_path.iterdir() if "run" in p.name) == []


@pytest.mark.parametrize("args, message", [
    (["--tp", "8", "--gpus", "2"], "--tp must be 2"),
    (["--tp", "4", "--gpus", "4"], "needs 4 CUDA devices; this machine has 2"),
    (["--tp", "2", "--gpus", "2", "--profiler", "nsys"], "--gpus above 1 records with cupti or torch"),
    (["--tp", "2", "--gpus", "0"], "--gpus must be at least 1"),
    (["--gpus", "2", "--", sys.executable, "-c", "pass"], "--gpus applies to the decode slice"),
])
def test_several_rank_usage_errors(tmp_path, fake_child, monkeypatch, args, message):
    fake_child("ok")
    monkeypatch.setattr(capture, "cuda_device_count", lambda: 2)
    monkeypatch.setattr("profiler.recorders.nsys.nsys_path", lambda: "/usr/bin/nsys")
    result = runner.invoke(app, ["capture", "--profiler", "torch", "-o", str(tmp_path / "run.kprof"), *args])
    assert result.exit_code == 2, result.output
    assert message in one_error_line(result)
    assert list(tmp_path.glob("*run*")) == []


@pytest.mark.slow
def test_cpu_tensor_parallel_capture_of_two_ranks_over_gloo(tmp_path, monkeypatch):
    """The real child processes end to end on the CPU: two ranks of the tiny model's TP2 shards, gloo all-reduces."""
    monkeypatch.setattr(capture, "cuda_available", lambda: False)
    options = WorkloadOptions(model="tiny-tp", tp=2, world=2, layers=2, context=64, steps=2, device="cpu")
    capture_workload(options, "torch", tmp_path / "tp2.kprof", "kprof capture (test)")
    for rank in (0, 1):
        trace = Trace.load(tmp_path / f"tp2.rank{rank}.kprof")
        assert (trace.meta["rank"], trace.meta["world"], trace.meta["config"]["tp"]) == (rank, 2, 2)
        names = trace.ranges["name"].astype(str)
        assert (names == "decode_step").sum() == 2
        assert (names == "allreduce").sum() >= 2 * 2 * 2  # three per MoE layer (two on a dense one), every step
    assert leftovers(tmp_path) == []
