"""Prefetch effectiveness: is the prefetch hidden, and does it make the kernels that read the data faster?

*Prefetch work* is every activity of class ``prefetch`` (see :mod:`analyzers.classes`: kernels named as prefetches
and everything in a ``prefetch`` stage). Per decode step (median over the steps that ran prefetch work), and per
layer:

``prefetch_us``  length of the union of the prefetch intervals;
``hidden_us``    the part of it during which other (non-prefetch) work of the same step runs on the device;
``exposed_us``   ``prefetch_us - hidden_us``: time the prefetch alone occupies the GPU;
``hidden_pct``   ``100 * hidden / prefetch`` (None without prefetch work).

Across two captures that differ only in prefetch, :func:`consumer_change` compares the kernel time of the
*consumer* stages (the stages that read what was prefetched), and :func:`parse_ncu_csv` reads the L2 hit rate and
DRAM bytes of kernels from an Nsight Compute CSV, which is the only place in-kernel cache effects show.
"""
from __future__ import annotations

import csv
import io
import math

import numpy as np
import pandas as pd

from analyzers.classes import PREFETCH
from analyzers.overlap import LAYER_KEYS, STEP_KEYS, step_overlap

NAMES = ("prefetch_us", "hidden_us", "exposed_us", "hidden_pct")
# Stages that never consume prefetched weights.
NOT_CONSUMERS = ("prefetch", "allreduce")


def _summary(per_step: pd.DataFrame) -> dict:
    ran = per_step[per_step["a_ns"] > 0]
    if len(ran) == 0:
        return {"prefetch_us": 0.0, "hidden_us": 0.0, "exposed_us": 0.0, "hidden_pct": None}
    exposed = ran["a_ns"] - ran["overlap_ns"]
    return {"prefetch_us": round(float(ran["a_ns"].median()) / 1000.0, 3),
            "hidden_us": round(float(ran["overlap_ns"].median()) / 1000.0, 3),
            "exposed_us": round(float(exposed.median()) / 1000.0, 3),
            "hidden_pct": round(float(ran["hidden_pct"].median()), 2)}


def prefetch_effect(activities: pd.DataFrame) -> tuple[dict, dict[tuple[int, str], dict]]:
    """Whole-step ``{"prefetch_us", "hidden_us", "exposed_us", "hidden_pct"}`` and the same per (layer, kind) for
    the layers with prefetch work."""
    target = (activities["klass"] == PREFETCH).to_numpy()
    whole = _summary(step_overlap(activities, target, ~target, STEP_KEYS))
    per_layer = step_overlap(activities, target, ~target, LAYER_KEYS)
    layers = {(int(layer), str(kind)): _summary(frame)
              for (layer, kind), frame in per_layer.groupby(["layer", "layer_kind"], sort=True)
              if (frame["a_ns"] > 0).any()}
    return whole, layers


def consumer_change(stages: pd.DataFrame, consumers: list[str] | None = None) -> pd.DataFrame:
    """Kernel time of the consumer stages on both sides, per layer kind.

    ``stages`` is the stage table of :func:`analyzers.diff.diff` (``layer_kind``, ``stage``, ``base_kernel_us``,
    ``new_kernel_us``, per layer); ``consumers`` names the consumer stages (default: every stage but
    ``prefetch`` and ``allreduce``). Returns ``layer_kind``, ``base_us``, ``new_us``, ``delta_us``
    (new - base) per layer of that kind."""
    rows = stages[stages["stage"].isin(consumers) if consumers else ~stages["stage"].isin(NOT_CONSUMERS)]
    out = rows.groupby("layer_kind", sort=True)[["base_kernel_us", "new_kernel_us"]].sum().reset_index()
    out = out.rename(columns={"base_kernel_us": "base_us", "new_kernel_us": "new_us"})
    out["delta_us"] = out["new_us"] - out["base_us"]
    return out.round(3)


# --- Nsight Compute CSV ------------------------------------------------------------------------------------------

L2_METRICS = ("lts__t_sector_hit_rate.pct", "L2 Hit Rate")
DRAM_TOTAL = ("dram__bytes.sum", "DRAM Bytes")
DRAM_PARTS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
_BYTES = {"byte": 1, "bytes": 1, "b": 1, "kbyte": 1e3, "kb": 1e3, "mbyte": 1e6, "mb": 1e6, "gbyte": 1e9, "gb": 1e9,
          "tbyte": 1e12, "tb": 1e12, "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3}


def _number(text: str) -> float:
    value = float(text.replace(",", "").strip())
    if not math.isfinite(value):
        raise ValueError(text)
    return value


def parse_ncu_csv(text: str, source: str = "ncu CSV") -> pd.DataFrame:
    """Per kernel name from an ``ncu --csv`` export (the default *details* page, ``--metrics ...`` output, or
    ``--page raw``): ``launches``, ``l2_hit_pct`` (mean of ``lts__t_sector_hit_rate.pct``) and ``dram_mb`` (mean
    DRAM bytes per launch in MB: ``dram__bytes.sum``, or read + write), NaN where the file lacks the metric.

    Raises ``ValueError`` with a one-line message for a file that is not such a CSV."""
    lines = text.splitlines()
    header_at = next((i for i, line in enumerate(lines) if '"Kernel Name"' in line or line.startswith("Kernel Name")
                      or '"Function Name"' in line), None)
    if header_at is None:
        raise ValueError(f"{source}: not an Nsight Compute CSV (no 'Kernel Name' column; export with ncu --csv)")
    rows = list(csv.reader(io.StringIO("\n".join(lines[header_at:]))))
    header, body = rows[0], [r for r in rows[1:] if any(cell.strip() for cell in r)]
    name_col = header.index("Kernel Name") if "Kernel Name" in header else header.index("Function Name")
    id_col = header.index("ID") if "ID" in header else None
    records = []  # (launch id, kernel name, metric, value in base units)
    try:
        if "Metric Name" in header and "Metric Value" in header:
            metric_col, value_col = header.index("Metric Name"), header.index("Metric Value")
            unit_col = header.index("Metric Unit") if "Metric Unit" in header else None
            for n, row in enumerate(body):
                if len(row) != len(header):
                    raise ValueError(f"row {n + header_at + 2} has {len(row)} fields, the header {len(header)}")
                metric = row[metric_col]
                if metric in L2_METRICS + DRAM_TOTAL + DRAM_PARTS:
                    unit = row[unit_col] if unit_col is not None else ""
                    records.append((row[id_col] if id_col is not None else n, row[name_col], metric,
                                    _scaled(row[value_col], unit, metric)))
        else:
            units = body[0] if body and not body[0][name_col].strip() else [""] * len(header)
            data = body[1:] if body and not body[0][name_col].strip() else body
            wanted = [(i, m) for i, m in enumerate(header) if m in L2_METRICS + DRAM_TOTAL + DRAM_PARTS]
            for n, row in enumerate(data):
                if len(row) != len(header):
                    raise ValueError(f"a row has {len(row)} fields, the header {len(header)}")
                for i, metric in wanted:
                    if row[i].strip() not in ("", "n/a"):
                        records.append((row[id_col] if id_col is not None else n, row[name_col], metric,
                                        _scaled(row[i], units[i], metric)))
    except ValueError as exc:
        raise ValueError(f"{source}: bad value ({exc})") from None
    if not records:
        raise ValueError(f"{source}: no L2 hit rate (lts__t_sector_hit_rate.pct) or DRAM bytes (dram__bytes.sum, "
                         "dram__bytes_read.sum) metrics")
    frame = pd.DataFrame(records, columns=["launch", "name", "metric", "value"])
    wide = frame.pivot_table(index=["launch", "name"], columns="metric", values="value", aggfunc="first")
    l2 = wide[[m for m in L2_METRICS if m in wide.columns]].bfill(axis=1).iloc[:, 0] \
        if any(m in wide.columns for m in L2_METRICS) else pd.Series(np.nan, index=wide.index)
    if any(m in wide.columns for m in DRAM_TOTAL):
        dram = wide[[m for m in DRAM_TOTAL if m in wide.columns]].bfill(axis=1).iloc[:, 0]
    elif any(m in wide.columns for m in DRAM_PARTS):
        dram = wide[[m for m in DRAM_PARTS if m in wide.columns]].sum(axis=1, min_count=1)
    else:
        dram = pd.Series(np.nan, index=wide.index)
    per_launch = pd.DataFrame({"l2_hit_pct": l2, "dram_mb": dram / 1e6}).reset_index()
    out = per_launch.groupby("name", sort=True).agg(launches=("launch", "size"), l2_hit_pct=("l2_hit_pct", "mean"),
                                                    dram_mb=("dram_mb", "mean")).reset_index()
    return out.round({"l2_hit_pct": 2, "dram_mb": 4})


def _scaled(value: str, unit: str, metric: str) -> float:
    number = _number(value)
    if metric in L2_METRICS:
        return number
    factor = _BYTES.get(unit.strip().lower(), None) if unit.strip() else 1
    if factor is None:
        raise ValueError(f"unknown unit {unit!r} for {metric}")
    return number * factor


def ncu_records(frame: pd.DataFrame) -> list[dict]:
    """:func:`parse_ncu_csv` as JSON-ready records (NaN -> None)."""
    def clean(v):
        return None if pd.isna(v) else float(v)
    return [{"name": r.name, "launches": int(r.launches), "l2_hit_pct": clean(r.l2_hit_pct),
             "dram_mb": clean(r.dram_mb)} for r in frame.itertuples(index=False)]
