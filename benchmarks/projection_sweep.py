"""Per-projection time of cuBLAS, the small-batch GEMV and the tensor-core projections (split-K, `gemm_tc`; row tiles
with K over a CTA's warps, `gemm_tc_rows`; the warpgroup mma's split-K pipeline, `gemm_wgmma`), cold L2, by rows.

    python benchmarks/projection_sweep.py --tp 16 8 --rows 1 2 4 8 16 64
    python benchmarks/projection_sweep.py --tp 16 8 --rows 32 64 --variants cublas wgmma --plans 64 --blas cublaslt
    python benchmarks/projection_sweep.py --tp 16 --rows 64 --plans 64 --projections o_proj --only "wgmma g1 s2 st8"

Each variant runs as a CUDA graph of back-to-back launches over rotated weight copies (more bytes than L2 holds), 20
replays, the median per launch; bytes are the weights plus x and y; TB/s against the 4.3 TB/s HBM floor.
"""
import argparse
import sys

import torch

from graph_timing import launch_us
from kimi_decode.bench import write_json
from kimi_decode.config import shard
from kimi_decode.kernels.gemm_tc import Plan, plan_for, project
from kimi_decode.kernels.gemm_tc_rows import MAX_ROWS as ROWS_MAX, RowsPlan, rows_plan_for, project_rows
from kimi_decode.kernels.gemm_wgmma import (MAX_SPLITS, SMEM_LIMIT, STAGE_CHOICES, WgmmaPlan, project_wgmma,
                                            wgmma_plan_for)
from kimi_decode.kernels.gemv import MAX_ROWS as GEMV_ROWS, gemv
from kimi_decode.testing import projection_shapes

NAMES = ["in_proj", "f_b", "o_proj", "router", "latent_down", "latent_up", "shared_gate_up", "shared_down"]

p = argparse.ArgumentParser()
p.add_argument("--tp", type=int, nargs="+", default=[16, 8])
p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
p.add_argument("--plans", type=int, nargs="*", default=[8, 64], help="rows at which other tilings are timed too")
p.add_argument("--replays", type=int, default=20)
p.add_argument("--projections", nargs="*", choices=NAMES, help="only these projections (default: all)")
p.add_argument("--variants", nargs="*", choices=["cublas", "gemv", "tc", "rows", "wgmma"],
               help="only these kernels (default: all)")
p.add_argument("--blas", choices=["cublas", "cublaslt"], default="cublas",
               help="torch's BLAS library for the cuBLAS variant (the backend's projections above 16 rows: cublaslt)")
p.add_argument("--only", nargs="*",
               help="only the variants whose label starts with one of these (e.g. 'wgmma g1 s2 st8')")
p.add_argument("--json")
a = p.parse_args()
torch.backends.cuda.preferred_blas_library(a.blas)
dev = torch.device("cuda")
counters = torch.zeros(1024, dtype=torch.int32, device=dev)


rows_out = []
print(f"{'tp':>3} {'projection':>15} {'N':>5} {'K':>5} {'rows':>4} {'MB':>6}  variant                       us    TB/s")
for tp in a.tp:
    for name, (N, K) in zip(NAMES, projection_shapes(shard("k3", tp=tp))):
        if a.projections and name not in a.projections:
            continue
        wbytes = N * K * 2
        copies = max(2, min(16, -(-256 * 2**20 // wbytes)))
        ws = [torch.randn(N, K, device=dev).bfloat16() for _ in range(copies)]
        for M in a.rows:
            x = torch.randn(M, K, device=dev).bfloat16()
            y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            nbytes = wbytes + x.numel() * 2 + y.numel() * 2
            variants = [("cublas", lambda i: torch.matmul(x, ws[i].T, out=y))]
            if M <= GEMV_ROWS:
                variants.append(("gemv", lambda i: gemv(ws[i], x, y)))
            if M >= 2:
                best = plan_for(M, N, K)
                variants.append((f"tc w{best.warps} s{best.splits} (plan)",
                                 lambda i, pl=best: project(ws[i], x, y, counters, plan=pl)))
                if M in a.plans:
                    for warps in (4, 8):
                        for splits in sorted({max(1, best.splits // 2), best.splits * 2, best.splits + 1}):
                            pl = Plan(M, N, K, warps, splits)
                            if pl.key() == best.key() or pl.smem_bytes > SMEM_LIMIT or pl.splits != splits:
                                continue
                            variants.append((f"tc w{warps} s{pl.splits}",
                                             lambda i, pl=pl: project(ws[i], x, y, counters, plan=pl)))
            if 2 <= M <= ROWS_MAX:
                best = rows_plan_for(M, N, K)
                variants.append((f"rows w{best.warps} p{best.pipe} (plan)",
                                 lambda i, pl=best: project_rows(ws[i], x, y, plan=pl)))
                if M in a.plans:
                    chunks = K // 32
                    for warps in (16, 8, 4):
                        if chunks % warps:
                            continue
                        for pipe in (7, 4, 2):
                            if (chunks // warps) % pipe or (warps, pipe) == (best.warps, best.pipe):
                                continue
                            pl = RowsPlan(M, N, K, warps, pipe)
                            variants.append((f"rows w{warps} p{pipe}",
                                             lambda i, pl=pl: project_rows(ws[i], x, y, plan=pl)))
            if M >= 2:
                best = wgmma_plan_for(M, N, K)
                variants.append((f"wgmma g{best.wgs} s{best.splits} st{best.stages} (plan)",
                                 lambda i, pl=best: project_wgmma(ws[i], x, y, counters, plan=pl)))
                if M in a.plans:
                    for wgs in (1, 2):
                        for stages in STAGE_CHOICES:
                            for splits in sorted({1, 2, 3, max(1, best.splits // 2), best.splits,
                                                  min(MAX_SPLITS, best.splits * 2)}):
                                pl = WgmmaPlan(M, N, K, wgs, splits, stages)
                                if pl.key() == best.key() or pl.smem_bytes > SMEM_LIMIT or pl.splits != splits:
                                    continue
                                variants.append((f"wgmma g{wgs} s{pl.splits} st{stages}",
                                                 lambda i, pl=pl: project_wgmma(ws[i], x, y, counters, plan=pl)))
            if a.variants:
                variants = [(label, fn) for label, fn in variants if label.split()[0] in a.variants]
            if a.only:
                variants = [(label, fn) for label, fn in variants if label.startswith(tuple(a.only))]
            for label, fn in variants:
                try:
                    us = launch_us(fn, copies, a.replays)
                except Exception as exc:  # noqa: BLE001 - a tiling that does not launch is reported, not fatal
                    print(f"{tp:>3} {name:>15} {N:>5} {K:>5} {M:>4}  {label}: failed: {exc}")
                    continue
                rows_out.append(dict(tp=tp, projection=name, N=N, K=K, rows=M, variant=label, us=round(us, 2),
                                     tbps=round(nbytes / us / 1e6, 3)))
                print(f"{tp:>3} {name:>15} {N:>5} {K:>5} {M:>4} {wbytes / 1e6:6.1f}  {label:26s} {us:7.2f} "
                      f"{nbytes / us / 1e6:7.2f}")
        ws.clear()  # the weights freed before the next projection's (the lambdas name the list, not its items)
        torch.cuda.empty_cache()
if a.json:
    sys.exit(write_json(a.json, {"gpu": torch.cuda.get_device_name(), "rows": rows_out}, "projection_sweep"))
