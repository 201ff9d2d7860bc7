"""The Nsight Systems recorder: run a command under ``nsys profile``, export SQLite, import it.

``nsys profile -t cuda,nvtx --cuda-graph-trace=node`` records every kernel of a graph replay with its node id, and
``CUDA_GRAPH_NODE_EVENTS`` maps each node to its creation during capture; the SQLite reader
(:mod:`profiler.readers.nsys_sqlite`) builds ``graph_nodes`` from it.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from profiler.recorders import RecorderError


def nsys_path() -> str:
    """The ``nsys`` executable, or a :class:`RecorderError` saying how to get one."""
    path = shutil.which("nsys")
    if path is None:
        raise RecorderError("nsys (Nsight Systems) is not on the PATH; install Nsight Systems, or use "
                            "--profiler cupti or --profiler torch")
    return path


def profile_command(nsys: str, report: Path, command: list[str]) -> list[str]:
    """``nsys profile`` around ``command``, writing ``report`` (``.nsys-rep``)."""
    return [nsys, "profile", "-t", "cuda,nvtx", "--cuda-graph-trace=node", "--sample=none", "--cpuctxsw=none",
            "--force-overwrite=true", "-o", str(report), *command]


def export_sqlite(nsys: str, report: Path, sqlite: Path) -> None:
    """``nsys export --type sqlite``; raises :class:`RecorderError` with nsys's last line on failure."""
    try:
        done = subprocess.run([nsys, "export", "--type", "sqlite", "--force-overwrite=true", "-o", str(sqlite),
                               str(report)], capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RecorderError(f"nsys export failed: {exc}") from None
    if done.returncode != 0 or not sqlite.exists():
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RecorderError(f"nsys export failed (exit {done.returncode}): {last[0]}")


def read_report(sqlite: Path, meta: dict):
    """The exported SQLite as a Trace, with ``meta`` merged over the reader's."""
    from analyzers.trace import Trace
    from profiler.readers import read_nsys_sqlite

    trace = read_nsys_sqlite(sqlite)
    return Trace(kernels=trace.kernels, launches=trace.launches, ranges=trace.ranges.drop(columns="depth"),
                 graph_nodes=trace.graph_nodes, meta={**trace.meta, **meta, "source": "nsys_sqlite"})
