"""The CUPTI recorder: cupti-python activity records and graph-node callbacks, turned into a Trace.

What is recorded, and from where:

* ``CONCURRENT_KERNEL``, ``MEMCPY``, ``MEMSET`` activity  -> ``Trace.kernels`` (with ``graph_id`` / ``graph_node_id``
  of kernels replayed from a CUDA graph);
* ``RUNTIME`` and ``DRIVER`` activity                       -> ``Trace.launches`` (thread ids are system thread ids);
* ``MARKER`` activity (NVTX push/pop and start/end)          -> ``Trace.ranges``; NVTX reaches CUPTI only when
  ``NVTX_INJECTION64_PATH`` names the libcupti that cupti-python loads, set before the process starts;
* the RESOURCE callbacks ``GRAPHNODE_CREATED`` / ``GRAPHNODE_CLONED`` -> ``Trace.graph_nodes``. During stream
  capture a node is created inside the launch call that is being captured, on the launching thread, so the
  thread and CUPTI timestamp of the callback locate that call, and the range open around it is the node's range.
  Nodes cloned at instantiation point back to their original node; replayed kernels also carry the original node
  id (``source_graph_node_id``), which is used when the clone callback was not seen.

Activity objects are only valid inside the buffer callback, so each one is copied into a plain tuple there
(:func:`extract`). :func:`records_to_trace` turns the tuples into a Trace; it is pure, and tested on synthetic
records. Only one CUPTI subscriber may exist per process: this recorder cannot run together with torch.profiler,
Nsight Systems or Nsight Compute.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections import defaultdict
from dataclasses import dataclass, field

from profiler.recorders import RecorderError

# CUpti_ActivityFlag bits of MARKER records (cupti_activity.h); MARKER_END is not exported by every cupti-python.
MARKER_INSTANTANEOUS = 1
MARKER_START = 2
MARKER_END = 4

_BUFFER_BYTES = 8 << 20
_MEMCPY_NAMES = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA", 8: "DtoD", 9: "HtoH",
                 10: "PtoP"}


@dataclass
class CuptiRecords:
    """What one process recorded, as plain tuples (picklable; no CUPTI objects).

    ``kernels``  (kind, device, stream, start, end, name, correlation_id, graph_id, graph_node_id,
                  source_graph_node_id); graph ids are 0 outside graphs, as CUPTI reports them;
    ``apis``     (pid, tid, start, end, name, correlation_id);
    ``markers``  (id, flags, timestamp, name, domain, pid, tid);
    ``nodes``    (graph_id, node_id, original_node_id, tid, thread_ident, timestamp): one per created (original -1)
                 or cloned node; ``tid`` is the system thread id, ``thread_ident`` Python's ``threading.get_ident``.
    """

    pid: int = field(default_factory=os.getpid)
    kernels: list = field(default_factory=list)
    apis: list = field(default_factory=list)
    markers: list = field(default_factory=list)
    nodes: list = field(default_factory=list)
    errors: list = field(default_factory=list)


def extract(activity, kinds, api_name) -> tuple[str, tuple] | None:
    """Copy one activity record into ``(table, row)``; None for kinds kprof does not use.

    ``kinds`` maps the ``ActivityKind`` values to kprof's names (``kernel``, ``memcpy``, ``memset``, ``runtime``,
    ``driver``, ``marker``); ``api_name(kind, cbid)`` names a runtime or driver call.
    """
    kind = kinds.get(int(activity.kind))
    if kind is None:
        return None
    if kind in ("kernel", "memcpy", "memset"):
        if kind == "kernel":
            name = activity.name or ""
        elif kind == "memcpy":
            name = f"Memcpy {_MEMCPY_NAMES.get(int(activity.copy_kind), 'unknown')}"
        else:
            name = "Memset"
        return "kernels", (kind, int(activity.device_id), int(activity.stream_id), int(activity.start),
                           int(activity.end), name, int(activity.correlation_id), int(activity.graph_id),
                           int(activity.graph_node_id), int(getattr(activity, "source_graph_node_id", 0) or 0))
    if kind in ("runtime", "driver"):
        return "apis", (int(activity.process_id), int(activity.thread_id), int(activity.start), int(activity.end),
                        api_name(kind, int(activity.cbid)), int(activity.correlation_id))
    if kind == "marker":
        pt = activity.object_id.pt
        return "markers", (int(activity.id), int(activity.flags_), int(activity.timestamp), activity.name,
                           activity.domain, int(pt.process_id), int(pt.thread_id))
    return None


def marker_ranges(markers: list) -> list[tuple]:
    """Pair MARKER records into ranges ``(pid, tid, start, end, name, domain)``.

    A start record (``MARKER_START``) carries the name and domain; its end record has the same id. An end whose id
    matches no open start closes the innermost open range of its thread (push/pop semantics). Instantaneous
    markers, ranges still open at the end, and start/end ranges that end on another thread are left out (the
    Nsight Systems reports do the same).
    """
    open_by_id: dict[int, tuple] = {}
    stacks: dict[tuple[int, int], list[int]] = defaultdict(list)
    ranges = []
    for mid, flags, ts, name, domain, pid, tid in sorted(markers, key=lambda m: m[2]):
        if flags & MARKER_START:
            open_by_id[mid] = (pid, tid, ts, name or "", domain or "")
            stacks[(pid, tid)].append(mid)
            continue
        if flags & MARKER_INSTANTANEOUS and not flags & MARKER_END:
            continue
        start = open_by_id.pop(mid, None)
        if start is None:
            stack = stacks[(pid, tid)]
            while stack and start is None:
                start = open_by_id.pop(stack.pop(), None)
        else:
            stack = stacks[(start[0], start[1])]
            if stack and stack[-1] == mid:
                stack.pop()
            elif mid in stack:
                stack.remove(mid)
        if start is None or (start[0], start[1]) != (pid, tid):
            continue
        ranges.append((pid, tid, start[2], ts, start[3], start[4]))
    return ranges


def _node_rows(records: CuptiRecords, thread_ids: set[int]) -> list[tuple]:
    """``graph_nodes`` rows (graph_id, graph_node_id, correlation_id, pid, tid, start_ns, end_ns): one per created
    node, one per clone (anchored where its original was created), and one per replayed kernel node that only
    names its original through ``source_graph_node_id``."""
    # The callback saw both thread ids; keep the kind the activity records use.
    ident_matches = sum(1 for n in records.nodes if n[4] in thread_ids)
    tid_matches = sum(1 for n in records.nodes if n[3] in thread_ids)
    use_ident = ident_matches > tid_matches
    created, original = {}, {}
    for graph_id, node_id, original_id, tid, ident, ts in records.nodes:
        if original_id < 0:
            created[node_id] = (graph_id, ident if use_ident else tid, ts)
        else:
            original[node_id] = (graph_id, original_id)

    def anchor(node_id: int):
        # a clone link wins over the clone's own creation record (CUPTI may send both for one node)
        seen = set()
        while node_id in original and node_id not in seen:
            seen.add(node_id)
            node_id = original[node_id][1]
        return created.get(node_id)

    _anchor_instantiated_copies(created, records.apis)
    rows = {}
    for node_id, (graph_id, tid, ts) in created.items():
        found = anchor(node_id) if node_id in original else None
        tid, ts = (found[1], found[2]) if found is not None else (tid, ts)
        rows[node_id] = (graph_id, node_id, -1, records.pid, tid, ts, ts)
    for node_id, (graph_id, _) in original.items():
        found = anchor(node_id)
        if found is not None:
            rows[node_id] = (graph_id, node_id, -1, records.pid, found[1], found[2], found[2])
    for k in records.kernels:
        node_id, source = k[8], k[9]
        if node_id > 0 and node_id not in rows and source > 0:
            found = anchor(source)
            if found is not None:
                rows[node_id] = (k[7], node_id, -1, records.pid, found[1], found[2], found[2])
    return list(rows.values())


def _anchor_instantiated_copies(created: dict, apis) -> None:
    """Point the nodes of an instantiated copy of a graph back to the nodes they copy, in place.

    cudaGraphInstantiate copies the captured graph, and replayed kernels name the copy's nodes. When CUPTI reports
    the copy's nodes as created rather than cloned (seen with CUDA 13 on an H200), nothing links them to the
    capture. Such a graph is recognised by its nodes being created inside a ``*GraphInstantiate*`` call; it copies
    the latest earlier graph that is not itself a copy, and CUPTI numbers each graph's nodes in creation order
    (node id = graph id << 32 | index), so node i of the copy is node i of its source. Clone records, where CUPTI
    sends them, still take precedence (see `_node_rows`).
    """
    windows = [(start, end) for _, _, start, end, name, _ in apis if "GraphInstantiate" in name]
    if not windows:
        return
    by_graph: dict[int, list[int]] = {}
    for node_id, (graph_id, _, _) in created.items():
        by_graph.setdefault(graph_id, []).append(node_id)
    source = None
    for graph_id in sorted(by_graph):
        nodes = sorted(by_graph[graph_id])
        first = min(created[n][2] for n in nodes)
        is_copy = any(start <= first <= end for start, end in windows)
        if not is_copy:
            source = nodes
            continue
        if source is None or len(nodes) < len(source):
            continue
        if [n & 0xFFFFFFFF for n in source] != list(range(len(source))) or \
                [n & 0xFFFFFFFF for n in nodes[: len(source)]] != list(range(len(source))):
            continue
        for s_node, d_node in zip(source, nodes):
            created[d_node] = (graph_id, created[s_node][1], created[s_node][2])


def demangle(names: list[str]) -> dict[str, str]:
    """Itanium C++ names demangled with ``c++filt`` when it is on the PATH (CUPTI reports mangled kernel names;
    Kineto and Nsight Systems show demangled ones); other names, or all of them without c++filt, stay as they are."""
    mangled = [n for n in names if n.startswith("_Z")]
    tool = shutil.which("c++filt")
    if not mangled or tool is None:
        return {}
    try:
        out = subprocess.run([tool], input="\n".join(mangled) + "\n", capture_output=True, text=True, timeout=60,
                             check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(zip(mangled, out)) if len(out) == len(mangled) else {}


def records_to_trace(records: CuptiRecords, meta: dict | None = None):
    """Build a :class:`~analyzers.trace.Trace` (``meta["source"] == "cupti"``) from one process's records."""
    import pandas as pd

    from analyzers.trace import Trace

    kernel_columns = ["kind", "device", "stream", "start_ns", "end_ns", "name", "correlation_id", "graph_id",
                      "graph_node_id", "source_graph_node_id"]
    kernels = pd.DataFrame(records.kernels, columns=kernel_columns).drop(columns="source_graph_node_id")
    for column in ("graph_id", "graph_node_id"):
        kernels[column] = kernels[column].where(kernels[column] > 0, -1)
    kernels["pid"] = records.pid
    names = demangle(sorted(set(kernels["name"])))
    if names:
        kernels["name"] = kernels["name"].map(lambda n: names.get(n, n))
    launches = pd.DataFrame(records.apis, columns=["pid", "tid", "start_ns", "end_ns", "name", "correlation_id"])
    ranges = pd.DataFrame(marker_ranges(records.markers),
                          columns=["pid", "tid", "start_ns", "end_ns", "name", "domain"])
    thread_ids = set(launches["tid"]) | set(ranges["tid"])
    graph_nodes = pd.DataFrame(_node_rows(records, thread_ids), columns=[
        "graph_id", "graph_node_id", "correlation_id", "pid", "tid", "start_ns", "end_ns"])
    meta = {"source": "cupti", **(meta or {})}
    cloned = sum(1 for n in records.nodes if n[2] >= 0)
    meta["graph_node_callbacks"] = {"created": len(records.nodes) - cloned, "cloned": cloned}
    if records.errors:
        meta["recorder_errors"] = records.errors[:5]
    return Trace(kernels=kernels, launches=launches, ranges=ranges, graph_nodes=graph_nodes, meta=meta)


def _import_cupti():
    try:
        from cupti import cupti
    except ImportError as exc:
        raise RecorderError(f"cupti-python is not installed or cannot load ({exc}); install it with "
                            "'pip install cupti-python' (the major version of your CUDA driver)") from None
    return cupti


class CuptiSession:
    """Records CUDA activity of this process from :meth:`start` to :meth:`stop`.

    Call :meth:`start` before the program's first CUDA and NVTX calls where possible (CUPTI then sees the context
    being created), and synchronize the device before :meth:`stop`, which flushes every buffer.
    """

    def __init__(self) -> None:
        self.records = CuptiRecords()
        self._cupti = None
        self._subscriber = None
        self._enabled: list = []
        self._api_names: dict[tuple[str, int], str] = {}
        self._lock = threading.Lock()
        self.running = False

    # -- CUPTI callbacks (they must never raise into CUPTI) ------------------------------------------------------
    def _api_name(self, kind: str, cbid: int) -> str:
        key = (kind, cbid)
        name = self._api_names.get(key)
        if name is None:
            cupti = self._cupti
            domain = cupti.CallbackDomain.RUNTIME_API if kind == "runtime" else cupti.CallbackDomain.DRIVER_API
            try:
                name = cupti.get_callback_name(domain, cbid) or f"{kind}_{cbid}"
            except Exception:  # an id this CUPTI cannot name
                name = f"{kind}_{cbid}"
            self._api_names[key] = name
        return name

    def _buffer_requested(self):
        return _BUFFER_BYTES, 0

    def _buffer_completed(self, activities) -> None:
        tables = {"kernels": self.records.kernels, "apis": self.records.apis, "markers": self.records.markers}
        try:
            for activity in activities:
                found = extract(activity, self._kinds, self._api_name)
                if found is not None:
                    tables[found[0]].append(found[1])
        except Exception as exc:  # keep recording; report once at the end
            self._error(f"activity buffer: {type(exc).__name__}: {exc}")

    def _callback(self, userdata, domain, cbid, cbdata) -> None:
        cupti = self._cupti
        try:
            if domain != cupti.CallbackDomain.RESOURCE:
                return
            cloned = cbid == cupti.CallbackIdResource.GRAPHNODE_CLONED
            if not cloned and cbid != cupti.CallbackIdResource.GRAPHNODE_CREATED:
                return
            ts = cupti.get_timestamp()
            data = cupti.GraphData.from_ptr(cbdata.resource_descriptor)
            node_id = cupti.get_graph_node_id(data.node)
            graph_id = cupti.get_graph_id(data.graph) if data.graph else -1
            original = cupti.get_graph_node_id(data.original_node) if cloned and data.original_node else -1
            self.records.nodes.append((graph_id, node_id, original, threading.get_native_id(), threading.get_ident(),
                                       ts))
        except Exception as exc:
            self._error(f"graph node callback: {type(exc).__name__}: {exc}")

    def _error(self, message: str) -> None:
        with self._lock:
            if len(self.records.errors) < 20:
                self.records.errors.append(message)

    # -- control ---------------------------------------------------------------------------------------------------
    def start(self) -> "CuptiSession":
        cupti = self._cupti = _import_cupti()
        kind = cupti.ActivityKind
        self._kinds = {int(kind.CONCURRENT_KERNEL): "kernel", int(kind.MEMCPY): "memcpy", int(kind.MEMSET): "memset",
                       int(kind.RUNTIME): "runtime", int(kind.DRIVER): "driver", int(kind.MARKER): "marker"}
        try:
            # System thread ids (gettid), the same numbers the graph-node callback records.
            cupti.set_thread_id_type(cupti.ActivityThreadIdType.SYSTEM)
            cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
            for k in (kind.CONCURRENT_KERNEL, kind.MEMCPY, kind.MEMSET, kind.RUNTIME, kind.DRIVER, kind.MARKER):
                cupti.activity_enable(k)
                self._enabled.append(k)
            self._subscriber = cupti.subscribe(self._callback, None)
            for cbid in (cupti.CallbackIdResource.GRAPHNODE_CREATED, cupti.CallbackIdResource.GRAPHNODE_CLONED):
                cupti.enable_callback(1, self._subscriber, cupti.CallbackDomain.RESOURCE, cbid)
        except Exception as exc:
            self._teardown()
            raise RecorderError(f"CUPTI could not start: {_cupti_message(cupti, exc)}") from None
        self.running = True
        return self

    def stop(self) -> CuptiRecords:
        """Flush every activity buffer and stop recording; returns the records."""
        if self.running:
            self.running = False
            try:
                self._cupti.activity_flush_all(1)
            except Exception as exc:
                self._error(f"flush: {_cupti_message(self._cupti, exc)}")
            self._teardown()
        return self.records

    def _teardown(self) -> None:
        cupti = self._cupti
        for k in self._enabled:
            try:
                cupti.activity_disable(k)
            except Exception:
                pass
        self._enabled = []
        if self._subscriber is not None:
            try:
                cupti.unsubscribe(self._subscriber)
            except Exception:
                pass
            self._subscriber = None


def _cupti_message(cupti, exc: Exception) -> str:
    status = getattr(exc, "status", None)
    if status is not None:
        try:
            name = cupti.Result(status).name
        except Exception:
            name = str(status)
        if name == "ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED":
            return ("another CUPTI client is attached (torch.profiler, Nsight Systems or Nsight Compute); "
                    "only one can record a process")
        return f"{name} ({exc})"
    return f"{type(exc).__name__}: {exc}"


def loaded_cupti_library() -> str | None:
    """The libcupti file mapped into this process, from /proc/self/maps (None if none is loaded)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.count("/") else ""
                if "/libcupti.so" in path:
                    return os.path.realpath(path)
    except OSError:
        return None
    return None
