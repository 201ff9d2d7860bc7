"""Whether the cuBLAS projections above the tensor-core rows (17..64 tokens) use the whole GPU, and what else would.

At 64 rows cuBLAS (the layer's in_proj, output projection, router, latent down and up, shared experts) picks tiles
that give some shapes fewer CTAs than the H200's 132 SMs: one CTA per 64-row tile of the output features, no split
of K. This script times, per projection and rows, cold L2 (rotated weight copies), CUDA graphs of back-to-back
launches (median per launch):

- `nt`: y = x @ w.T, w [N, K] as the backend stores it (what runs now);
- `nn`: y = x @ wt, the same weights stored [K, N];
- `cC`: the output features in C contiguous chunks, each chunk's GEMM on a stream of its own (forked and joined inside
  the graph), writing its columns of y in place;

and, from one profiled launch of each, the kernels cuBLAS ran and their CTAs.

    python benchmarks/cublas_fill.py --tp 16 8 --rows 32 64 --json out.json [--blas cublaslt]
"""
import argparse
import os
import sys
import tempfile

import torch

from graph_timing import launch_us
from kimi_decode.bench import write_json
from kimi_decode.config import shard
from kimi_decode.testing import projection_shapes

NAMES = ["in_proj", "f_b", "o_proj", "router", "latent_down", "latent_up", "shared_gate_up", "shared_down"]
HBM = 4.3e12


def kernels_of(fn) -> list[tuple[str, int]]:
    """(name, CTAs) of each kernel one call of fn launches, from a torch.profiler trace (kprof's Kineto reader)."""
    from torch.profiler import ProfilerActivity, profile

    from profiler.readers.kineto_json import read_kineto_json

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.json")
        prof.export_chrome_trace(path)
        k = read_kineto_json(path).kernels
    k = k[k["kind"] == "kernel"].sort_values("start_ns")
    return [(str(name)[:60], int(ctas)) for name, ctas in zip(k["name"], k["ctas"])]


def chunked(x, ws, y, streams, bounds):
    """y[:, a:b] = x @ w[a:b].T for each chunk, each on its own stream, joined back into the current one."""
    main = torch.cuda.current_stream()
    for s in streams:
        s.wait_stream(main)
    for s, (a, b), w in zip(streams, bounds, ws):
        with torch.cuda.stream(s):
            torch.matmul(x, w.T, out=y[:, a:b])
    for s in streams:
        main.wait_stream(s)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, nargs="+", default=[16, 8])
    p.add_argument("--rows", type=int, nargs="+", default=[64])
    p.add_argument("--chunks", type=int, nargs="*", default=[2, 3, 4])
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--projections", nargs="*", choices=NAMES)
    p.add_argument("--blas", choices=["default", "cublaslt"], default="default",
                   help="torch's preferred BLAS library for the GEMMs (torch.backends.cuda.preferred_blas_library)")
    p.add_argument("--json")
    a = p.parse_args()
    if a.blas != "default":
        torch.backends.cuda.preferred_blas_library(a.blas)
    dev = torch.device("cuda")
    streams = [torch.cuda.Stream() for _ in range(max(a.chunks, default=1))]
    out = []
    print(f"{'tp':>3} {'projection':>15} {'N':>5} {'K':>5} {'rows':>4} {'MB':>6}  {'variant':8s} {'us':>7} {'TB/s':>6}"
          "  kernels (CTAs)")
    for tp in a.tp:
        for name, (N, K) in zip(NAMES, projection_shapes(shard("k3", tp=tp))):
            if (a.projections and name not in a.projections) or (not a.projections and name == "f_b"):
                continue
            wbytes = N * K * 2
            copies = max(2, min(16, -(-256 * 2**20 // wbytes)))
            ws = [torch.randn(N, K, device=dev).bfloat16() for _ in range(copies)]
            wts = [w.T.contiguous() for w in ws]
            for M in a.rows:
                x = torch.randn(M, K, device=dev).bfloat16()
                y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
                nbytes = wbytes + x.numel() * 2 + y.numel() * 2
                variants = [("nt", lambda i: torch.matmul(x, ws[i].T, out=y)),
                            ("nn", lambda i: torch.matmul(x, wts[i], out=y))]
                for C in a.chunks:
                    step = -(-N // C // 8) * 8
                    bounds = [(c, min(c + step, N)) for c in range(0, N, step)]
                    parts = [[w[s:e] for s, e in bounds] for w in ws]
                    variants.append((f"c{len(bounds)}", lambda i, b=bounds, pp=parts:
                                     chunked(x, pp[i], y, streams[:len(b)], b)))
                ref = None
                for label, fn in variants:
                    fn(0)
                    torch.cuda.synchronize()
                    if ref is None:
                        ref = y.float().clone()
                    elif not torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2):
                        raise SystemExit(f"{name} {label}: result differs from nt")
                    us = launch_us(fn, copies, a.replays)
                    ks = kernels_of(lambda: fn(0))
                    desc = ", ".join(f"{k} ({n})" for k, n in ks)
                    out.append(dict(tp=tp, projection=name, N=N, K=K, rows=M, variant=label, us=round(us, 2),
                                    tbps=round(nbytes / us / 1e6, 3), floor_pct=round(100 * nbytes / HBM / us * 1e6,
                                                                                      1), kernels=ks))
                    print(f"{tp:>3} {name:>15} {N:>5} {K:>5} {M:>4} {wbytes / 1e6:6.1f}  {label:8s} {us:7.2f} "
                          f"{nbytes / us / 1e6:6.2f}  {desc}", flush=True)
            # the weights freed before the next shape's: the lists, and the chunk views the last variants (and fn) hold
            ws.clear()
            wts.clear()
            variants = parts = fn = None
            torch.cuda.empty_cache()
    if a.json:
        return write_json(a.json, {"gpu": torch.cuda.get_device_name(), "blas": a.blas,
                                   "sms": torch.cuda.get_device_properties(0).multi_processor_count, "rows": out},
                          "cublas_fill")
    return 0


if __name__ == "__main__":
    sys.exit(main())
