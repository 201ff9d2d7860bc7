"""Per-kernel times of one layer in kprof captures: for each kernel of the layer (in launch order), the median over
steps of its own time (the part of its interval no earlier kernel covers), its duration, and the gap before it.

    python benchmarks/per_kernel.py CAPTURE.kprof [CAPTURE.kprof ...] [--layer 1]

With several captures the columns sit side by side (same layer, kernels matched by position), for A/B runs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analyzers.layers import kernel_layers, owned_ns  # noqa: E402
from profiler.readers import read_trace  # noqa: E402


def layer_kernels(path: str, layer: int) -> pd.DataFrame:
    """The kernels of `layer` in the capture's steps, in launch order within each step (`pos`), with their own time
    (`own_us`, the part of each kernel's interval no earlier kernel covers)."""
    kernels = kernel_layers(read_trace(path))
    kernels["own_us"] = owned_ns(kernels) / 1e3
    kernels = kernels[(kernels["layer"] == layer) & (kernels["step"] >= 0)].sort_values(["step", "start_ns"])
    kernels["pos"] = kernels.groupby("step").cumcount()
    return kernels


def short_names(names: pd.Series, width: int) -> pd.Series:
    """Kernel names without our CuTe kernels' common prefix, cut to `width`."""
    return names.str.replace("kernel_cutlass_kernel_kimi_decodekernels", "", regex=False).str[:width]


def layer_table(path: str, layer: int) -> pd.DataFrame:
    kernels = layer_kernels(path, layer)
    kernels["dur_us"] = (kernels["end_ns"] - kernels["start_ns"]) / 1e3
    kernels["gap_us"] = (kernels["start_ns"] - kernels.groupby("step")["end_ns"].shift()).fillna(0) / 1e3
    table = kernels.groupby("pos").agg(name=("name", "first"), own=("own_us", "median"), dur=("dur_us", "median"),
                                       gap=("gap_us", "median"))
    table["name"] = short_names(table["name"], 34)
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("captures", nargs="+")
    parser.add_argument("--layer", type=int, default=1)
    args = parser.parse_args()
    tables = [layer_table(p, args.layer) for p in args.captures]
    out = tables[0][["name"]].copy()
    for i, t in enumerate(tables):
        for col in ("own", "dur", "gap"):
            out[f"{col}{i}"] = t[col].round(1)
    total = {f"own{i}": round(float(t["own"].sum()), 1) for i, t in enumerate(tables)}
    print(out.to_string())
    print("sum of own us:", total)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
