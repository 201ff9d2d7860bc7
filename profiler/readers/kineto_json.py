"""Reader for torch.profiler / Kineto Chrome-trace JSON (plain or gzip), including traces written by vLLM.

The document is streamed: the ``traceEvents`` array is cut into batches of complete events, each decoded by msgspec
into small typed structs that keep only the fields kprof uses, so memory grows with the kept columns, not with the
document. Kept events (``ph: "X"``), by category:

``kernel``, ``gpu_memcpy``, ``gpu_memset``   -> ``Trace.kernels`` (``args.device``, ``args.stream``,
                                                ``args.correlation``, ``args["graph id"]``, ``args["graph node id"]``,
                                                ``args.grid``, whose product is the kernel's CTAs);
``cuda_runtime``, ``cuda_driver``            -> ``Trace.launches`` (``args.correlation``);
``user_annotation`` (``record_function``)    -> ``Trace.ranges``, domain ``user_annotation``.

``gpu_user_annotation`` spans are ignored on purpose: they are GPU-time projections, and attribution goes through
the launch call. Kineto times are microseconds with three decimals; they become integer nanoseconds.
"""
from __future__ import annotations

import gzip
import json
import re
import zlib
from pathlib import Path
from typing import BinaryIO, Union

import msgspec
import numpy as np
import pandas as pd

from analyzers.trace import Trace
from profiler.readers.errors import TraceReadError

_CHUNK = 16 << 20
_WS = re.compile(rb"[ \t\r\n]*")
_BOUNDARY = re.compile(rb"\}[ \t\r\n]*[,\]]")

_KERNEL_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
_RANGE_CATS = {"user_annotation"}
_VERSION_KEYS = ("schemaVersion", "cuda_runtime_version", "cuda_driver_version", "cupti_version", "torch_version")

Id = Union[int, str, None]


class _Args(msgspec.Struct):
    correlation: Union[int, None] = None
    device: Union[int, None] = None
    stream: Union[int, None] = None
    graph_id: Union[int, None] = msgspec.field(default=None, name="graph id")
    graph_node_id: Union[int, None] = msgspec.field(default=None, name="graph node id")
    grid: Union[list[int], None] = None


class _Event(msgspec.Struct):
    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: Id = None
    tid: Id = None
    ts: Union[float, None] = None
    dur: Union[float, None] = None
    args: Union[_Args, None] = None


_DECODER = msgspec.json.Decoder(list[_Event])
_ERROR_BYTE = re.compile(r"\(byte (\d+)\)")


def _error_offset(exc: msgspec.DecodeError, size: int) -> int | None:
    """Where in the decoded data msgspec found an error: ``size`` for truncated data, None if it does not say."""
    if "truncated" in str(exc):
        return size
    match = _ERROR_BYTE.search(str(exc))
    return int(match.group(1)) if match else None


def _decode_events(data: bytes) -> list[_Event]:
    """Decode a JSON array of events; raises ``msgspec.DecodeError`` when ``data`` is not JSON."""
    try:
        return _DECODER.decode(data)
    except msgspec.ValidationError:
        # Numbers written as strings and the like: decode loosely, then convert with lax typing.
        pass
    try:
        return msgspec.convert(msgspec.json.decode(data), list[_Event], strict=False)
    except msgspec.ValidationError as exc:
        raise TraceReadError(f"unexpected event field in traceEvents: {exc}") from None


class _Names:
    """Interns names into integer codes, for categorical columns."""

    def __init__(self) -> None:
        self.codes: dict[str, int] = {}

    def encode(self, names: list[str]) -> np.ndarray:
        codes = self.codes
        return np.fromiter((codes.setdefault(n, len(codes)) for n in names), dtype=np.int32, count=len(names))

    def categorical(self, codes: list[np.ndarray]) -> pd.Categorical:
        values = np.concatenate(codes) if codes else np.empty(0, dtype=np.int32)
        return pd.Categorical.from_codes(values, categories=list(self.codes))


def _int(value, default: int = -1) -> int:
    return value if type(value) is int else default


def _ctas(grid) -> int:
    """The CTAs of a kernel's grid (x, y, z), or -1 where the event has no such grid."""
    if not isinstance(grid, list) or len(grid) != 3 or any(type(g) is not int or g < 1 for g in grid):
        return -1
    return grid[0] * grid[1] * grid[2]


class _Columns:
    """Accumulates one table's columns batch by batch, as numpy arrays."""

    def __init__(self) -> None:
        self.parts: dict[str, list[np.ndarray]] = {}

    def add(self, **columns: np.ndarray) -> None:
        for name, values in columns.items():
            self.parts.setdefault(name, []).append(values)

    def get(self, name: str, dtype=np.int64) -> np.ndarray:
        parts = self.parts.get(name)
        return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)


def _ns(values: list) -> np.ndarray:
    """Kineto microseconds (floats) to integer nanoseconds; missing values become 0."""
    us = np.array([0.0 if v is None else v for v in values], dtype=np.float64)
    return np.rint(us * 1000.0).astype(np.int64)


class _KinetoReader:
    def __init__(self, stream: BinaryIO, name: str) -> None:
        self.stream = stream
        self.name = name
        self.buf = b""
        self.pos = 0
        self.consumed = 0  # bytes dropped from the front of the buffer, for error positions
        self.eof = False
        self.top: dict = {}
        self.names = _Names()
        self.kernels, self.launches, self.ranges = _Columns(), _Columns(), _Columns()
        self.events_seen = False

    # --- buffer handling -------------------------------------------------------------------------------------
    def _fill(self) -> bool:
        """Read more input, keeping the unread part of the buffer; False at end of input."""
        if self.eof:
            return False
        try:
            data = self.stream.read(_CHUNK)
        except (OSError, EOFError, zlib.error) as exc:
            raise TraceReadError(f"{self.name}: truncated or corrupt gzip data ({exc})") from None
        if not data:
            self.eof = True
            return False
        self.consumed += self.pos
        self.buf = self.buf[self.pos:] + data
        self.pos = 0
        return True

    def _peek(self) -> bytes:
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or not self._fill():
                return self.buf[self.pos:self.pos + 1]

    def _truncated(self) -> TraceReadError:
        return TraceReadError(f"{self.name}: truncated or corrupt JSON (unexpected end of input)")

    def _expect(self, char: bytes) -> None:
        found = self._peek()
        if found != char:
            if not found:
                raise self._truncated()
            raise TraceReadError(f"{self.name}: corrupt JSON: expected {char.decode()!r}, found {found.decode(errors='replace')!r}")
        self.pos += 1

    def _value(self):
        """Decode one (small) JSON value at the cursor, such as a top-level key or a metadata entry."""
        self._peek()
        decoder = json.JSONDecoder()
        window = 1 << 16
        while True:
            text = self.buf[self.pos:self.pos + window].decode("utf-8", "surrogateescape")
            try:
                value, end = decoder.raw_decode(text)
                self.pos += len(text[:end].encode("utf-8", "surrogateescape"))
                return value
            except json.JSONDecodeError:
                if self.pos + window < len(self.buf):
                    window *= 4
                elif not self._fill():
                    raise self._truncated() from None

    # --- the document ----------------------------------------------------------------------------------------
    def read(self) -> Trace:
        if self._fill() and self.buf.startswith(b"\xef\xbb\xbf"):
            self.pos = 3  # a UTF-8 byte-order mark
        first = self._peek()
        if first == b"[":  # the JSON Array Format: a bare list of events
            self.pos += 1
            self._events()
        elif first == b"{":
            self.pos += 1
            self._object()
        elif not first:
            raise TraceReadError(f"{self.name}: empty file")
        else:
            raise TraceReadError(f"{self.name}: not a JSON trace")
        if not self.events_seen:
            raise TraceReadError(f"{self.name}: JSON without a traceEvents array: not a torch.profiler trace")
        return self._trace()

    def _members(self, close: bytes):
        """The first byte of each member of the object or array whose opening bracket is behind the cursor, the
        cursor on it; commas between members are skipped, the closing bracket ends it (consumed)."""
        while True:
            char = self._peek()
            if char == close:
                self.pos += 1
                return
            if char == b",":
                self.pos += 1
                continue
            if not char:
                raise self._truncated()
            yield char

    def _object(self) -> None:
        for _ in self._members(b"}"):
            key = self._value()
            if not isinstance(key, str):
                raise TraceReadError(f"{self.name}: corrupt JSON: object key is not a string")
            self._expect(b":")
            if key == "traceEvents":
                self._expect(b"[")
                self._events()
            else:
                self.top[key] = self._value()

    def _events(self) -> None:
        self.events_seen = True
        for char in self._members(b"]"):
            if char != b"{":
                raise TraceReadError(f"{self.name}: corrupt JSON: traceEvents holds a non-object")
            self._take(self._batch())

    def _batch(self) -> list[_Event]:
        """Decode the longest run of complete events at the cursor that the buffer holds."""
        # Cut after a '}' followed by ',' or ']'. A cut inside an event or a string leaves a bracket or a string
        # open, so decoding fails at the end of the data and an earlier cut is tried: a decode that succeeds always
        # ends on an event boundary. A failure before the end is corrupt input at that byte.
        limit, corrupt = len(self.buf), None
        while True:
            cut = self._last_boundary(limit)
            if cut < 0:
                if corrupt is not None:
                    raise TraceReadError(f"{self.name}: corrupt JSON in traceEvents ({corrupt})")
                if not self._fill():
                    raise self._truncated()
                limit = len(self.buf)
                continue
            data = b"[" + self.buf[self.pos:cut + 1] + b"]"
            try:
                events = _decode_events(data)
            except msgspec.DecodeError as exc:
                offset = _error_offset(exc, len(data))
                if offset is None:
                    raise TraceReadError(f"{self.name}: corrupt JSON in traceEvents ({exc})") from None
                if offset >= len(data) - 1:
                    limit = cut
                else:
                    at = self.pos + offset - 1
                    corrupt = f"at byte {self.consumed + at}: {_ERROR_BYTE.sub('', str(exc)).strip()}"
                    limit = min(cut, at)
                continue
            self.pos = cut + 1
            return events

    def _last_boundary(self, limit: int) -> int:
        """Position of the last '}' before ``limit`` that is followed by ',' or ']', or -1."""
        while True:
            cut = self.buf.rfind(b"}", self.pos, limit)
            if cut < 0 or _BOUNDARY.match(self.buf, cut):
                return cut
            limit = cut

    def _take(self, events: list[_Event]) -> None:
        complete = [e for e in events if e.ph == "X"]
        kernels = [e for e in complete if e.cat in _KERNEL_CATS]
        if kernels:
            args = [e.args or _Args() for e in kernels]
            start = _ns([e.ts for e in kernels])
            self.kernels.add(
                kind=np.array([_KERNEL_CATS[e.cat] for e in kernels], dtype=object),
                name=self.names.encode([e.name for e in kernels]),
                start_ns=start,
                end_ns=start + _ns([e.dur for e in kernels]),
                device=np.array([_int(a.device, _int(e.pid)) for a, e in zip(args, kernels)], dtype=np.int64),
                stream=np.array([_int(a.stream, _int(e.tid)) for a, e in zip(args, kernels)], dtype=np.int64),
                correlation_id=np.array([_int(a.correlation) for a in args], dtype=np.int64),
                graph_id=np.array([_int(a.graph_id) for a in args], dtype=np.int64),
                graph_node_id=np.array([_int(a.graph_node_id) for a in args], dtype=np.int64),
                ctas=np.array([_ctas(a.grid) for a in args], dtype=np.int64),
            )
        launches = [e for e in complete if e.cat in _LAUNCH_CATS]
        if launches:
            self.launches.add(**self._host_spans(launches), correlation_id=np.array(
                [_int((e.args or _Args()).correlation) for e in launches], dtype=np.int64))
        ranges = [e for e in complete if e.cat in _RANGE_CATS]
        if ranges:
            self.ranges.add(**self._host_spans(ranges))

    def _host_spans(self, events: list[_Event]) -> dict:
        """The columns host-side events share: name, process, thread, start and end."""
        start = _ns([e.ts for e in events])
        return {"name": self.names.encode([e.name for e in events]),
                "pid": np.array([_int(e.pid) for e in events], dtype=np.int64),
                "tid": np.array([_int(e.tid) for e in events], dtype=np.int64),
                "start_ns": start, "end_ns": start + _ns([e.dur for e in events])}

    def _table(self, columns: _Columns) -> pd.DataFrame:
        frame = {name: np.concatenate(parts) for name, parts in columns.parts.items() if name != "name"}
        frame["name"] = self.names.categorical(columns.parts.get("name", []))
        return pd.DataFrame(frame)

    def _trace(self) -> Trace:
        kernels = self._table(self.kernels)
        if "kind" not in kernels:
            kernels = kernels.assign(kind=pd.Series([], dtype=object), start_ns=[], end_ns=[])
        ranges = self._table(self.ranges)
        if len(ranges):
            ranges["domain"] = "user_annotation"
        launches = self._table(self.launches)
        return Trace(kernels=kernels, launches=launches if len(launches) else None,
                     ranges=ranges if len(ranges) else None, meta=self._meta())

    def _meta(self) -> dict:
        top = self.top
        devices = top.get("deviceProperties")
        gpu = devices[0].get("name") if isinstance(devices, list) and devices and isinstance(devices[0], dict) else None
        own = top.get("kprof")
        if isinstance(own, str):
            try:
                own = json.loads(own)
            except json.JSONDecodeError:
                own = None
        own = own if isinstance(own, dict) else {}
        versions = {k: top[k] for k in _VERSION_KEYS if isinstance(top.get(k), (str, int, float))}
        versions.update(own.get("versions") or {})
        meta = {"source": "kineto_json", "gpu": own.get("gpu", gpu), "versions": versions,
                "backend": own.get("backend"), "config": own.get("config") or {}}
        if isinstance(top.get("distributedInfo"), dict):
            meta["distributed"] = top["distributedInfo"]
        return meta


def read_kineto_json(path: str | Path) -> Trace:
    """Read a torch.profiler (Kineto) Chrome-trace JSON file, plain or gzip-compressed, into a :class:`Trace`."""
    path = Path(path)
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"
    opener = gzip.open if gzipped else open
    with opener(path, "rb") as stream:
        return _KinetoReader(stream, path.name).read()
