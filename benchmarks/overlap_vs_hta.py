"""Communication/compute overlap on real multi-rank Kineto traces: kprof against HolisticTraceAnalysis.

    python benchmarks/overlap_vs_hta.py TRACE_DIR [--match auto_tp2_b1]

TRACE_DIR holds one torch.profiler JSON per rank (as `python -m kimi_decode.dist_bench --trace-dir` writes them).
HTA's `get_comm_comp_overlap` is computed over each rank's whole trace; kprof's figure is the same definition
(length of the intersection of the merged communication and merged compute intervals over the length of the merged
communication intervals, per device) taken over the whole trace as a single step, from kprof's own reader and
kernel classes. It prints both per rank and their difference in percentage points.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def kprof_hidden_pct(json_path: Path) -> tuple[float, float]:
    """(communication µs, % of it overlapped by compute) over the whole trace, per kprof."""
    from analyzers.classes import COMMUNICATION, COMPUTE, classify
    from analyzers.overlap import step_overlap
    from profiler.readers import read_kineto_json

    trace = read_kineto_json(json_path)
    acts = trace.kernels.copy()
    acts["step"] = 0
    acts["klass"] = classify(acts)
    out = step_overlap(acts, (acts["klass"] == COMMUNICATION).to_numpy(), (acts["klass"] == COMPUTE).to_numpy())
    row = out.iloc[0]
    return float(row["a_ns"]) / 1000.0, float(row["hidden_pct"])


def hta_hidden_pct(files: list[Path]) -> dict[int, float]:
    from hta.trace_analysis import TraceAnalysis

    with tempfile.TemporaryDirectory() as d:
        for f in files:
            shutil.copy(f, Path(d) / f.name)
        frame = TraceAnalysis(trace_dir=d).get_comm_comp_overlap(visualize=False)
    return {int(r.rank): float(r.comp_comm_overlap_ratio) * 100.0 for r in frame.itertuples()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace_dir")
    p.add_argument("--match", default="", help="only files whose name starts with this")
    args = p.parse_args(argv)
    files = sorted(f for f in Path(args.trace_dir).glob("*.rank*.json") if f.name.startswith(args.match))
    if not files:
        print(f"no *.rank*.json traces in {args.trace_dir}", file=sys.stderr)
        return 2
    by_config: dict[str, list[Path]] = {}
    for f in files:
        by_config.setdefault(f.name.split(".rank")[0], []).append(f)
    print(f"{'trace':<32}{'rank':>5}{'comm us':>10}{'kprof %':>10}{'HTA %':>10}{'diff':>8}")
    worst = 0.0
    for config, group in sorted(by_config.items()):
        hta = hta_hidden_pct(group)
        for f in group:
            rank = int(f.name.split(".rank")[1].split(".")[0])
            comm_us, ours = kprof_hidden_pct(f)
            theirs = hta.get(rank, np.nan)
            diff = ours - theirs
            worst = max(worst, abs(diff)) if np.isfinite(diff) else worst
            print(f"{config:<32}{rank:>5}{comm_us:>10.1f}{ours:>10.2f}{theirs:>10.2f}{diff:>8.2f}")
    print(f"largest |kprof - HTA|: {worst:.2f} percentage points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
