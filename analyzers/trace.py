"""The canonical trace model shared by every reader, recorder and analysis, and its ``.kprof`` file format.

A :class:`Trace` holds four DataFrames and a metadata dict. All times are integer nanoseconds (``int64``) on one
clock per trace; integer columns use ``-1`` for "unknown"; names are categorical.

``kernels``      one row per GPU activity: ``kind`` (``kernel``, ``memcpy`` or ``memset``), ``device``, ``stream``,
                 ``pid`` (launching process, -1 if the source does not say), ``start_ns``, ``end_ns``, ``name``,
                 ``correlation_id`` (joins the launch call), ``graph_id`` and ``graph_node_id`` (-1 outside CUDA
                 graphs), ``ctas`` (the kernel's grid size in CTAs, -1 where the source does not give it: Kineto
                 JSON and nsys exports give it, the CUPTI recorder does not record it yet).
``launches``     one row per CUDA runtime or driver API call: ``pid``, ``tid``, ``start_ns``, ``end_ns``, ``name``,
                 ``correlation_id``.
``ranges``       one row per annotation range (NVTX push/pop or start/end, torch ``record_function``): ``pid``,
                 ``tid``, ``start_ns``, ``end_ns``, ``name``, ``domain``, ``depth`` (0 = outermost on its thread).
``graph_nodes``  optional; how a replayed CUDA-graph node maps back to the launch made while its graph was
                 captured: ``graph_id``, ``graph_node_id`` (as it appears on replayed kernels),
                 ``correlation_id`` of the capture-time launch call (-1 if unknown), and ``pid``, ``tid``,
                 ``start_ns``, ``end_ns`` of that call (used when the correlation id is unknown or not in
                 ``launches``). The range open around that call on that thread is the node's range.
``meta``         JSON-serialisable capture metadata: ``source``, ``gpu``, ``versions``, ``backend``, ``config``.

The ``.kprof`` file (format version 1) is a zip archive: ``header.json`` holds ``{"format": "kprof",
"version": 1, "meta": ..., "tables": {table: {"rows": n, "columns": {column: dtype}}}}``, and each column is one
deflated ``.npy`` member ``<table>/<column>.npy``; a categorical column is stored as ``int32`` codes plus its
categories as a JSON list in ``<table>/<column>.categories.json``. See ``docs/analyze.md``.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np
import pandas as pd

FORMAT = "kprof"
FORMAT_VERSION = 1
KINDS = ("kernel", "memcpy", "memset")

INT, CAT = "int64", "category"
KERNEL_COLUMNS = {
    "kind": CAT, "device": INT, "stream": INT, "pid": INT, "start_ns": INT, "end_ns": INT, "name": CAT,
    "correlation_id": INT, "graph_id": INT, "graph_node_id": INT, "ctas": INT,
}
LAUNCH_COLUMNS = {"pid": INT, "tid": INT, "start_ns": INT, "end_ns": INT, "name": CAT, "correlation_id": INT}
RANGE_COLUMNS = {
    "pid": INT, "tid": INT, "start_ns": INT, "end_ns": INT, "name": CAT, "domain": CAT, "depth": INT,
}
GRAPH_NODE_COLUMNS = {
    "graph_id": INT, "graph_node_id": INT, "correlation_id": INT, "pid": INT, "tid": INT, "start_ns": INT,
    "end_ns": INT,
}
TABLES = {
    "kernels": KERNEL_COLUMNS, "launches": LAUNCH_COLUMNS, "ranges": RANGE_COLUMNS, "graph_nodes": GRAPH_NODE_COLUMNS,
}
# Columns a producer may leave out; they are filled with -1 (or "" for names).
_OPTIONAL = {"pid", "device", "stream", "correlation_id", "graph_id", "graph_node_id", "ctas", "domain", "depth"}


class TraceError(ValueError):
    """A trace or ``.kprof`` file that cannot be used; the message is one line meant for the user."""


def _normalise(table: str, frame: pd.DataFrame | None) -> pd.DataFrame:
    columns = TABLES[table]
    frame = pd.DataFrame(columns=list(columns)) if frame is None else frame
    missing = [c for c in columns if c not in frame.columns and c not in _OPTIONAL]
    if missing:
        raise TraceError(f"{table} table lacks column(s) {', '.join(missing)}")
    out = {}
    for column, dtype in columns.items():
        if column not in frame.columns:
            values = "" if dtype == CAT else -1
            out[column] = pd.Series(values, index=frame.index, dtype=object if dtype == CAT else INT)
        else:
            out[column] = frame[column]
    normalised = pd.DataFrame(out).reset_index(drop=True)
    for column, dtype in columns.items():
        if dtype == INT:
            normalised[column] = normalised[column].astype(INT)
        elif not isinstance(normalised[column].dtype, pd.CategoricalDtype):
            normalised[column] = normalised[column].fillna("").astype(str).astype(CAT)
    return normalised


@dataclass
class Trace:
    """A normalised GPU trace: see the module docstring for every table and column.

    Build one with ``Trace(kernels=..., launches=..., ranges=..., graph_nodes=..., meta=...)``: columns are coerced
    to the model's dtypes, optional ones are filled with -1, and ``ranges.depth`` is computed when absent.
    """

    kernels: pd.DataFrame
    launches: pd.DataFrame | None = None
    ranges: pd.DataFrame | None = None
    graph_nodes: pd.DataFrame | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        compute_depth = self.ranges is not None and "depth" not in self.ranges.columns
        self.kernels = _normalise("kernels", self.kernels)
        self.launches = _normalise("launches", self.launches)
        self.ranges = _normalise("ranges", self.ranges)
        self.graph_nodes = _normalise("graph_nodes", self.graph_nodes)
        unknown = set(self.kernels["kind"].unique()) - set(KINDS)
        if unknown:
            raise TraceError(f"unknown kernel kind(s): {', '.join(sorted(map(str, unknown)))}")
        if compute_depth and len(self.ranges):
            from analyzers.attribution import range_nesting

            self.ranges["depth"] = range_nesting(self.ranges)[1]
        self.meta = dict(self.meta)

    def save(self, path: str | os.PathLike) -> None:
        """Write the trace as a ``.kprof`` file, atomically: a reader never sees a partial file."""
        header = {"format": FORMAT, "version": FORMAT_VERSION, "meta": self.meta, "tables": {}}
        with atomic_output(path) as raw, zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
            for table, columns in TABLES.items():
                frame = getattr(self, table)
                header["tables"][table] = {"rows": len(frame), "columns": dict(columns)}
                for column, dtype in columns.items():
                    values = frame[column]
                    if dtype == CAT:
                        categories = [str(c) for c in values.cat.categories]
                        zf.writestr(f"{table}/{column}.categories.json", json.dumps(categories))
                        values = values.cat.codes.to_numpy(dtype=np.int32)
                    else:
                        values = values.to_numpy(dtype=np.int64)
                    buffer = io.BytesIO()
                    np.save(buffer, values, allow_pickle=False)
                    zf.writestr(f"{table}/{column}.npy", buffer.getvalue())
            zf.writestr("header.json", json.dumps(header, indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Trace":
        """Read a ``.kprof`` file written by :meth:`save`; raises :class:`TraceError` for a damaged or foreign file."""
        try:
            with zipfile.ZipFile(path) as zf:
                header = read_header(zf)
                tables = {}
                for table, spec in header["tables"].items():
                    if table not in TABLES:
                        continue  # a table from a newer minor writer: not ours to interpret
                    data = {}
                    for column, dtype in spec["columns"].items():
                        with zf.open(f"{table}/{column}.npy") as member:
                            values = np.load(io.BytesIO(member.read()), allow_pickle=False)
                        if len(values) != spec["rows"]:
                            raise TraceError(f"{table}/{column} has {len(values)} rows, header says {spec['rows']}")
                        if dtype == CAT:
                            categories = json.loads(zf.read(f"{table}/{column}.categories.json"))
                            values = pd.Categorical.from_codes(values, categories=categories)
                        data[column] = values
                    tables[table] = pd.DataFrame(data)
        except (zipfile.BadZipFile, KeyError, EOFError, OSError, json.JSONDecodeError, ValueError) as exc:
            if isinstance(exc, TraceError):
                raise
            raise TraceError(f"damaged .kprof file: {exc}") from None
        if "kernels" not in tables:
            raise TraceError("damaged .kprof file: no kernels table")
        return cls(meta=header.get("meta") or {}, **tables)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Open ``path`` for binary writing through a temporary file in the same directory that replaces ``path`` only
    when the block completes, so an error leaves no partial file behind."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as stream:
            yield stream
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_header(zf: zipfile.ZipFile) -> dict:
    """The validated ``header.json`` of an open ``.kprof`` archive."""
    try:
        header = json.loads(zf.read("header.json"))
    except KeyError:
        raise TraceError("not a .kprof file: the zip archive has no header.json") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TraceError("not a .kprof file: header.json does not say format 'kprof'")
    if header.get("version") != FORMAT_VERSION:
        raise TraceError(f".kprof version {header.get('version')} is not supported (this kprof reads {FORMAT_VERSION})")
    return header
