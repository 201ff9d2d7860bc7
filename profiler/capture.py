"""``kprof capture``: record the decode slice (or any Python program) on the GPU into a ``.kprof`` capture.

Two entry points, both used by the CLI:

:func:`capture_workload`  runs ``python -m profiler.workload`` (the decode slice: warm-up, graph capture, replays)
                          in a child process under the chosen recorder;
:func:`capture_script`    runs any command (``python SCRIPT ARGS...``) with kprof's start-up hook (CUPTI) or under
                          Nsight Systems, and merges what its processes recorded.

The child gets the environment its recorder needs: for CUPTI, ``NVTX_INJECTION64_PATH`` names the libcupti that
cupti-python loads (found by :func:`cupti_library`), set before the process starts. Output is written next to its
final path under a temporary name and renamed into place only when complete; a failure or Ctrl-C removes every
temporary file. Problems the user can fix raise :class:`CaptureError` with a one-line message (exit code 2); a
child that fails raises it with exit code 1 and the child's last lines.
"""
from __future__ import annotations

import glob
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from profiler.recorders import RecorderError
from profiler.workload import PROGRESS_PREFIX, driver_version, now, versions

PROFILERS = ("cupti", "torch", "nsys")
ROOT = Path(__file__).resolve().parent.parent  # holds the profiler, analyzers and kimi_decode packages
HOOK_DIR = Path(__file__).resolve().parent / "hook"
TAIL_LINES = 20

Progress = Callable[[str, int, int], None]


class CaptureError(Exception):
    """A capture that cannot be made; ``str()`` is meant for the user, ``code`` is the exit code."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


@dataclass
class WorkloadOptions:
    """The decode slice to capture (see :class:`kimi_decode.DecodeSlice`)."""

    backend: str = "auto"
    tp: int = 16
    batch: int = 1
    layers: int = 4
    first_layer: int = 1
    context: int = 8192
    steps: int = 50
    warmup: int = 2
    model: str = "k3"
    rank: int = 0
    seed: int = 0
    device: str = "cuda"
    world: int = 1  # ranks run together, one per GPU (cuda:0 .. world - 1), as one tensor-parallel group of tp = world
    timeout: float = 60.0  # seconds a rank's collective may wait for the others


# -- checks made before anything runs ---------------------------------------------------------------------------------
def check_output(path: Path) -> None:
    """Raise :class:`CaptureError` unless a file can be created at ``path``."""
    if path.is_dir():
        raise CaptureError(f"cannot write {path}: it is a directory")
    parent = path.parent
    if not parent.is_dir():
        raise CaptureError(f"cannot write {path}: directory {parent} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=parent)
    except OSError as exc:
        raise CaptureError(f"cannot write {path}: {exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(probe)


def check_backend(options: WorkloadOptions) -> None:
    try:
        from kimi_decode.backends import BACKENDS
    except Exception as exc:
        raise CaptureError(f"cannot import the decode slice (kimi_decode): {type(exc).__name__}: {exc}") from None
    if options.backend not in BACKENDS:
        raise CaptureError(f"unknown backend {options.backend!r}; available: {', '.join(sorted(BACKENDS))}")
    for name in ("tp", "batch", "layers", "context", "steps"):
        if getattr(options, name) < 1:
            raise CaptureError(f"--{name} must be at least 1")


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def check_cuda() -> None:
    if not cuda_available():
        raise CaptureError("no CUDA device: kprof capture records GPU kernels, and torch.cuda.is_available() is "
                           "False on this machine")


_PROBE = r"""
import json, os
out = {"path": None, "error": None}
try:
    from cupti import cupti
except Exception as exc:
    out["error"] = "import: %s: %s" % (type(exc).__name__, exc)
else:
    try:
        cupti.get_timestamp()  # loads libcupti
    except Exception as exc:
        out["error"] = "%s: %s" % (type(exc).__name__, exc)
    for line in open("/proc/self/maps"):
        part = line.split()[-1]
        if "/libcupti.so" in part:
            out["path"] = os.path.realpath(part)
            break
    if out["path"] is None:
        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib
            out["path"] = os.path.realpath(load_nvidia_dynamic_lib("cupti").abs_path)
        except Exception as exc:
            out["error"] = out["error"] or "%s: %s" % (type(exc).__name__, exc)
print(json.dumps(out))
"""


def cupti_library(python: str = sys.executable) -> str:
    """The libcupti that cupti-python loads in ``python``: ``KPROF_CUPTI_LIB`` if set, else found by loading it in
    a short child process (the library mapped there), else cuda-pathfinder's answer."""
    override = os.environ.get("KPROF_CUPTI_LIB")
    if override:
        if not os.path.isfile(override):
            raise CaptureError(f"KPROF_CUPTI_LIB={override} is not a file")
        return override
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=300)
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        raise CaptureError("cannot check cupti-python: the probe process failed") from None
    error = found.get("error") or ""
    if error.startswith("import:"):
        raise CaptureError("cupti-python is not installed (pip install cupti-python, the major version of your CUDA "
                           "driver), or cannot be imported: " + error.removeprefix("import: "))
    if not found.get("path"):
        raise CaptureError(f"cannot find the libcupti that cupti-python loads ({error or 'not mapped'}); set "
                           "KPROF_CUPTI_LIB to its path")
    return found["path"]


# -- the child process -------------------------------------------------------------------------------------------------
def child_env(extra: dict | None = None, front: list[str] | None = None) -> dict:
    """This process's environment, with ``front`` + kprof's root first on ``PYTHONPATH`` and ``extra`` set."""
    env = dict(os.environ)
    paths = [*(front or []), str(ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    for key in ("KPROF_HOOK_DIR",):
        env.pop(key, None)
    env.update(extra or {})
    return env


def run_child(command: list[str], env: dict, progress: Progress | None = None,
              output: Callable[[str], None] | None = None) -> tuple[int, list[str]]:
    """Run ``command``; progress lines go to ``progress``, other lines to ``output``, and the last
    :data:`TAIL_LINES` of them are returned with the exit status. On Ctrl-C (or any error) the child is stopped
    before the exception propagates."""
    proc = _spawn(command, env)
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(PROGRESS_PREFIX):
                _report(progress, line[len(PROGRESS_PREFIX):])
                continue
            tail.append(line)
            if output is not None:
                output(line)
        return proc.wait(), list(tail)
    except BaseException:
        stop_child(proc)
        raise
    finally:
        proc.stdout.close()


def _spawn(command: list[str], env: dict) -> subprocess.Popen:
    """Start a child whose stdout and stderr come back as one text stream, line by line."""
    try:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, text=True, errors="replace", bufsize=1)
    except OSError as exc:
        raise CaptureError(f"cannot run {command[0]}: {exc.strerror or exc}") from None


def _report(progress: Progress | None, payload: str) -> None:
    """Pass one child's progress line (its JSON payload) to ``progress``; malformed lines are ignored."""
    if progress is None:
        return
    try:
        event = json.loads(payload)
        progress(str(event["phase"]), int(event["done"]), int(event["total"]))
    except (ValueError, KeyError, TypeError):
        pass


def stop_child(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """Stop a child: SIGINT (it may have had one from the terminal already), then SIGTERM, then SIGKILL."""
    for action, wait in ((lambda: proc.send_signal(signal.SIGINT), grace), (proc.terminate, 5.0), (proc.kill, None)):
        if proc.poll() is not None:
            return
        try:
            action()
        except OSError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


def child_failed(what: str, code: int, tail: list[str]) -> CaptureError:
    lines = "\n".join(f"  | {line}" for line in tail) or "  | (no output)"
    return CaptureError(f"{what} failed (exit {code}); its last lines:\n{lines}", code=1)


def _remove(*patterns: str) -> None:
    for pattern in patterns:
        for path in glob.glob(glob.escape(os.path.dirname(pattern)) + "/" + os.path.basename(pattern)):
            try:
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
            except OSError:
                pass


def workload_command(args: dict) -> list[str]:
    return [sys.executable, "-m", "profiler.workload", "--json-args", json.dumps(args)]


def rank_path(output: Path, rank: int) -> Path:
    """Where rank ``rank`` of a several-rank capture goes: ``NAME.kprof`` -> ``NAME.rankR.kprof``."""
    return output.with_name(f"{output.stem}.rank{rank}{output.suffix}")


def cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


def run_ranks(commands: list[list[str]], env: dict, progress: Progress | None = None
              ) -> list[tuple[int | None, list[str]]]:
    """Run one child per rank at once; rank 0's progress lines go to ``progress``. As soon as one child fails, the
    others are stopped (they would wait for it in a collective). -> (exit status, last lines) per rank, status None
    for a child stopped because another failed. Ctrl-C (or any error) stops every child before it propagates."""
    import queue
    import threading
    import time

    events: queue.Queue = queue.Queue()
    procs, tails, readers = [], [], []

    def read(rank: int, proc: subprocess.Popen, tail: deque) -> None:
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(PROGRESS_PREFIX):
                if rank == 0:
                    events.put(line[len(PROGRESS_PREFIX):])
                continue
            tail.append(line)

    try:
        for rank, command in enumerate(commands):
            proc = _spawn(command, env)
            procs.append(proc)
            tails.append(deque(maxlen=TAIL_LINES))
            readers.append(threading.Thread(target=read, args=(rank, proc, tails[-1]), daemon=True))
            readers[-1].start()
        stopped: set[int] = set()
        while True:
            while not events.empty():
                _report(progress, events.get_nowait())
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                for rank, proc in enumerate(procs):
                    if proc.poll() is None:
                        stopped.add(rank)
                        stop_child(proc, grace=2.0)
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
    except BaseException:
        for proc in procs:
            stop_child(proc)
        raise
    finally:
        for reader in readers:
            reader.join(timeout=5)
        for proc in procs:
            proc.stdout.close()
    return [(None if rank in stopped else proc.returncode, list(tail))
            for rank, (proc, tail) in enumerate(zip(procs, tails))]


def _capture_ranks(options: WorkloadOptions, profiler: str, output: Path, env: dict, command_line: str,
                   progress: Progress | None) -> Path:
    """``options.world`` ranks at once, one capture per rank (:func:`rank_path`)."""
    world = options.world
    if profiler == "nsys":
        raise CaptureError("--gpus above 1 records with cupti or torch (one Nsight Systems run per rank is not "
                           "supported)")
    if options.tp != world:
        raise CaptureError(f"--gpus {world} runs the {world} ranks of one tensor-parallel group: --tp must be "
                           f"{world}, got {options.tp}")
    if options.device.startswith("cuda") and cuda_device_count() < world:
        raise CaptureError(f"--gpus {world} needs {world} CUDA devices; this machine has {cuda_device_count()}")
    outputs = [rank_path(output, r) for r in range(world)]
    for path in outputs:
        check_output(path)
    from kimi_decode.dist_bench import free_port

    port = free_port()
    stems = [p.parent / f".{p.name}.{os.getpid()}" for p in outputs]
    partials = [Path(f"{stem}.partial") for stem in stems]
    commands = [workload_command({**asdict(options), "rank": r, "port": port, "profiler": profiler,
                                  "output": str(partials[r]), "command_line": command_line}) for r in range(world)]
    try:
        results = run_ranks(commands, env, progress)
        for rank, (code, tail) in enumerate(results):
            if code not in (None, 0):
                raise child_failed(f"rank {rank}'s capture process", code, tail)
        missing = [r for r, p in enumerate(partials) if not p.is_file()]
        if missing:
            raise CaptureError(f"the capture process of rank {missing[0]} wrote no trace", code=1)
        for partial, path in zip(partials, outputs):
            os.replace(partial, path)
    finally:
        for stem, partial in zip(stems, partials):
            _remove(f"{stem}.*", f"{partial.parent}/.{partial.name}.*.tmp")
    return output


# -- the decode slice ----------------------------------------------------------------------------------------------------
def capture_workload(options: WorkloadOptions, profiler: str, output: Path, command_line: str = "",
                     progress: Progress | None = None) -> Path:
    """Capture the decode slice described by ``options`` with ``profiler`` into ``output`` (with ``options.world``
    above 1: one capture per rank, see :func:`rank_path`)."""
    output = Path(output)
    if options.world < 1:
        raise CaptureError("--gpus must be at least 1")
    if options.world == 1:
        check_output(output)
    check_backend(options)
    if options.device.startswith("cuda"):  # first: without a GPU, what the profiler lacks is beside the point
        check_cuda()
    env = child_env()
    nsys = None
    try:
        if profiler == "cupti":
            env["NVTX_INJECTION64_PATH"] = cupti_library()
        elif profiler == "nsys":
            from profiler.recorders.nsys import nsys_path

            nsys = nsys_path()
        elif profiler != "torch":
            raise CaptureError(f"unknown profiler {profiler!r}; choose one of {', '.join(PROFILERS)}")
    except RecorderError as exc:
        raise CaptureError(str(exc)) from None
    if options.world > 1:
        return _capture_ranks(options, profiler, output, env, command_line, progress)

    stem = output.parent / f".{output.name}.{os.getpid()}"
    partial = Path(f"{stem}.partial")
    args = {**asdict(options), "profiler": "none" if nsys else profiler, "output": str(partial),
            "command_line": command_line}
    command = workload_command(args)
    if nsys:
        from profiler.recorders.nsys import profile_command

        command = profile_command(nsys, Path(f"{stem}.report"), command)
    try:
        code, tail = run_child(command, env, progress)
        if code != 0:
            raise child_failed("the capture process" if not nsys else "nsys profile", code, tail)
        if nsys:
            _finish_nsys(nsys, stem, partial, output, progress)
        else:
            if not partial.is_file():
                raise CaptureError("the capture process wrote no trace", code=1)
            os.replace(partial, output)
    finally:
        _remove(f"{stem}.*", f"{output.parent}/.{partial.name}.*.tmp")
    return output


def _finish_nsys(nsys: str, stem: Path, meta_file: Path, output: Path, progress: Progress | None) -> None:
    from profiler.recorders import trim_to_capture
    from profiler.recorders.nsys import export_sqlite, read_report

    report = Path(f"{stem}.report.nsys-rep")
    if not report.is_file():
        raise CaptureError(f"nsys wrote no report ({report.name})", code=1)
    if progress:
        progress("export", 0, 1)
    sqlite = Path(f"{stem}.sqlite")
    try:
        export_sqlite(nsys, report, sqlite)
        meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
        meta["profiler"] = "nsys"
        trim_to_capture(read_report(sqlite, meta)).save(output)
    except RecorderError as exc:
        raise CaptureError(str(exc), code=1) from None
    if progress:
        progress("export", 1, 1)


# -- any Python program ----------------------------------------------------------------------------------------------------
def script_meta(command: list[str], profiler: str, command_line: str, started_at: str) -> dict:
    return {"gpu": _gpu_name(), "driver": driver_version(), "versions": versions(), "backend": None,
            "profiler": profiler, "config": {"command": command}, "command_line": command_line,
            "started_at": started_at, "finished_at": now()}


def _gpu_name() -> str | None:
    tool = shutil.which("nvidia-smi")
    if tool:
        try:
            out = subprocess.run([tool, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=30).stdout.strip().splitlines()
            if out:
                return out[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return None


def hook_env(hook_dir: Path, cupti_lib: str) -> dict:
    """The environment of a program recorded through the start-up hook."""
    return child_env({"KPROF_HOOK_DIR": str(hook_dir), "KPROF_HOOK_ROOT": str(ROOT),
                      "NVTX_INJECTION64_PATH": cupti_lib}, front=[str(HOOK_DIR)])


def collect_hook_records(hook_dir: Path, meta: dict):
    """Merge the records every process of the program wrote into one Trace; :class:`CaptureError` if none did."""
    from profiler.recorders import merge_traces
    from profiler.recorders.cupti import records_to_trace

    traces, errors = [], []
    for path in sorted(hook_dir.glob("records.*.pkl")):
        with open(path, "rb") as stream:
            records = pickle.load(stream)
        if records.kernels:
            traces.append(records_to_trace(records, meta))
    for path in sorted(hook_dir.glob("error.*.txt")):
        errors.append(path.read_text(errors="replace").strip())
    if not traces:
        reason = f": {errors[0]}" if errors else " (did it use CUDA? is cupti-python importable by its interpreter?)"
        raise CaptureError(f"the program recorded no GPU kernels{reason}", code=1)
    merged = merge_traces(traces, {"source": "cupti", **meta, "processes": len(traces)})
    if errors:
        merged.meta["hook_errors"] = errors[:5]
    return merged


def capture_script(command: list[str], profiler: str, output: Path, command_line: str = "",
                   progress: Progress | None = None, echo: Callable[[str], None] | None = None) -> Path:
    """Record ``command`` (for example ``["python", "serve.py", ...]``) with CUPTI or Nsight Systems."""
    output = Path(output)
    check_output(output)
    if not command:
        raise CaptureError("no command after '--'")
    if profiler == "torch":
        raise CaptureError("--profiler torch needs kprof's own workload; record a program with --profiler cupti "
                           "or --profiler nsys")
    check_cuda()
    nsys = cupti_lib = None
    try:
        if profiler == "cupti":
            python = shutil.which(command[0]) if os.path.basename(command[0]).startswith("python") else None
            cupti_lib = cupti_library(python or sys.executable)
        elif profiler == "nsys":
            from profiler.recorders.nsys import nsys_path

            nsys = nsys_path()
        else:
            raise CaptureError(f"unknown profiler {profiler!r}; choose one of {', '.join(PROFILERS)}")
    except RecorderError as exc:
        raise CaptureError(str(exc)) from None
    started_at = now()
    stem = output.parent / f".{output.name}.{os.getpid()}"
    name = os.path.basename(command[0])
    try:
        if progress:
            progress("run", 0, 0)
        if nsys:
            from profiler.recorders.nsys import profile_command

            code, tail = run_child(profile_command(nsys, Path(f"{stem}.report"), command), child_env(), None, echo)
            if code != 0:
                raise child_failed(f"{name} (under nsys)", code, tail)
            meta_file = Path(f"{stem}.meta.json")
            meta_file.write_text(json.dumps(script_meta(command, "nsys", command_line, started_at)))
            _finish_nsys(nsys, stem, meta_file, output, progress)
        else:
            hook_dir = Path(f"{stem}.hook")
            hook_dir.mkdir()
            code, tail = run_child(command, hook_env(hook_dir, cupti_lib), None, echo)
            if code != 0:
                raise child_failed(name, code, tail)
            if progress:
                progress("write", 0, 1)
            trace = collect_hook_records(hook_dir, script_meta(command, "cupti", command_line, started_at))
            trace.save(output)
            if progress:
                progress("write", 1, 1)
    finally:
        _remove(f"{stem}.*")
    return output


# -- progress bars ---------------------------------------------------------------------------------------------------------
class ProgressBars:
    """Rich progress bars on stderr, one per phase the child reports (``with ProgressBars() as bars: ...``)."""

    LABELS = {"start": "starting", "warm-up": "warm-up (compile, first graph)", "capture": "recording graph capture",
              "replay": "replaying", "write": "writing capture", "export": "exporting nsys report",
              "run": "running program"}

    def __init__(self, enabled: bool = True) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.bars = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), console=self.console, disable=not enabled, transient=False)
        self.tasks: dict[str, int] = {}

    def __enter__(self) -> "ProgressBars":
        self.bars.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bars.__exit__(*exc)

    def update(self, phase: str, done: int, total: int) -> None:
        task = self.tasks.get(phase)
        if task is None:
            for t in self.bars.tasks:  # a new phase means the earlier ones are done
                if t.total is not None:
                    self.bars.update(t.id, completed=t.total)
            task = self.tasks[phase] = self.bars.add_task(self.LABELS.get(phase, phase), total=total or None)
        self.bars.update(task, completed=done, total=total or None)

    def echo(self, line: str) -> None:
        self.bars.console.print(line, markup=False, highlight=False)
