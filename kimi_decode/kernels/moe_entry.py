"""The MoE block's entry at batch 1 in one kernel: the latent down-projection and the whole router over one grid.

Both read only the AttnRes output x, and at batch 1 both are weight streams: the router GEMV (896 x 7168, with the
top-k in its last CTA, `router_topk.RouterTopK`) and the latent down-projection (3584 x 7168, the small-batch GEMV
`gemv.SmallBatchGemv`). Until now they ran as two kernels on two streams, side by side; here the first CTAs of one
grid are the router's (one row each, split-K over the 4 warps) and the rest the down-projection's (4 rows each).
CTAs start in about that order, so the router's rows are streamed first and its last CTA routes while the
down-projection's CTAs still stream: the experts, which need both, can start when the kernel ends, as they did when
the later of the two kernels ended. One kernel and one fork of the CUDA graph fewer. Optionally the shared experts'
gate/up GEMV (SiTU-GLU epilogue) as a third part, whose act the w2 expert kernel's shared-expert CTAs then read.
"""
from __future__ import annotations

import torch

from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, fake_like, launch, signature
from .gemv import VEC, WARPS, preload_setting
from .router_topk import THREADS, _check as _check_router

if HAVE_CUTE:
    from cutlass import Float32, Int32

    from .cute_common import last_cta
    from .gemv import SmallBatchGemv
    from .router_topk import RouterTopK

    class MoEEntry:
        """`shared_inter` > 0: the shared experts' gate/up GEMV with its SiTU-GLU epilogue as a third part of the
        grid, after the other two (it also reads only x, and its result is needed two kernels later)."""

        def __init__(self, M: int, E: int, K: int, topk: int, scaling: float, latent: int, shared_inter: int = 0,
                     preload: int = 0):
            self.router = RouterTopK(M, E, K, topk, scaling, preload)
            self.down = SmallBatchGemv(M, latent, K, accumulate=False, addend=False, preload=preload)
            self.glu = SmallBatchGemv(M, max(shared_inter, 1), K, accumulate=False, addend=False, glu=True,
                                      preload=preload)
            self.M, self.E, self.L, self.S = M, E, latent, shared_inter
            self.n_router = -(-E // self.router.rows)  # the grid's first CTAs
            self.n_down = -(-latent // self.down.rows)
            self.n_glu = -(-shared_inter // self.glu.rows)

        @cute.jit
        def __call__(self, mWr: cute.Tensor, mX: cute.Tensor, mL: cute.Tensor, mBias: cute.Tensor,
                     mIds: cute.Tensor, mWts: cute.Tensor, mCnt: cute.Tensor, mWd: cute.Tensor, mLat: cute.Tensor,
                     mWgu: cute.Tensor, mAct: cute.Tensor, stream):
            self.router.pdl = self.down.pdl = self.glu.pdl = self.pdl
            gWr = cute.zipped_divide(mWr, (1, VEC))
            gWd = cute.zipped_divide(mWd, (1, VEC))
            gX = cute.zipped_divide(mX, (1, VEC))
            gWgu = cute.zipped_divide(mWgu, (1, VEC))
            self.kernel(gWr, gX, mL, mBias, mIds, mWts, mCnt, gWd, mLat, gWgu, mAct).launch(
                grid=[self.n_router + self.n_down + self.n_glu, 1, 1], block=[THREADS, 1, 1], stream=stream,
                use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, gWr: cute.Tensor, gX: cute.Tensor, mL: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor,
                   mWts: cute.Tensor, mCnt: cute.Tensor, gWd: cute.Tensor, mLat: cute.Tensor, gWgu: cute.Tensor,
                   mAct: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 2 * self.M)), 16)
            cand_v = smem.allocate_tensor(Float32, cute.make_layout(self.router.cands), 16)
            cand_i = smem.allocate_tensor(Int32, cute.make_layout(self.router.cands), 16)
            chosen = smem.allocate_tensor(Int32, cute.make_layout(self.router.topk), 16)
            flag = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
            # one preload buffer for the three parts: the most slices any takes, room for the gate/up row pairs
            pre = self.glu.allocate_preload(smem, max(p.preloaded() for p in (self.router, self.down, self.glu)))
            if bidx < self.n_router:
                self.router.project(gWr, gX, mL, mL, mL, Int32(self.E), red, tidx, bidx, pre)
                if last_cta(mCnt, flag, tidx, self.n_router) != 0:
                    for m in cutlass.range(self.M):
                        self.router.route(mL, mBias, mIds, mWts, cand_v, cand_i, chosen, m, tidx)
            else:
                if cutlass.const_expr(self.n_glu == 0):
                    self.down.project(gWd, gX, mLat, mLat, mLat, Int32(self.L), red, tidx, bidx - self.n_router, pre)
                else:
                    if bidx < self.n_router + self.n_down:
                        self.down.project(gWd, gX, mLat, mLat, mLat, Int32(self.L), red, tidx, bidx - self.n_router,
                                          pre)
                    else:
                        self.glu.project(gWgu, gX, mAct, mAct, mAct, Int32(self.S), red, tidx,
                                         bidx - self.n_router - self.n_down, pre)


def _check(w_router, x, logits, bias, ids, weights, counter, w_down, latent, glu=None) -> None:
    _check_router(w_router, x, logits, bias, ids, weights, counter)
    M, K = x.shape
    if glu is not None:
        gate_up, act = glu
        S = gate_up.shape[0] // 2
        if (gate_up.dtype != torch.bfloat16 or gate_up.shape != (2 * S, K) or not gate_up.is_contiguous()
                or act.dtype != torch.bfloat16 or act.shape != (M, S) or not act.is_contiguous()):
            raise ValueError(f"moe_entry: the shared gate/up needs contiguous bf16 weights [2S, {K}] and act [{M}, S]")
    if (w_down.dtype != torch.bfloat16 or w_down.dim() != 2 or w_down.shape[1] != K or not w_down.is_contiguous()
            or latent.dtype != torch.bfloat16 or latent.shape != (M, w_down.shape[0]) or not latent.is_contiguous()):
        raise ValueError(f"moe_entry: the down-projection needs contiguous bf16 weights [L, {K}] and a contiguous "
                         f"bf16 output [{M}, L]")


def _args(w_router, x, logits, bias, ids, weights, counter, w_down, latent, glu) -> tuple:
    """The kernel's tensors; without `glu`, the down-projection's stand in for the gate/up ones (never read)."""
    gate_up, act = glu if glu is not None else (w_down, latent)
    return (w_router, x, logits, bias, ids, weights, counter, w_down, latent, gate_up, act)


def compile_moe_entry(w_router, x, logits, bias, ids, weights, counter, w_down, latent, scaling: float, glu=None):
    _check(w_router, x, logits, bias, ids, weights, counter, w_down, latent, glu)
    args = _args(w_router, x, logits, bias, ids, weights, counter, w_down, latent, glu)
    S = glu[1].shape[1] if glu is not None else 0
    preload = preload_setting()
    key = ("moe_entry", float(scaling), S, preload, *signature(*args))
    op = MoEEntry(x.shape[0], w_router.shape[0], x.shape[1], ids.shape[1], scaling, w_down.shape[0], S, preload)
    return compile_kernel(key, op, *(fake_like(t, align=4 if t is counter else 16) for t in args))


def moe_entry(w_router: torch.Tensor, x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor, counter: torch.Tensor, w_down: torch.Tensor, latent: torch.Tensor, *,
              scaling: float, glu: tuple | None = None) -> torch.Tensor:
    """`router_topk` (ids, weights and logits of x's rows, `counter` one int32 at 0 that no other kernel uses at the
    same time) and latent = x @ w_down.T (bf16), in one kernel on the current stream; returns latent. `glu=(gate_up,
    act)`: also act = SiTU-GLU(x @ gate.T, x @ up.T) (the shared experts' first half; bf16 act [M, S])."""
    args = _args(w_router, x, logits, bias, ids, weights, counter, w_down, latent, glu)
    fn = compile_moe_entry(w_router, x, logits, bias, ids, weights, counter, w_down, latent, scaling, glu)
    launch(fn, *args, align=lambda t: 4 if t is counter else 16)
    return latent
