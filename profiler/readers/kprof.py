"""Reader for ``.kprof`` files: kprof's own capture format (what ``kprof capture`` and ``kprof import`` write).

The CUPTI recorder builds a :class:`~analyzers.trace.Trace` in memory and saves it with ``Trace.save``, so a
``.kprof`` file *is* the CUPTI capture; the format is described in :mod:`analyzers.trace` and ``docs/analyze.md``.
"""
from __future__ import annotations

from pathlib import Path

from analyzers.trace import Trace, TraceError
from profiler.readers.errors import TraceReadError


def read_kprof(path: str | Path) -> Trace:
    """Load a ``.kprof`` file."""
    try:
        return Trace.load(path)
    except TraceError as exc:
        raise TraceReadError(f"{Path(path).name}: {exc}") from None
