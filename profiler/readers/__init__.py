"""Trace readers: every supported file becomes the same :class:`~analyzers.trace.Trace`.

``read_trace(path)`` detects the format from the file's first bytes, never from its name:

* ``PK\\x03\\x04`` (a zip archive)          -> ``.kprof`` (kprof's capture format, also the CUPTI capture);
* ``SQLite format 3``                       -> Nsight Systems SQLite export;
* ``{`` or ``[`` (plain, or inside gzip)    -> torch.profiler / Kineto Chrome-trace JSON.

Input that cannot be used raises :class:`TraceReadError` with a one-line message.
"""
from __future__ import annotations

import gzip
import zlib
from pathlib import Path

from analyzers.trace import Trace
from profiler.readers.errors import TraceReadError
from profiler.readers.kineto_json import read_kineto_json
from profiler.readers.kprof import read_kprof
from profiler.readers.nsys_sqlite import read_nsys_sqlite

__all__ = ["TraceReadError", "detect_format", "read_trace", "read_kineto_json", "read_kprof", "read_nsys_sqlite"]

_READERS = {"kprof": read_kprof, "nsys_sqlite": read_nsys_sqlite, "kineto_json": read_kineto_json}
_GZIP = b"\x1f\x8b"
_BOM = b"\xef\xbb\xbf"


def _looks_like_json(head: bytes) -> bool:
    head = head.removeprefix(_BOM).lstrip()
    return head[:1] in (b"{", b"[")


def detect_format(path: str | Path) -> str:
    """``"kprof"``, ``"nsys_sqlite"`` or ``"kineto_json"``, from the content of ``path``."""
    path = Path(path)
    try:
        with open(path, "rb") as stream:
            head = stream.read(64)
    except OSError as exc:
        raise TraceReadError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not head:
        raise TraceReadError(f"{path.name}: empty file")
    if head.startswith(b"PK\x03\x04"):
        return "kprof"
    if head.startswith(b"SQLite format 3\x00"):
        return "nsys_sqlite"
    if head.startswith(_GZIP):
        try:
            with gzip.open(path, "rb") as stream:
                head = stream.read(4096)
        except (OSError, EOFError, zlib.error) as exc:
            raise TraceReadError(f"{path.name}: corrupt gzip file ({exc})") from None
        if not head:
            raise TraceReadError(f"{path.name}: empty file (gzip)")
        if _looks_like_json(head):
            return "kineto_json"
        raise TraceReadError(f"{path.name}: gzip file that does not hold a JSON trace")
    if _looks_like_json(head):
        return "kineto_json"
    raise TraceReadError(f"{path.name}: not a trace kprof reads (torch.profiler JSON, .json.gz, Nsight Systems "
                         "SQLite export or .kprof)")


def read_trace(path: str | Path) -> Trace:
    """Read any supported trace file; raises :class:`TraceReadError` for bad input, including a trace without
    GPU kernels."""
    path = Path(path)
    trace = _READERS[detect_format(path)](path)
    if not (trace.kernels["kind"] == "kernel").any():
        raise TraceReadError(f"{path.name}: the trace has no GPU kernels")
    return trace
