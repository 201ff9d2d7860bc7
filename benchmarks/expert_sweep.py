"""Routed-expert kernels alone, cold L2, by batch: the grouped CuTe kernels (w13, w2, both with the sum) against
`auto`'s Triton kernels, on one layer's MXFP4 weights.

    python benchmarks/expert_sweep.py --tp 16 8 --batch 16 64

Routing is uniform: each token picks 16 distinct experts at random, a fresh set per launch (4 sets rotated), so the
distinct experts of a launch are mostly not in L2 (a TP16 layer's experts hold ~1.2 GB). Each variant runs as a CUDA
graph of back-to-back launches, 20 replays, the median per launch; MB are the distinct experts' used rows and scales
(what the math needs) and TB/s is against the 4.3 TB/s HBM floor. The alignment kernels (no weight bytes: TB/s 0)
and the w13 kernel on the latent's fp16 operands (`latent_operands`) are timed on the same routing sets, as is the
w2 kernel's other form of `KIMI_DECODE_W2_AHEAD` ("(not ahead)" under the default, each segment's pairs loaded at its
start; "(ahead)" under "0"). The weights are as stored (TP16: w2 rows with the padded shard's zero columns, which the
backend's compact copy drops).
"""
import argparse
import os
import statistics
import sys
from unittest import mock

import torch

from graph_timing import launch_us
from kimi_decode.bench import expert_bytes, write_json
from kimi_decode.config import shard
from kimi_decode.kernels import triton_kernels as tk
from kimi_decode.kernels.cute_common import launch
from kimi_decode.kernels.moe_align import moe_align as cute_align
from kimi_decode.kernels.moe_mxfp4_grouped import (compile_grouped, kernel_args, latent_operands, moe_mxfp4_grouped,
                                                   w2_ahead)
from kimi_decode.weights import init_layer

p = argparse.ArgumentParser()
p.add_argument("--tp", type=int, nargs="+", default=[16, 8])
p.add_argument("--batch", type=int, nargs="+", default=[16, 64])
p.add_argument("--sets", type=int, default=4, help="routing sets rotated within the graph")
p.add_argument("--replays", type=int, default=20)
p.add_argument("--only", nargs="*", default=[], help="time only the variants whose names contain one of these")
p.add_argument("--json")
a = p.parse_args()
dev = torch.device("cuda")


rows = []
print(f"{'tp':>3} {'batch':>5} {'distinct':>8} {'MB':>7}  {'variant':<22} {'us':>8} {'TB/s':>6}")
for tp in a.tp:
    s = shard("k3", tp=tp)
    m = s.model
    w = init_layer(s, 1, seed=tp, device=dev).mlp
    used, L, k = s.expert_inter_used, m.moe_latent, m.top_k
    per_expert = expert_bytes(w, used)
    for batch in a.batch:
        P = batch * k
        gen = torch.Generator(device=dev).manual_seed(batch)
        ids = [torch.rand(batch, m.num_experts, device=dev, generator=gen).topk(k, dim=-1).indices.int().contiguous()
               for _ in range(a.sets)]
        weights = torch.softmax(torch.randn(batch, k, device=dev, generator=gen), dim=-1)
        latent = torch.randn(batch, L, device=dev, generator=gen).bfloat16()
        aligns = []
        for i in ids:
            al = [torch.empty(P, dtype=torch.int32, device=dev) for _ in range(4)]
            tk.moe_align(i.reshape(-1), *al)
            aligns.append(al)
        distinct = statistics.mean(int(i.unique().numel()) for i in ids)
        mb = distinct * per_expert / 1e6
        act = torch.empty(P, used, dtype=torch.float16, device=dev)
        pair_out = torch.empty(P, L, device=dev)
        f13, f2 = compile_grouped(latent, ids[0], weights, w.w13, w.w13_scale, w.w2, w.w2_scale, aligns[0], act,
                                  pair_out, used)
        args = [kernel_args(latent, weights, w.w13, w.w13_scale, w.w2, w.w2_scale, al, act, pair_out) for al in aligns]
        h = torch.empty(P, w.w13.shape[1], dtype=torch.bfloat16, device=dev)
        act_bf = torch.empty(P, w.w2.shape[2] * 2, dtype=torch.bfloat16, device=dev)
        out_t = torch.empty(P, L, device=dev)

        ops = latent_operands(latent)
        f13o, _ = compile_grouped(ops, ids[0], weights, w.w13, w.w13_scale, w.w2, w.w2_scale, aligns[0], act,
                                  pair_out, used, x_operands=True)
        args_o = [kernel_args(ops, weights, w.w13, w.w13_scale, w.w2, w.w2_scale, al, act, pair_out)[0]
                  for al in aligns]
        ahead = w2_ahead()
        with mock.patch.dict(os.environ, {"KIMI_DECODE_W2_AHEAD": "0" if ahead else "1"}):  # the w2 kernel's other form
            _, f2x = compile_grouped(latent, ids[0], weights, w.w13, w.w13_scale, w.w2, w.w2_scale, aligns[0], act,
                                     pair_out, used)
        other = "grouped w2 (not ahead)" if ahead else "grouped w2 (ahead)"
        scratch = [torch.empty(P, dtype=torch.int32, device=dev) for _ in range(4)]
        ops_out = torch.empty_like(ops)
        variants = {
            "grouped w13": (lambda i: launch(f13, *args[i][0]), 2 * used * (L // 2 + L // 32)),
            "grouped w13 (operands)": (lambda i: launch(f13o, *args_o[i]), 2 * used * (L // 2 + L // 32)),
            "align (Triton)": (lambda i: tk.moe_align(ids[i].reshape(-1), *scratch), 0),
            "align (CuTe)": (lambda i: cute_align(ids[i].reshape(-1), *scratch, experts=m.num_experts), 0),
            "align+operands (CuTe)": (lambda i: cute_align(ids[i].reshape(-1), *scratch, experts=m.num_experts,
                                                           latent=latent, operands=ops_out), 0),
            "grouped w2": (lambda i: launch(f2, *args[i][1]), L * (used // 2 + used // 32)),
            other: (lambda i: launch(f2x, *args[i][1]), L * (used // 2 + used // 32)),
            "grouped (both + sum)": (lambda i: moe_mxfp4_grouped(latent, ids[i], weights, w.w13, w.w13_scale, w.w2,
                                                                 w.w2_scale, used, aligns[i], act=act,
                                                                 pair_out=pair_out), per_expert),
            "auto w13": (lambda i: tk.moe_mxfp4(latent, w.w13, w.w13_scale, aligns[i], h, x_per_pair=False),
                         w.w13.shape[1] * (L // 2 + L // 32)),  # auto reads the padded rows too
            "auto w2": (lambda i: tk.moe_mxfp4(act_bf, w.w2, w.w2_scale, aligns[i], out_t, x_per_pair=True,
                                               row_scale=weights.reshape(-1)),
                        L * (w.w2.shape[2] + w.w2_scale.shape[2])),
        }
        for name, (fn, nbytes) in variants.items():
            if a.only and not any(o in name for o in a.only):
                continue
            us = launch_us(fn, a.sets, a.replays)
            vmb = distinct * nbytes / 1e6
            print(f"{tp:>3} {batch:>5} {distinct:>8.0f} {vmb:>7.1f}  {name:<22} {us:>8.2f} {vmb / us:>6.2f}")
            rows.append({"tp": tp, "batch": batch, "distinct": distinct, "mb": round(vmb, 2), "variant": name,
                         "us": round(us, 2)})
        # freed before the next batch's buffers, with the launch arguments that hold them too (rebound, not
        # deleted: the variants' lambdas name them)
        h = act_bf = out_t = act = pair_out = ops = ops_out = args = args_o = None
    w = None
    torch.cuda.empty_cache()
if a.json:
    sys.exit(write_json(a.json, {"gpu": torch.cuda.get_device_name(), "rows": rows}, "expert_sweep"))
