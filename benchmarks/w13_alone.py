"""The per-pair w13 expert kernel alone at one token, with its weights cold (from HBM) and hot (in L2), per setting.

    python benchmarks/w13_alone.py --tp 16 8 --settings defaults KIMI_DECODE_W13_WARPS=8

Each setting ("defaults", or NAME=VALUE[,NAME=VALUE...] environment variables set on top of them) compiles the
kernel as the layer does at batch 1 (quad-major codes, the backend's defaults otherwise). Cold: each launch takes the
next of `--sets` routing sets (16 experts of the layer drawn at random), so its rows are mostly not in L2 (a TP8
layer's w13 holds ~1.2 GB); hot: every launch the same set, whose rows (23 / 12 MB at TP8 / TP16) stay in L2. The
launches run back to back in a CUDA graph (each waits for the one before), so a launch's time is the kernel's whole
chain: ids, activations, weights, the mma work and the reduction. Hot against cold says how much of it the weight
bytes are; the rest is the chain and the arithmetic.
"""
import argparse
import os
import sys

import torch

from graph_timing import launch_us
from kimi_decode.config import shard
from kimi_decode.kernels.cute_common import launch
from kimi_decode.kernels.moe_mxfp4 import _w13_args, compile_moe, quad_major
from kimi_decode.weights import init_layer

p = argparse.ArgumentParser()
p.add_argument("--tp", type=int, nargs="+", default=[16, 8])
p.add_argument("--settings", nargs="+", default=["defaults"],
               help='"defaults" or NAME=VALUE[,NAME=VALUE...] (each timed in turn, in this process)')
p.add_argument("--sets", type=int, default=8)
p.add_argument("--replays", type=int, default=50)
a = p.parse_args()

def time_shard(tp: int) -> None:
    s = shard("k3", tp=tp)
    m, used = s.model, s.expert_inter_used
    w = init_layer(s, 1, seed=7, device="cuda").mlp
    w13, w2 = quad_major(w.w13), quad_major(w.w2)
    g = torch.Generator(device="cuda").manual_seed(tp)
    latent = torch.randn(1, m.moe_latent, device="cuda", generator=g).bfloat16()
    sets = [torch.randperm(m.num_experts, device="cuda", generator=g)[:m.top_k].view(1, -1).int()
            for _ in range(a.sets)]
    weights = torch.full((1, m.top_k), 1.0 / m.top_k, device="cuda")
    act = torch.empty(m.top_k, used, dtype=torch.float16, device="cuda")
    out = torch.empty(1, m.moe_latent, device="cuda")
    ssq = torch.empty(1, m.moe_latent // 16, device="cuda")
    # the rows the math reads: used w1 and w3 rows of 16 experts, codes and scales
    mb = m.top_k * 2 * used * (m.moe_latent // 2 + m.moe_latent // 32) / 1e6
    for setting in a.settings:
        pairs = [] if setting == "defaults" else [kv.split("=", 1) for kv in setting.split(",")]
        saved = {k: os.environ.get(k) for k, _ in pairs}
        os.environ.update(dict(pairs))
        f13, _ = compile_moe(latent, sets[0], weights, w13, w.w13_scale, w2, w.w2_scale, act, out, ssq, used,
                             quad_major=True)

        def run(i):
            launch(f13, *_w13_args(latent, sets[i], w13, w.w13_scale, act))

        cold = launch_us(run, a.sets, a.replays)
        hot = launch_us(lambda i: run(0), a.sets, a.replays)  # as many launches per graph as cold
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        print(f"{tp:>3} {setting:<36} {cold:>9.2f} {hot:>8.2f} {mb:>7.1f} {mb / cold:>10.2f}", flush=True)


print(f"{'tp':>3} {'setting':<36} {'cold us':>9} {'hot us':>8} {'MB':>7} {'cold TB/s':>10}")
for tp in a.tp:
    time_shard(tp)
    torch.cuda.empty_cache()
sys.exit(0)
