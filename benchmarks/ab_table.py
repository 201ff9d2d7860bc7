"""Side by side: the layer times of several `kimi_decode.bench --json` files, e.g. the A/B settings of
`run_h200.sh ab` (one `bench_ab_<setting>.json` each).

    python benchmarks/ab_table.py OUT/bench_ab_*.json [--backend latency_specialized] [--in-step]

One row per (tp, batch, layer) and one column per file (named by the part of its name after `bench_ab_`), in us:
each layer alone, or with `--in-step` its time within the step's graph; then a row per (tp, batch) for the whole
step. Files from before the bench had in-step times show "-" there; a file of a bench that stopped before its last
configuration is named "(incomplete)" and shows "-" for the ones it did not time.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd


def setting_name(path: str) -> str:
    stem = Path(path).stem
    return stem.split("bench_ab_", 1)[1] if "bench_ab_" in stem else stem


def layer_frame(paths: list[str], backend: str, in_step: bool) -> pd.DataFrame:
    """us per (tp, batch, layer) and file, plus each (tp, batch)'s whole step as layer "step"."""
    cols = {}
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
            results = doc["results"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a kimi_decode.bench JSON file ({exc})") from None
        values = {}
        for res in results:
            rows = [r for r in res["rows"] if r["backend"] == backend]
            for r in rows:
                values[(r["tp"], r["batch"], str(r["layer"]))] = r.get("in_step_us") if in_step else r["us"]
            if rows:
                values[(rows[0]["tp"], rows[0]["batch"], "step")] = res["step_us"]
        # a bench stopped before its last configuration (time limit, out of memory) leaves the ones it timed
        partial = isinstance(doc.get("meta"), dict) and doc["meta"].get("complete") is False
        cols[setting_name(path) + (" (incomplete)" if partial else "")] = values
    frame = pd.DataFrame(cols)
    if frame.empty:
        raise ValueError(f"no {backend} rows in these files")
    frame.index.names = ["tp", "batch", "layer"]
    return frame.sort_index(level=["tp", "batch"], sort_remaining=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--backend", default="latency_specialized")
    p.add_argument("--in-step", action="store_true", help="each layer's time within the step's graph")
    args = p.parse_args(argv)
    try:
        frame = layer_frame(args.files, args.backend, args.in_step)
    except ValueError as exc:
        print(f"ab_table: error: {exc}", file=sys.stderr)
        return 2
    print(frame.to_string(float_format=lambda v: f"{v:.1f}", na_rep="-"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
