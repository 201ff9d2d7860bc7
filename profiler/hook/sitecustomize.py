"""kprof's interpreter start-up hook: CUPTI recording of any Python program (``kprof capture -- python SCRIPT``).

``kprof capture`` puts this directory first on ``PYTHONPATH`` and sets:

``KPROF_HOOK_DIR``   where each process writes ``records.<pid>.pkl`` (its CUPTI records) when it exits, or
                     ``error.<pid>.txt`` when recording could not start;
``KPROF_HOOK_ROOT``  the directory that holds kprof's ``profiler`` package (appended to ``sys.path``);
``NVTX_INJECTION64_PATH``  the libcupti that cupti-python loads, so NVTX ranges reach CUPTI.

Every Python process started with this environment records itself (the program's worker processes too). Records
are written at interpreter exit, and also by multiprocessing's exit handler, which runs in worker processes that
leave through ``os._exit``. A process killed by a signal writes nothing. The hook never stops the program: a
failure is written to ``error.<pid>.txt`` and the program runs on. Another ``sitecustomize`` later on the path
still runs.
"""
from __future__ import annotations

import os
import sys

_DIR = os.path.dirname(os.path.abspath(__file__))


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as stream:
        stream.write(data)
    os.replace(tmp, path)


def _error(out_dir: str, message: str) -> None:
    try:
        _write_atomic(os.path.join(out_dir, f"error.{os.getpid()}.txt"), message.encode())
    except OSError:
        pass
    print(f"kprof: hook: {message}", file=sys.stderr)


def _start(out_dir: str) -> None:
    root = os.environ.get("KPROF_HOOK_ROOT")
    if root and root not in sys.path:
        sys.path.append(root)
    try:
        from profiler.recorders import RecorderError
        from profiler.recorders.cupti import CuptiSession
    except Exception as exc:  # a program with its own top-level 'profiler' module, a broken install, ...
        _error(out_dir, f"cannot import kprof's recorder: {type(exc).__name__}: {exc}")
        return
    try:
        session = CuptiSession().start()
    except RecorderError as exc:
        _error(out_dir, str(exc))
        return
    pid = os.getpid()
    written = []

    def save() -> None:
        if written or os.getpid() != pid:
            return
        written.append(True)
        try:
            try:
                import torch

                if torch.cuda.is_initialized():
                    torch.cuda.synchronize()
            except Exception:
                pass
            records = session.stop()
            if records.kernels or records.apis:
                import pickle

                _write_atomic(os.path.join(out_dir, f"records.{pid}.pkl"), pickle.dumps(records, protocol=4))
        except Exception as exc:
            _error(out_dir, f"cannot write the records: {type(exc).__name__}: {exc}")

    import atexit
    import multiprocessing.util

    atexit.register(save)
    multiprocessing.util.Finalize(None, save, exitpriority=-1000)
    # A forked child inherits the parent's records but not its CUPTI state: it must not write them as its own.
    os.register_at_fork(after_in_child=lambda: written.append(True))


def _chain() -> None:
    """Run the next ``sitecustomize`` on the path, which this module shadows."""
    import importlib.machinery
    import importlib.util

    path = [p for p in sys.path if os.path.abspath(p or ".") != _DIR]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["_kprof_chained_sitecustomize"] = module
    spec.loader.exec_module(module)


_out = os.environ.get("KPROF_HOOK_DIR")
if _out and os.path.isdir(_out):
    _start(_out)
_chain()
