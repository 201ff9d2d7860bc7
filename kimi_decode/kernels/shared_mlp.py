"""The shared experts at batch 1 in one kernel: gate/up GEMV with SiTU-GLU, then the down-projection.

Two stages of one grid (`cute_common.take_ticket`): the first CTAs by ticket run the gate/up projection with its
SiTU-GLU epilogue (`gemv.SmallBatchGemv` with `glu`, one (gate, up) row pair per warp pair or split-K over the
CTA), storing the activation [1, I]; the others run the down-projection [H, I] over it (`SmallBatchGemv`, 4 rows
per CTA). A down-projection CTA first asks L2 for its weight rows, then waits until every first-stage CTA has
counted itself done, then streams. One kernel and one launch gap fewer than the two GEMVs, and the down-projection's
weights are on their way while the gate/up stage runs.
"""
from __future__ import annotations

import torch

from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, fake_like, launch, signature
from .gemv import VEC, WARPS

if HAVE_CUTE:
    from cutlass import Float32, Int32

    from .cute_common import count_done, last_cta, prefetch_l2, take_ticket, wait_count
    from .gemv import SmallBatchGemv

    class SharedMLP:
        def __init__(self, H: int, inter: int):
            self.glu = SmallBatchGemv(1, inter, H, accumulate=False, addend=False, glu=True)
            self.down = SmallBatchGemv(1, H, inter, accumulate=False, addend=False)
            self.H, self.I = H, inter
            self.n1 = -(-inter // self.glu.rows)
            self.n2 = -(-H // self.down.rows)

        @cute.jit
        def __call__(self, mWgu: cute.Tensor, mX: cute.Tensor, mAct: cute.Tensor, mWd: cute.Tensor,
                     mOut: cute.Tensor, mCnt: cute.Tensor, stream):
            self.glu.pdl = self.down.pdl = self.pdl
            gWgu = cute.zipped_divide(mWgu, (1, VEC))
            gX = cute.zipped_divide(mX, (1, VEC))
            gWd = cute.zipped_divide(mWd, (1, VEC))
            gAct = cute.zipped_divide(mAct, (1, VEC))
            self.kernel(gWgu, gX, mAct, gWd, gAct, mOut, mCnt).launch(
                grid=[self.n1 + self.n2, 1, 1], block=[32 * WARPS, 1, 1], stream=stream, use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, gWgu: cute.Tensor, gX: cute.Tensor, mAct: cute.Tensor, gWd: cute.Tensor,
                   gAct: cute.Tensor, mOut: cute.Tensor, mCnt: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 2)), 16)
            slot = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
            flag = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
            pre = self.glu.allocate_preload(smem)  # nothing is preloaded (a stand-in)
            ticket = take_ticket(mCnt, slot, tidx)
            if ticket < self.n1:
                self.glu.project(gWgu, gX, mAct, mAct, mAct, Int32(self.I), red, tidx, ticket, pre)
                count_done(mCnt, 2, tidx)
            else:
                q = ticket - self.n1
                lane = tidx % 32
                n = q * self.down.rows + tidx // 32  # this warp's row when K is not split (a hint only)
                if n < self.H:
                    for it in cutlass.range_constexpr(self.down.iters):
                        kk = it * 32 + lane
                        if kk * VEC < self.I:
                            prefetch_l2(gWd[(None, (n, kk))])
                wait_count(mCnt, 2, self.n1, tidx)
                self.down.project(gWd, gAct, mOut, mOut, mOut, Int32(self.H), red, tidx, q, pre)
                if last_cta(mCnt, flag, tidx, self.n2, 1) != 0:
                    if tidx == 0:
                        mCnt[0] = Int32(0)
                        mCnt[2] = Int32(0)


COUNTERS = 3  # ticket, finished down-projection CTAs, finished gate/up CTAs


def _check(gate_up, x, act, down, out, counters) -> None:
    H = x.shape[1]
    inter = gate_up.shape[0] // 2
    bf = torch.bfloat16
    if x.shape[0] != 1 or gate_up.shape != (2 * inter, H) or down.shape != (H, inter):
        raise ValueError(f"shared_mlp: one row and weights [2I, H] / [H, I], got x {tuple(x.shape)}, gate/up "
                         f"{tuple(gate_up.shape)}, down {tuple(down.shape)}")
    if act.shape != (1, inter) or out.shape != (1, H):
        raise ValueError(f"shared_mlp: act must be [1, {inter}] and out [1, {H}]")
    if any(t.dtype != bf or not t.is_contiguous() for t in (gate_up, x, act, down, out)) or H % VEC or inter % VEC:
        raise ValueError("shared_mlp: contiguous bf16 tensors with widths a multiple of 8")
    if counters.dtype != torch.int32 or counters.shape != (COUNTERS,) or not counters.is_contiguous():
        raise ValueError(f"shared_mlp: counters must be int32 [{COUNTERS}]")
    if gate_up.numel() >= 2**31 or down.numel() >= 2**31:
        raise ValueError("shared_mlp: weights too large for 32-bit offsets")


def compile_shared_mlp(gate_up, x, act, down, out, counters):
    _check(gate_up, x, act, down, out, counters)
    args = (gate_up, x, act, down, out, counters)
    op = SharedMLP(x.shape[1], down.shape[1])
    return compile_kernel(("shared_mlp", *signature(*args)), op,
                          *(fake_like(t, align=4 if t is counters else 16) for t in args))


def shared_mlp(gate_up: torch.Tensor, x: torch.Tensor, act: torch.Tensor, down: torch.Tensor, out: torch.Tensor,
               counters: torch.Tensor) -> torch.Tensor:
    """out = down @ SiTU-GLU(x @ gate.T, x @ up.T) for one row x [1, H] (gate_up is [gate; up], [2I, H]); `act`
    [1, I] receives the activation. `counters`: int32 [3] at 0 (left at 0) that no other kernel uses meanwhile."""
    fn = compile_shared_mlp(gate_up, x, act, down, out, counters)
    launch(fn, gate_up, x, act, down, out, counters, align=lambda t: 4 if t is counters else 16)
    return out
