"""Per-kernel times of one layer in kprof captures: for each kernel of the layer, the median over steps of its own
time (the part of its interval no earlier kernel covers), its duration, and the gap before it (from the end of the
kernel that started before it), in the order of their median start.

    python benchmarks/per_kernel.py CAPTURE.kprof [CAPTURE.kprof ...] [--layer 1]

A kernel is known by its name, its stage and how many kernels of the same name and stage came before it in its
step, not by its place in the step: the kernels of a forked layer's streams start in either order from one step to
the next, and a place would mix two kernels' times. With several captures (A/B runs) the columns sit side by side,
kernels matched the same way; one that a capture lacks shows NaN there.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analyzers.layers import kernel_layers, owned_ns  # noqa: E402
from analyzers.trace import TraceError  # noqa: E402
from profiler.readers import read_trace  # noqa: E402

KEY = ["name", "stage", "nth"]  # a kernel of the layer, the same in every step


def layer_kernels(path: str, layer: int) -> pd.DataFrame:
    """`layer_rows` of the capture at `path`. Raises TraceError for a capture kprof cannot read or a layer it has no
    kernels of."""
    return layer_rows(kernel_layers(read_trace(path)), layer, Path(path).name)


def layer_rows(kernels: pd.DataFrame, layer: int, source: str = "capture") -> pd.DataFrame:
    """The kernels of `layer` in the steps of `kernels` (`analyzers.layers.kernel_layers`' rows), in start order
    within each step, with their own time (`own_us`, the part of each kernel's interval no earlier kernel of the
    step covers) and `nth`, how many kernels of the same name and stage started before them in their step."""
    kernels = kernels.assign(own_us=owned_ns(kernels) / 1e3)
    kernels = kernels[(kernels["layer"] == layer) & (kernels["step"] >= 0)].sort_values(["step", "start_ns"])
    if kernels.empty:
        raise TraceError(f"{source}: no kernels of layer {layer} in a step")
    return kernels.assign(nth=kernels.groupby(["step", "name", "stage"]).cumcount())


def kernel_table(kernels: pd.DataFrame) -> pd.DataFrame:
    """One row per kernel of the layer (`KEY`), in the order of its median start: its stream, and the medians over
    steps of `own`, `dur` and `gap` (us) and of `start` / `end` (us from the step's first kernel of the layer)."""
    first = kernels.groupby("step")["start_ns"].transform("min")
    ends_before = kernels.groupby("step")["end_ns"].shift()
    kernels = kernels.assign(start=(kernels["start_ns"] - first) / 1e3, end=(kernels["end_ns"] - first) / 1e3,
                             dur=(kernels["end_ns"] - kernels["start_ns"]) / 1e3,
                             gap=(kernels["start_ns"] - ends_before).fillna(0) / 1e3)
    table = kernels.groupby(KEY).agg(stream=("stream", "first"), own=("own_us", "median"), dur=("dur", "median"),
                                     gap=("gap", "median"), start=("start", "median"), end=("end", "median"))
    return table.sort_values("start", kind="stable").reset_index()


def layer_table(path: str, layer: int) -> pd.DataFrame:
    return kernel_table(layer_kernels(path, layer))


def short_names(names: pd.Series, width: int) -> pd.Series:
    """Kernel names without our CuTe kernels' common prefix, cut to `width`."""
    return names.str.replace("kernel_cutlass_kernel_kimi_decodekernels", "", regex=False).str[:width]


def side_by_side(tables: list[pd.DataFrame]) -> pd.DataFrame:
    """The tables' own, dur and gap columns (suffixed 0, 1, ...) on one row per kernel of any of them, ordered by
    each kernel's median start in the first table that has it."""
    out = None
    for i, t in enumerate(tables):
        part = t[KEY + ["own", "dur", "gap", "start"]].rename(columns=lambda c: c if c in KEY else f"{c}{i}")
        out = part if out is None else out.merge(part, on=KEY, how="outer")
    out["order"] = out[[f"start{i}" for i in range(len(tables))]].bfill(axis=1).iloc[:, 0]
    out = out.sort_values("order", kind="stable").reset_index(drop=True)
    out["name"] = short_names(out["name"], 34)
    cols = ["name", "stage"] + [f"{c}{i}" for i in range(len(tables)) for c in ("own", "dur", "gap")]
    return out[cols].round(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("captures", nargs="+")
    parser.add_argument("--layer", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        tables = [layer_table(p, args.layer) for p in args.captures]
    except TraceError as exc:
        print(f"per_kernel: {exc}", file=sys.stderr)
        return 1
    print(side_by_side(tables).to_string())
    print("sum of own us:", {f"own{i}": round(float(t["own"].sum()), 1) for i, t in enumerate(tables)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
