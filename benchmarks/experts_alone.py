"""The per-pair expert kernels alone at one token, with their weights cold (from HBM) and hot (in L2), per setting.

    python benchmarks/experts_alone.py --kernel w13 w2 --tp 16 8 --settings defaults KIMI_DECODE_W13_WARPS=8

Each setting ("defaults", or NAME=VALUE[,NAME=VALUE...] environment variables set on top of them) compiles the
kernels as the layer does at batch 1, on the expert codes the backend gives them under that setting (its
quad-major, packed and compact copies: `_expert_codes`); w13 the plain kernel; w2 the one with the shared experts'
down-projection in CTAs of its own and the routed sum's bf16(out * norm weight) written for the MoE tail. Cold:
each launch takes the next of `--sets` routing sets (16 experts of the layer drawn at random) and, for w2, the next
of as many copies of the shared down weight, so its rows are mostly not in L2 (a TP8 layer's w13 holds ~1.2 GB);
hot: every launch the same set and copy, whose rows stay in L2 (w13 23 / 12 MB at TP8 / TP16, w2 with the shared
down 23 / 11). The launches run back to back in a CUDA graph (each waits for the one before, no PDL), so a
launch's time is the kernel's whole chain: ids, activations, weights, the mma work and the reduction, and the ~1.2
us a kernel costs in a graph. Hot against cold says how much of it fetching the weights from HBM rather than L2 is;
hot still moves them, from L2.
"""
import argparse
import os
import sys
from unittest import mock

import torch

from graph_timing import launch_us
from kimi_decode.backends import get_backend
from kimi_decode.bench import expert_stage_bytes
from kimi_decode.config import shard
from kimi_decode.kernels.cute_common import launch
from kimi_decode.kernels.moe_mxfp4 import _w2_args, _w13_args, compile_moe
from kimi_decode.weights import init_layer


def setting_arg(text: str) -> str:
    """A --settings value: "defaults", or NAME=VALUE pairs joined by commas."""
    if text != "defaults" and not all(kv.partition("=")[0] and kv.partition("=")[1] for kv in text.split(",")):
        raise argparse.ArgumentTypeError(f'{text!r}: expected "defaults" or NAME=VALUE[,NAME=VALUE...]')
    return text


p = argparse.ArgumentParser(description="The batch-1 expert kernels alone, weights cold and hot.")
p.add_argument("--kernel", nargs="+", choices=["w13", "w2"], default=["w13"])
p.add_argument("--tp", type=int, nargs="+", default=[16, 8])
p.add_argument("--settings", nargs="+", type=setting_arg, default=["defaults"],
               help='"defaults" or NAME=VALUE[,NAME=VALUE...] (each timed in turn, in this process)')
p.add_argument("--sets", type=int, default=8, help="routing sets (and shared down copies) rotated when cold")
p.add_argument("--replays", type=int, default=50)
a = p.parse_args()
if a.sets < 1 or a.replays < 1:
    p.error("--sets and --replays must be at least 1")
try:
    for tp in a.tp:
        shard("k3", tp=tp)
except ValueError as e:
    p.error(f"--tp: {e}")
if not torch.cuda.is_available():
    sys.exit("experts_alone: needs a CUDA GPU (the kernels run on it)")


def with_setting(setting: str, fn):
    """fn() with the setting's environment variables set, restored afterwards."""
    pairs = [] if setting == "defaults" else [kv.split("=", 1) for kv in setting.split(",")]  # (`setting_arg`)
    with mock.patch.dict(os.environ, dict(pairs)):
        return fn()


def time_shard(tp: int) -> None:
    s = shard("k3", tp=tp)
    m, used = s.model, s.expert_inter_used
    H, S, L, k, bf = m.hidden, s.shared_inter, m.moe_latent, m.top_k, torch.bfloat16
    w = init_layer(s, 1, seed=7, device="cuda").mlp
    g = torch.Generator(device="cuda").manual_seed(tp)
    latent = torch.randn(1, L, device="cuda", generator=g).to(bf)
    sets = [torch.randperm(m.num_experts, device="cuda", generator=g)[:k].view(1, -1).int() for _ in range(a.sets)]
    weights = torch.full((1, k), 1.0 / k, device="cuda")
    act = torch.randn(k, used, device="cuda", generator=g).half()
    out, ssq = torch.empty(1, L, device="cuda"), torch.empty(1, L // 16, device="cuda")
    scaled = (w.latent_norm, torch.empty(1, L, dtype=bf, device="cuda"))
    downs = [torch.randn(H, S, device="cuda", generator=g).to(bf) for _ in range(a.sets)]
    s_act, s_out = torch.randn(1, S, device="cuda", generator=g).to(bf), torch.empty(1, H, dtype=bf, device="cuda")
    shared = (torch.empty(2 * S, H, dtype=bf, device="cuda"), torch.empty(1, H, dtype=bf, device="cuda"), s_act,
              downs[0], s_out)
    # the rows the math reads (codes and scales; w2 with the shared down weight)
    w13_bytes, w2_bytes = expert_stage_bytes(w, used)
    mb = {"w13": k * w13_bytes / 1e6, "w2": (k * w2_bytes + 2 * H * S) / 1e6}

    def build():
        """The expert codes as a backend made under the setting gives them, and the two kernels compiled for them."""
        w13, w2, quad = get_backend("latency_specialized")._expert_codes(w, used)
        return (w13, w2, *compile_moe(latent, sets[0], weights, w13, w.w13_scale, w2, w.w2_scale, act, out, ssq,
                                      used, scaled, shared=shared, shared_act_ready=True, quad_major=quad))

    for setting in a.settings:
        w13, w2, f13, f2 = with_setting(setting, build)
        runs = {
            "w13": lambda i: launch(f13, *_w13_args(latent, sets[i], w13, w.w13_scale, act)),
            "w2": lambda i: launch(f2, *_w2_args(act, sets[i], weights, w2, w.w2_scale, out, ssq, scaled),
                                   downs[i], s_act, s_out),
        }
        for kernel in a.kernel:
            run = runs[kernel]
            cold = launch_us(run, a.sets, a.replays)
            hot = launch_us(lambda i: run(0), a.sets, a.replays)  # as many launches per graph as cold
            print(f"{kernel:>6} {tp:>3} {setting:<36} {cold:>9.2f} {hot:>8.2f} {mb[kernel]:>7.1f} "
                  f"{mb[kernel] / cold:>10.2f}", flush=True)


print(f"{'kernel':>6} {'tp':>3} {'setting':<36} {'cold us':>9} {'hot us':>8} {'MB':>7} {'cold TB/s':>10}")
for tp in a.tp:
    try:
        time_shard(tp)
    except ValueError as e:  # a setting's value the kernels refuse, by name
        sys.exit(f"experts_alone: {e}")
    torch.cuda.empty_cache()
