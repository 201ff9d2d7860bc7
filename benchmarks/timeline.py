"""When each kernel of one layer runs, in kprof captures: for each kernel (in launch order) its stream, stage, and the
median over steps of its start and end relative to the layer's first kernel, to see which branch of a forked layer
holds the next kernel back.

    python benchmarks/timeline.py CAPTURE.kprof [--layer 1]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from per_kernel import layer_kernels, short_names  # noqa: E402


def layer_timeline(path: str, layer: int):
    kernels = layer_kernels(path, layer)
    first = kernels.groupby("step")["start_ns"].transform("min")
    kernels = kernels.assign(start_us=(kernels["start_ns"] - first) / 1e3, end_us=(kernels["end_ns"] - first) / 1e3)
    table = kernels.groupby("pos").agg(name=("name", "first"), stream=("stream", "first"), stage=("stage", "first"),
                                       start=("start_us", "median"), end=("end_us", "median"))
    table["name"] = short_names(table["name"], 40)
    return table.round(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("captures", nargs="+")
    parser.add_argument("--layer", type=int, default=1)
    args = parser.parse_args()
    for path in args.captures:
        print(path)
        print(layer_timeline(path, args.layer).to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
