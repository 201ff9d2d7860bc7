"""The routing kernels alone on the GPU: microseconds per launch of `router_topk.route_topk` (each form of its rounds,
KIMI_DECODE_TOPK_FORM) and of the generic path's Triton top-k, on random fp32 logits, as the median over replays of a
CUDA graph of `--launches` launches back to back (each waits for the one before, as in a layer;
`graph_timing.launch_us`).

    python benchmarks/topk_alone.py --rows 1 8 64
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from graph_timing import launch_us  # noqa: E402
from kimi_decode.kernels import triton_kernels  # noqa: E402
from kimi_decode.kernels.router_topk import FORMS, route_topk  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--experts", type=int, default=896)
    parser.add_argument("--topk", type=int, default=16)
    parser.add_argument("--launches", type=int, default=20, help="launches per graph (an even number)")
    parser.add_argument("--replays", type=int, default=30)
    args = parser.parse_args()
    print(f"{'rows':>5} {'kernel':>14} {'us per launch':>14}")
    for rows in args.rows:
        logits = torch.randn(rows, args.experts, device="cuda")
        bias = torch.randn(args.experts, device="cuda") * 0.1
        ids = torch.empty(rows, args.topk, dtype=torch.int32, device="cuda")
        weights = torch.empty(rows, args.topk, device="cuda")
        kernels = {}
        for form in FORMS:
            os.environ["KIMI_DECODE_TOPK_FORM"] = form  # read when the kernel is compiled (its first call)
            kernels[f"cute {form}"] = launch_us(
                lambda i: route_topk(logits, bias, ids, weights, scaling=1.0), args.launches // 2, args.replays)
        kernels["triton"] = launch_us(
            lambda i: triton_kernels.route_topk(logits, bias, ids, weights, scaling=1.0), args.launches // 2,
            args.replays)
        for name, us in kernels.items():
            print(f"{rows:>5} {name:>14} {us:>14.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
