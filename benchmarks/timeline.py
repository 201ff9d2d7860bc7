"""When each kernel of one layer runs, in kprof captures: for each kernel (known as `per_kernel.py` knows it, in the
order of its median start) its stream, stage, and the median over steps of its start and end relative to the layer's
first kernel, to see which branch of a forked layer holds the next kernel back.

    python benchmarks/timeline.py CAPTURE.kprof [--layer 1]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analyzers.trace import TraceError  # noqa: E402
from per_kernel import layer_table, short_names  # noqa: E402


def layer_timeline(path: str, layer: int):
    table = layer_table(path, layer)[["name", "stream", "stage", "start", "end"]]
    table["name"] = short_names(table["name"], 40)
    return table.round(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("captures", nargs="+")
    parser.add_argument("--layer", type=int, default=1)
    args = parser.parse_args(argv)
    for path in args.captures:
        try:
            table = layer_timeline(path, args.layer)
        except TraceError as exc:
            print(f"timeline: {exc}", file=sys.stderr)
            return 1
        print(path)
        print(table.to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
