"""Reader for the SQLite export of an Nsight Systems report (``nsys export --type sqlite``).

Tables used (missing optional tables or columns are tolerated):

``CUPTI_ACTIVITY_KIND_KERNEL``/``_MEMCPY``/``_MEMSET``  -> ``Trace.kernels`` (names through ``StringIds``:
                                                           ``demangledName``, else ``shortName``; a kernel's CTAs
                                                           from ``gridX`` x ``gridY`` x ``gridZ``);
``CUPTI_ACTIVITY_KIND_RUNTIME``/``_DRIVER``             -> ``Trace.launches``;
``NVTX_EVENTS``                                         -> ``Trace.ranges``: push/pop and start/end ranges
                                                           (eventType 59, 60, 70, 71) that end on the thread that
                                                           opened them, with the domain name from eventType 75 rows;
``CUDA_GRAPH_NODE_EVENTS``                              -> ``Trace.graph_nodes``: a replayed node's
                                                           ``originalGraphNodeId`` chain is followed back to the
                                                           row made when the node was created during capture, whose
                                                           thread and time locate the capture-time range.

``globalTid`` packs the process id in bits 24-47 and the thread id in the low 24 bits.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd

from analyzers.trace import Trace
from profiler.readers.errors import TraceReadError

_RANGE_EVENT_TYPES = (59, 60, 70, 71)
_DOMAIN_CREATE = 75
_MAX_CLONE_CHAIN = 64
_COPY_KINDS = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA", 8: "DtoD", 9: "HtoH",
               10: "PtoP"}


def _pid(global_id: pd.Series) -> np.ndarray:
    """Process id from a ``globalTid``/``globalPid`` (-1 where missing)."""
    ids = pd.to_numeric(global_id, errors="coerce").fillna(-1).to_numpy(dtype=np.int64)
    return np.where(ids < 0, -1, (ids >> 24) & 0xFFFFFF)


def _tid(global_id: pd.Series) -> np.ndarray:
    """Thread id from a ``globalTid`` (-1 where missing)."""
    ids = pd.to_numeric(global_id, errors="coerce").fillna(-1).to_numpy(dtype=np.int64)
    return np.where(ids < 0, -1, ids & 0xFFFFFF)


def _ints(frame: pd.DataFrame, column: str) -> pd.Series:
    return pd.to_numeric(frame[column], errors="coerce").fillna(-1).astype("int64")


class _Export:
    def __init__(self, connection: sqlite3.Connection) -> None:
        self.db = connection
        self.tables = {name for (name,) in self.db.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}

    def columns(self, table: str) -> set[str]:
        return {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}

    def select(self, table: str, wanted: dict[str, str], joins: str = "", where: str = "") -> pd.DataFrame:
        """``SELECT`` the wanted ``alias: expression`` pairs, with NULL for expressions over absent columns of
        ``table`` (aliased ``t``)."""
        present = self.columns(table)
        parts = []
        for alias, expression in wanted.items():
            needs = [word[2:] for word in expression.replace("(", " ").replace(",", " ").split() if word.startswith("t.")]
            parts.append(f"{expression if all(n in present for n in needs) else 'NULL'} AS {alias}")
        return pd.read_sql_query(f"SELECT {', '.join(parts)} FROM {table} t {joins} {where}", self.db)

    def string_join(self, alias: str, column: str) -> str:
        return f"LEFT JOIN StringIds {alias} ON {alias}.id = t.{column}" if "StringIds" in self.tables else ""

    def gpu_activities(self) -> pd.DataFrame:
        frames = []
        common = {"start_ns": "t.start", "end_ns": "t.end", "device": "t.deviceId", "stream": "t.streamId",
                  "correlation_id": "t.correlationId", "global_pid": "t.globalPid", "graph_id": "t.graphId",
                  "graph_node_id": "t.graphNodeId"}
        if "CUPTI_ACTIVITY_KIND_KERNEL" in self.tables:
            names = self.columns("CUPTI_ACTIVITY_KIND_KERNEL")
            if "StringIds" in self.tables:
                candidates = [c for c in ("demangledName", "shortName") if c in names]
                joins = " ".join(f"LEFT JOIN StringIds s{i} ON s{i}.id = t.{c}" for i, c in enumerate(candidates))
                name = f"COALESCE({', '.join(f's{i}.value' for i in range(len(candidates)))}, '')" if candidates else "''"
            else:
                joins, name = "", "''"
            kernels = self.select("CUPTI_ACTIVITY_KIND_KERNEL",
                                  {**common, "name": name, "ctas": "t.gridX * t.gridY * t.gridZ"}, joins)
            frames.append(kernels.assign(kind="kernel"))
        if "CUPTI_ACTIVITY_KIND_MEMCPY" in self.tables:
            copies = self.select("CUPTI_ACTIVITY_KIND_MEMCPY", {**common, "copy_kind": "t.copyKind"})
            copy_kind = _ints(copies, "copy_kind")
            copies["name"] = "Memcpy " + copy_kind.map(_COPY_KINDS).fillna("kind " + copy_kind.astype(str))
            frames.append(copies.drop(columns="copy_kind").assign(kind="memcpy"))
        if "CUPTI_ACTIVITY_KIND_MEMSET" in self.tables:
            frames.append(self.select("CUPTI_ACTIVITY_KIND_MEMSET", common).assign(kind="memset", name="Memset"))
        frames = [f for f in frames if len(f)]
        if not frames:
            return pd.DataFrame(columns=["kind", "name", "start_ns", "end_ns"])
        activities = pd.concat(frames, ignore_index=True)
        if "ctas" not in activities:
            activities["ctas"] = None
        for column in ("start_ns", "end_ns", "device", "stream", "correlation_id", "graph_id", "graph_node_id",
                       "ctas"):
            activities[column] = _ints(activities, column)
        activities["pid"] = _pid(activities["global_pid"])
        return activities.drop(columns="global_pid")

    def launches(self) -> pd.DataFrame | None:
        frames = []
        for table in ("CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_DRIVER"):
            if table in self.tables:
                frames.append(self.select(table, {
                    "start_ns": "t.start", "end_ns": "t.end", "global_tid": "t.globalTid",
                    "correlation_id": "t.correlationId", "name": "COALESCE(s.value, '')" if "StringIds" in self.tables else "''",
                }, self.string_join("s", "nameId")))
        frames = [f for f in frames if len(f)]
        if not frames:
            return None
        calls = pd.concat(frames, ignore_index=True)
        return pd.DataFrame({
            "pid": _pid(calls["global_tid"]), "tid": _tid(calls["global_tid"]),
            "start_ns": _ints(calls, "start_ns"), "end_ns": _ints(calls, "end_ns"),
            "name": calls["name"], "correlation_id": _ints(calls, "correlation_id"),
        })

    def ranges(self) -> pd.DataFrame | None:
        if "NVTX_EVENTS" not in self.tables:
            return None
        present = self.columns("NVTX_EVENTS")
        text = "t.text" if "text" in present else "NULL"
        joins = ""
        if "textId" in present and "StringIds" in self.tables:
            text, joins = f"COALESCE({text}, s.value)", self.string_join("s", "textId")
        same_thread = "AND (t.endGlobalTid IS NULL OR t.endGlobalTid = t.globalTid)" if "endGlobalTid" in present else ""
        events = self.select("NVTX_EVENTS", {
            "start_ns": "t.start", "end_ns": "t.end", "global_tid": "t.globalTid", "domain_id": "t.domainId",
            "name": text,
        }, joins, f"WHERE t.eventType IN {_RANGE_EVENT_TYPES} AND t.end IS NOT NULL {same_thread}")
        if len(events) == 0:
            return None
        domains = {}
        if "domainId" in present:
            rows = self.db.execute(f"SELECT domainId, text FROM NVTX_EVENTS WHERE eventType = {_DOMAIN_CREATE}")
            domains = {domain: name for domain, name in rows if name is not None}
        return pd.DataFrame({
            "pid": _pid(events["global_tid"]), "tid": _tid(events["global_tid"]),
            "start_ns": _ints(events, "start_ns"), "end_ns": _ints(events, "end_ns"),
            "name": events["name"].fillna(""), "domain": events["domain_id"].map(domains).fillna(""),
        })

    def graph_nodes(self, kernels: pd.DataFrame) -> pd.DataFrame | None:
        if "CUDA_GRAPH_NODE_EVENTS" not in self.tables or len(kernels) == 0:
            return None
        events = self.select("CUDA_GRAPH_NODE_EVENTS", {
            "node": "t.graphNodeId", "original": "t.originalGraphNodeId", "start_ns": "t.start", "end_ns": "t.end",
            "global_tid": "t.globalTid",
        })
        events = events[events["node"].notna()]
        original = {int(n): int(o) for n, o in zip(events["node"], events["original"]) if pd.notna(o) and n != o}
        created = events[events["original"].isna()].drop_duplicates("node")
        creation = {int(n): (s, e, g) for n, s, e, g in
                    zip(created["node"], created["start_ns"], created["end_ns"], created["global_tid"])}
        replayed = kernels.loc[kernels["graph_node_id"] >= 0, ["graph_id", "graph_node_id"]].drop_duplicates("graph_node_id")
        rows = []
        for graph_id, node in zip(replayed["graph_id"], replayed["graph_node_id"]):
            source = int(node)
            for _ in range(_MAX_CLONE_CHAIN):
                if source in creation or source not in original:
                    break
                source = original[source]
            if source in creation and pd.notna(creation[source][2]):
                start, end, global_tid = creation[source]
                end = start if pd.isna(end) else end
                rows.append((graph_id, node, -1, int(global_tid), int(start), int(end)))
        if not rows:
            return None
        nodes = pd.DataFrame(rows, columns=["graph_id", "graph_node_id", "correlation_id", "global_tid", "start_ns", "end_ns"])
        nodes["pid"], nodes["tid"] = _pid(nodes["global_tid"]), _tid(nodes["global_tid"])
        return nodes.drop(columns="global_tid")

    def meta(self) -> dict:
        meta = {"source": "nsys_sqlite", "gpu": None, "versions": {}, "backend": None, "config": {}}
        try:
            if "TARGET_INFO_GPU" in self.tables and "name" in self.columns("TARGET_INFO_GPU"):
                row = self.db.execute("SELECT name FROM TARGET_INFO_GPU LIMIT 1").fetchone()
                meta["gpu"] = row[0] if row else None
            if "META_DATA_EXPORT" in self.tables:
                rows = self.db.execute("SELECT name, value FROM META_DATA_EXPORT WHERE name LIKE '%Version%'")
                meta["versions"] = {str(name): str(value) for name, value in rows}
        except sqlite3.Error:
            pass  # metadata is best effort: a report without it is still a trace
        return meta


def read_nsys_sqlite(path: str | Path) -> Trace:
    """Read an Nsight Systems SQLite export into a :class:`Trace`."""
    path = Path(path)
    try:
        connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise TraceReadError(f"{path.name}: cannot open SQLite database ({exc})") from None
    try:
        export = _Export(connection)
        if not {"CUPTI_ACTIVITY_KIND_KERNEL", "StringIds", "NVTX_EVENTS"} & export.tables:
            raise TraceReadError(f"{path.name}: SQLite database is not an Nsight Systems export (no StringIds, "
                                 "CUPTI_ACTIVITY_KIND_KERNEL or NVTX_EVENTS table)")
        kernels = export.gpu_activities()
        return Trace(kernels=kernels, launches=export.launches(), ranges=export.ranges(),
                     graph_nodes=export.graph_nodes(kernels), meta=export.meta())
    except (sqlite3.Error, pd.errors.DatabaseError) as exc:
        raise TraceReadError(f"{path.name}: corrupt SQLite database ({exc})") from None
    finally:
        connection.close()
