"""The child process of ``kprof capture``: run the decode slice under one recorder and write the capture.

    python -m profiler.workload --json-args '{"backend": "auto", "tp": 16, ..., "profiler": "cupti",
                                              "output": "runs/.x.kprof.partial"}'

Sequence: start the recorder (CUPTI: before CUDA is initialised), build the slice, warm up (eager steps and a first
graph capture, which compiles every kernel), then, inside a ``kprof:graph_capture`` range, capture the graph that
is recorded, replay it ``steps`` times, synchronise, and write the trace (only the recorded capture and the
replays; see :func:`profiler.recorders.trim_to_capture`) with its metadata to ``output``.

Progress goes to stdout as lines ``KPROF-PROGRESS {"phase": ..., "done": ..., "total": ...}`` (the parent draws
the bars); everything else the child prints is kept by the parent and shown if the child fails. With ``profiler``
``none`` (the Nsight Systems case) nothing is recorded in-process and ``output`` receives the metadata as JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys

PROGRESS_PREFIX = "KPROF-PROGRESS "
VERSIONED = ("torch", "triton", "nvidia-cutlass-dsl", "cupti-python", "nvtx", "kprof")


def progress(phase: str, done: int = 0, total: int = 0) -> None:
    print(PROGRESS_PREFIX + json.dumps({"phase": phase, "done": done, "total": total}), flush=True)


def versions() -> dict:
    """Installed versions of the packages a capture depends on ('absent' when not installed)."""
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "absent"
    try:
        import torch

        found["cuda"] = torch.version.cuda or "absent"
    except ImportError:
        pass
    found["python"] = platform.python_version()
    return found


def driver_version() -> str:
    """The NVIDIA driver version from nvidia-smi, else 'unknown'."""
    tool = shutil.which("nvidia-smi")
    if tool:
        try:
            out = subprocess.run([tool, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=30).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return "unknown"


def gpu_name(device: str = "cuda") -> str | None:
    try:
        import torch

        if torch.device(device).type == "cuda" and torch.cuda.is_available():
            return torch.cuda.get_device_name(torch.device(device))
    except Exception:
        pass
    return None


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def capture_meta(args: dict) -> dict:
    """The capture metadata: GPU, driver, versions, configuration and how the capture was made."""
    config = {k: args[k] for k in ("model", "backend", "tp", "rank", "world", "batch", "first_layer", "layers",
                                   "context", "steps", "warmup", "seed", "device") if k in args}
    return {
        "rank": args.get("rank", 0),
        "world": args.get("world", 1),
        "gpu": gpu_name(args.get("device", "cuda")),
        "driver": driver_version(),
        "versions": versions(),
        "backend": args.get("backend"),
        "batch": args.get("batch"),
        "context": args.get("context"),
        "steps": args.get("steps"),
        "profiler": args.get("profiler"),
        "config": config,
        "command_line": args.get("command_line"),
        "host": platform.node(),
        "started_at": args.get("started_at"),
    }


@contextlib.contextmanager
def capture_range(name: str):
    """A range both NVTX (for CUPTI and Nsight Systems) and torch.profiler see."""
    import nvtx
    import torch

    domain = nvtx.get_domain("kprof")
    domain.push_range(domain.get_event_attributes(message=name))
    rf = torch.profiler.record_function(name) if torch._C._autograd._profiler_enabled() else None
    if rf is not None:
        rf.__enter__()
    try:
        yield
    finally:
        if rf is not None:
            rf.__exit__(None, None, None)
        domain.pop_range()


def run(args: dict) -> None:
    from profiler.recorders import CAPTURE_RANGE, trim_to_capture

    args = {"model": "k3", "rank": 0, "world": 1, "first_layer": 1, "warmup": 2, "seed": 0, "device": "cuda",
            "timeout": 60.0, **args}
    args["started_at"] = now()
    recorder = args["profiler"]
    progress("start", 0, 1)
    session = None
    if recorder == "cupti":
        from profiler.recorders.cupti import CuptiSession, loaded_cupti_library

        session = CuptiSession().start()
    import torch

    from kimi_decode import DecodeSlice

    device = torch.device(args["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kprof: error: no CUDA device is visible to the capture process")
    group = None
    if args["world"] > 1:  # one rank of a tensor-parallel group: this rank's GPU, NCCL (gloo on the CPU)
        from kimi_decode.dist_bench import init_rank

        group = init_rank(args["rank"], args["world"], args["port"], args["timeout"], device.type)
        if device.type == "cuda":
            device = torch.device("cuda", args["rank"])
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    slice_ = DecodeSlice(backend=args["backend"], model=args["model"], tp=args["tp"], rank=args["rank"],
                         batch=args["batch"], first_layer=args["first_layer"], num_layers=args["layers"],
                         context=args["context"], seed=args["seed"], device=device, group=group)
    graphs = device.type == "cuda"
    progress("warm-up", 0, 1)
    if graphs:
        slice_.capture(warmup=args["warmup"])
        torch.cuda.synchronize(device)
    else:
        for _ in range(args["warmup"]):
            slice_.step()
    progress("warm-up", 1, 1)

    prof = None
    if recorder == "torch":
        from profiler.recorders.torch_profiler import profile

        prof = profile()
        prof.__enter__()
    progress("capture", 0, 1)
    with capture_range(CAPTURE_RANGE):
        if graphs:
            slice_.capture(warmup=0)
    if graphs:
        torch.cuda.synchronize(device)
    progress("capture", 1, 1)
    steps = args["steps"]
    every = max(1, steps // 50)
    for i in range(steps):
        slice_.replay()
        if (i + 1) % every == 0 or i + 1 == steps:
            progress("replay", i + 1, steps)
    if graphs:
        torch.cuda.synchronize(device)

    progress("write", 0, 1)
    meta = capture_meta(args)
    meta["finished_at"] = now()
    output = args["output"]
    if recorder == "cupti":
        from profiler.recorders.cupti import records_to_trace

        records = session.stop()
        loaded, injected = loaded_cupti_library(), os.environ.get("NVTX_INJECTION64_PATH")
        meta["cupti_library"] = loaded
        if injected and loaded and os.path.realpath(injected) != loaded:
            print(f"kprof: warning: NVTX_INJECTION64_PATH={injected} is not the libcupti cupti-python loaded "
                  f"({loaded}); NVTX ranges may be missing", file=sys.stderr)
        trace = trim_to_capture(records_to_trace(records, meta))
        trace.save(output)
    elif recorder == "torch":
        import tempfile

        from profiler.readers import read_kineto_json
        from profiler.recorders.torch_profiler import map_graph_replays

        prof.__exit__(None, None, None)
        fd, json_path = tempfile.mkstemp(prefix=".kprof-kineto.", suffix=".json", dir=os.path.dirname(output) or ".")
        os.close(fd)
        try:
            prof.export_chrome_trace(json_path)
            trace = read_kineto_json(json_path)
        finally:
            os.unlink(json_path)
        trace.meta = {**trace.meta, **meta, "source": "kineto_json"}
        trace = trim_to_capture(map_graph_replays(trace))
        trace.save(output)
    else:
        from analyzers.trace import atomic_output

        with atomic_output(output) as stream:
            stream.write(json.dumps(meta).encode())
    if group is not None:
        torch.distributed.destroy_process_group()
    progress("write", 1, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiler.workload", description=__doc__.splitlines()[0])
    parser.add_argument("--json-args", required=True, help="the capture configuration as a JSON object")
    args = json.loads(parser.parse_args(argv).json_args)
    try:
        run(args)
    except KeyboardInterrupt:
        print("kprof: workload interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
