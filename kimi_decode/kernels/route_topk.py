"""Routing after the router GEMV, in one kernel: sigmoid scores, correction bias, top-k of the experts on score + bias,
and the selected scores renormalised (times the routed scaling).

One warp per token: lane l holds experts l, l + 32, ... (28 of 896) in registers. Each of the k rounds takes the
lane's best by a tree of compares (5 levels of independent work the scheduler overlaps), then the warp's best
by 5 butterfly shuffles of (value, expert); the winning lane drops that expert. Ties go to the lower expert index.
The k rounds are a chain of dependent steps, so a warp is all the parallelism this needs at batch <= 64.
"""
from __future__ import annotations

import torch

from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, fake_like, launch, signature

if HAVE_CUTE:
    from .cute_common import pdl_launch_dependents, pdl_wait

if HAVE_CUTE:
    from cutlass import Float32, Int32

    def _better(v, i, ov, oi):
        """(value, index) of the better of two candidates: larger value, then smaller index."""
        take = (ov > v) | ((ov == v) & (oi < i))
        return cutlass.select_(take, ov, v), cutlass.select_(take, oi, i)

    def _tree_best(cands: list) -> tuple:
        """The best (value, index) of a list, as a tree of `_better` (plain Python: unrolled while tracing)."""
        while len(cands) > 1:
            nxt = [_better(*cands[i], *cands[i + 1]) for i in range(0, len(cands) - 1, 2)]
            cands = nxt + cands[len(nxt) * 2:]
        return cands[0]

    class RouteTopK:
        def __init__(self, experts: int, topk: int, scaling: float):
            self.E, self.k, self.scaling = experts, topk, scaling
            self.per_lane = -(-experts // 32)

        @cute.jit
        def __call__(self, logits: cute.Tensor, bias: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor, stream):
            self.kernel(logits, bias, ids, weights).launch(grid=[logits.shape[0], 1, 1], block=[32, 1, 1],
                                                           stream=stream, use_pdl=self.pdl)

        @cute.kernel
        def kernel(self, logits: cute.Tensor, bias: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor):
            lane, _, _ = cute.arch.thread_idx()
            b, _, _ = cute.arch.block_idx()
            pdl_launch_dependents(self.pdl)
            pdl_wait(self.pdl)
            neg = Float32(-float("inf"))
            score = cute.make_rmem_tensor((self.per_lane,), Float32)
            sel = cute.make_rmem_tensor((self.per_lane,), Float32)
            for s in cutlass.range_constexpr(self.per_lane):
                e = lane + 32 * s
                score[s] = Float32(0.0)
                sel[s] = neg
                if e < self.E:
                    p = Float32(1.0) / (Float32(1.0) + cute.math.exp(Float32(0.0) - logits[b, e]))
                    score[s] = p
                    sel[s] = p + bias[e]
            mine_w = Float32(0.0)  # lane r keeps the score of the r-th choice
            total = Float32(0.0)
            for r in cutlass.range(self.k, unroll=1):  # a loop, not unrolled: straight-line code this long would
                # run from a cold instruction cache on every replay
                v, slot = _tree_best([(sel[s], Int32(s)) for s in range(self.per_lane)])
                gi = lane + 32 * slot
                for off in (16, 8, 4, 2, 1):
                    v, gi = _better(v, gi, cute.arch.shuffle_sync_bfly(v, offset=off),
                                    cute.arch.shuffle_sync_bfly(gi, offset=off))
                owner = gi % 32
                won = gi // 32
                mine = Float32(0.0)
                for s in cutlass.range_constexpr(self.per_lane):
                    hit = (lane == owner) & (won == s)
                    mine = cutlass.select_(hit, score[s], mine)
                    sel[s] = cutlass.select_(hit, neg, sel[s])
                p = cute.arch.shuffle_sync(mine, offset=owner)
                mine_w = cutlass.select_(lane == r, p, mine_w)
                total = total + p
                if lane == 0:
                    ids[b, r] = gi
            if lane < self.k:
                weights[b, lane] = mine_w / total * Float32(self.scaling)


def route_topk(logits: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *,
               scaling: float) -> None:
    """logits [B, E] fp32, bias [E] fp32 -> ids [B, k] int32 and weights [B, k] fp32, written in place."""
    B, E = logits.shape
    if (logits.dtype, bias.dtype, ids.dtype, weights.dtype) != (torch.float32, torch.float32, torch.int32,
                                                                 torch.float32):
        raise ValueError("route_topk: fp32 logits, bias and weights, int32 ids expected")
    if bias.shape != (E,) or ids.shape != weights.shape or ids.shape[0] != B or ids.shape[1] > min(E, 32):
        raise ValueError(f"route_topk: shapes do not chain: logits {tuple(logits.shape)}, bias "
                         f"{tuple(bias.shape)}, ids {tuple(ids.shape)}")
    for t in (logits, bias, ids, weights):
        if not t.is_contiguous():
            raise ValueError("route_topk: inputs must be contiguous")
    key = ("route_topk", float(scaling), *signature(logits, bias, ids, weights))
    fn = compile_kernel(key, RouteTopK(E, ids.shape[1], float(scaling)),
                        *(fake_like(t, align=4) for t in (logits, bias, ids, weights)))
    launch(fn, logits, bias, ids, weights, align=4)
