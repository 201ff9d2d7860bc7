"""The MoE block's entry at batch 1 in one kernel: the latent down-projection and the whole router over one grid.

Both read only the AttnRes output x, and at batch 1 both are weight streams: the router GEMV (896 x 7168, with the
top-k in its last CTA, `router_topk.RouterTopK`) and the latent down-projection (3584 x 7168, the small-batch GEMV
`gemv.SmallBatchGemv`). Until now they ran as two kernels on two streams, side by side; here the first CTAs of one
grid are the router's (one row each, split-K over the 4 warps) and the rest the down-projection's (4 rows each).
CTAs start in about that order, so the router's rows are streamed first and its last CTA routes while the
down-projection's CTAs still stream: the experts, which need both, can start when the kernel ends, as they did when
the later of the two kernels ended. One kernel and one fork of the CUDA graph fewer. Optionally the shared experts'
gate/up GEMV (SiTU-GLU epilogue) as a third part, whose act the w2 expert kernel's shared-expert CTAs then read.

Optionally (`prefetch`, `KIMI_DECODE_ENTRY_PREFETCH` in the backend) the down-projection's CTAs also ask L2 for the
selected experts' w13 rows, so that the w13 expert kernel after this one finds them there instead of reading the ids
and then HBM. The router's last CTA releases a flag once the ids are written; each down-projection CTA, once its own
rows are done (near the kernel's end, when the router has long finished and the stream is ramping down), reads the
flag without waiting and, if it is set, sends bulk prefetches (`cp.async.bulk.prefetch.L2`, 4 KB each) for its share
of the experts' used w1 and w3 rows. A CTA that finds the flag unset skips its share: the prefetch is only a hint, and
results never depend on it. The router's last CTA and the down-projection CTAs count themselves on a second counter;
the last of them clears both, so the kernel replays in a CUDA graph as it is.
"""
from __future__ import annotations

import torch

from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, fake_like, launch, signature
from .gemv import VEC, WARPS, preload_setting
from .prefetch import CHUNK
from .router_topk import THREADS, topk_form, _check as _check_router

if HAVE_CUTE:
    from cutlass import Float32, Int32

    from .cute_common import atomic_add_u32, bulk_prefetch_l2, last_cta, load_acquire
    from .gemv import SmallBatchGemv
    from .router_topk import RouterTopK

    class MoEEntry:
        """`shared_inter` > 0: the shared experts' gate/up GEMV with its SiTU-GLU epilogue as a third part of the
        grid, after the other two (it also reads only x, and its result is needed two kernels later)."""

        def __init__(self, M: int, E: int, K: int, topk: int, scaling: float, latent: int, shared_inter: int = 0,
                     preload: int = 0, prefetch: tuple[int, int, int] | None = None):
            """`prefetch` = (chunks of one half's used rows, chunks from an expert's w1 rows to its w3 rows, chunks
            per expert) of the w13 codes viewed as CHUNK-byte rows (`prefetch_layout`), or None."""
            self.prefetch = prefetch
            self.router = RouterTopK(M, E, K, topk, scaling, preload)
            self.down = SmallBatchGemv(M, latent, K, accumulate=False, addend=False, preload=preload)
            self.glu = SmallBatchGemv(M, max(shared_inter, 1), K, accumulate=False, addend=False, glu=True,
                                      preload=preload)
            self.M, self.E, self.L, self.S = M, E, latent, shared_inter
            self.n_router = -(-E // self.router.rows)  # the grid's first CTAs
            self.n_down = -(-latent // self.down.rows)
            self.n_glu = -(-shared_inter // self.glu.rows)
            if prefetch is not None:
                self.pf_chunks = M * topk * 2 * prefetch[0]  # (row, expert slot, w1 / w3, chunk)
                self.pf_per_cta = -(-self.pf_chunks // self.n_down)
                if self.pf_per_cta > THREADS:
                    raise ValueError(f"moe_entry: {self.pf_chunks} prefetch chunks over {self.n_down} CTAs of "
                                     f"{THREADS} threads")

        @cute.jit
        def __call__(self, mWr: cute.Tensor, mX: cute.Tensor, mL: cute.Tensor, mBias: cute.Tensor,
                     mIds: cute.Tensor, mWts: cute.Tensor, mCnt: cute.Tensor, mWd: cute.Tensor, mLat: cute.Tensor,
                     mWgu: cute.Tensor, mAct: cute.Tensor, mW13: cute.Tensor, mPf: cute.Tensor, stream):
            self.router.pdl = self.down.pdl = self.glu.pdl = self.pdl
            gWr = cute.zipped_divide(mWr, (1, VEC))
            gWd = cute.zipped_divide(mWd, (1, VEC))
            gX = cute.zipped_divide(mX, (1, VEC))
            gWgu = cute.zipped_divide(mWgu, (1, VEC))
            self.kernel(gWr, gX, mL, mBias, mIds, mWts, mCnt, gWd, mLat, gWgu, mAct, mW13, mPf).launch(
                grid=[self.n_router + self.n_down + self.n_glu, 1, 1], block=[THREADS, 1, 1], stream=stream,
                use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, gWr: cute.Tensor, gX: cute.Tensor, mL: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor,
                   mWts: cute.Tensor, mCnt: cute.Tensor, gWd: cute.Tensor, mLat: cute.Tensor, gWgu: cute.Tensor,
                   mAct: cute.Tensor, mW13: cute.Tensor, mPf: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 2 * self.M)), 16)
            cand_v, cand_i, chosen = self.router.allocate_routing(smem)
            flag = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
            # one preload buffer for the three parts: the most slices any takes, room for the gate/up row pairs
            pre = self.glu.allocate_preload(smem, max(p.preloaded() for p in (self.router, self.down, self.glu)))
            if bidx < self.n_router:
                self.router.project(gWr, gX, mL, mL, mL, Int32(self.E), red, tidx, bidx, pre)
                if last_cta(mCnt, flag, tidx, self.n_router) != 0:
                    for m in cutlass.range(self.M):
                        self.router.route(mL, mBias, mIds, mWts, cand_v, cand_i, chosen, m, tidx)
                    if cutlass.const_expr(self.prefetch is not None):
                        if tidx == 0:  # the ids (written before `route`'s last barrier) are released with the flag
                            cute.arch.fence_acq_rel_gpu()
                            atomic_add_u32(mPf, 1, 0)
                        self.prefetch_done(mPf, flag, tidx)
            else:
                if cutlass.const_expr(self.n_glu == 0):
                    self.down_rows(gWd, gX, mLat, mIds, mW13, mPf, red, flag, tidx, bidx - self.n_router, pre)
                else:
                    if bidx < self.n_router + self.n_down:
                        self.down_rows(gWd, gX, mLat, mIds, mW13, mPf, red, flag, tidx, bidx - self.n_router, pre)
                    else:
                        self.glu.project(gWgu, gX, mAct, mAct, mAct, Int32(self.S), red, tidx,
                                         bidx - self.n_router - self.n_down, pre)

        @cute.jit
        def down_rows(self, gWd: cute.Tensor, gX: cute.Tensor, mLat: cute.Tensor, mIds: cute.Tensor,
                      mW13: cute.Tensor, mPf: cute.Tensor, red: cute.Tensor, flag: cute.Tensor, tidx, j, pre):
            """Down-projection CTA j: its rows of the latent, then (with `prefetch`) its share of the experts' rows."""
            self.down.project(gWd, gX, mLat, mLat, mLat, Int32(self.L), red, tidx, j, pre)
            if cutlass.const_expr(self.prefetch is not None):
                self.prefetch_experts(mIds, mW13, mPf, flag, tidx, j)

        @cute.jit
        def prefetch_experts(self, mIds: cute.Tensor, mW13: cute.Tensor, mPf: cute.Tensor, flag: cute.Tensor, tidx,
                             j):
            """Down-projection CTA j, its rows done: if the router has released the ids (mPf[0]), thread i asks L2
            for chunk j + i * n_down of the selected experts' used w13 rows (CHUNK-byte rows of `mW13`); then the
            CTA counts itself (`prefetch_done`)."""
            used, gap, per_expert = self.prefetch
            if tidx < self.pf_per_cta:
                c = j + tidx * self.n_down  # chunk c % used of half c // used % 2 of pair c // (2 used)
                if c < self.pf_chunks:
                    if load_acquire(mPf, 0) != 0:
                        p = c // (2 * used)  # the (row, expert slot) pair
                        e = mIds[p // self.router.topk, p % self.router.topk]
                        bulk_prefetch_l2(mW13[e * per_expert + c // used % 2 * gap + c % used, None], CHUNK)
            self.prefetch_done(mPf, flag, tidx)

        @cute.jit
        def prefetch_done(self, mPf: cute.Tensor, flag: cute.Tensor, tidx):
            """The router's last CTA and every down-projection CTA count themselves on mPf[1]; the last of them sets
            both counters back to 0 (after it no CTA reads the flag: the down-projection CTAs read it before they
            count)."""
            if last_cta(mPf, flag, tidx, self.n_down + 1, 1) != 0:
                if tidx == 0:
                    mPf[0] = Int32(0)


def prefetch_layout(w13: torch.Tensor, used: int) -> tuple[int, int, int] | None:
    """(chunks of one half's used rows, chunks from an expert's w1 rows to its w3 rows, chunks per expert) of expert
    codes w13 [E, 2I, L/2] (uint8) as CHUNK-byte rows, or None where they do not come in whole chunks (each half's
    rows, and the used rows of each, must; K3's w13 does at TP16 and TP8)."""
    E, rows, row_bytes = w13.shape
    half_bytes, used_bytes = rows // 2 * row_bytes, used * row_bytes
    if half_bytes % CHUNK or used_bytes % CHUNK:
        return None
    return used_bytes // CHUNK, half_bytes // CHUNK, 2 * half_bytes // CHUNK


def _check(w_router, x, logits, bias, ids, weights, counter, w_down, latent, glu=None, prefetch=None) -> None:
    _check_router(w_router, x, logits, bias, ids, weights, counter)
    M, K = x.shape
    if prefetch is not None:
        w13, flags, used = prefetch
        if (w13.dtype != torch.uint8 or w13.dim() != 3 or not w13.is_contiguous() or w13.data_ptr() % 16
                or not 0 < used <= w13.shape[1] // 2 or prefetch_layout(w13, used) is None or w13.numel() >= 2**31):
            raise ValueError(f"moe_entry: the prefetch needs contiguous, 16-byte aligned uint8 expert codes [E, 2I, "
                             f"L/2] under 2 GiB whose halves and used rows are whole {CHUNK}-byte chunks")
        if flags.dtype != torch.int32 or tuple(flags.shape) != (2,) or not flags.is_contiguous():
            raise ValueError("moe_entry: the prefetch's flags must be a contiguous int32 tensor of shape (2,)")
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


def _args(w_router, x, logits, bias, ids, weights, counter, w_down, latent, glu, prefetch) -> tuple:
    """The kernel's tensors; without `glu`, the down-projection's stand in for the gate/up ones, and without
    `prefetch` the counter for its flags and a view of the down-projection for the codes (never read)."""
    gate_up, act = glu if glu is not None else (w_down, latent)
    if prefetch is not None:
        w13, flags = prefetch[0].view(-1, CHUNK), prefetch[1]
    else:
        w13, flags = w_down.view(torch.uint8).view(-1)[:CHUNK].view(1, CHUNK), counter
    return (w_router, x, logits, bias, ids, weights, counter, w_down, latent, gate_up, act, w13, flags)


def _align(args: tuple):
    """The alignment each tensor of `_args` is compiled and launched with: 4 bytes for the counters, else 16."""
    counters = (args[6], args[12])
    return lambda t: 4 if any(t is c for c in counters) else 16


def compile_moe_entry(w_router, x, logits, bias, ids, weights, counter, w_down, latent, scaling: float, glu=None,
                      prefetch=None):
    _check(w_router, x, logits, bias, ids, weights, counter, w_down, latent, glu, prefetch)
    args = _args(w_router, x, logits, bias, ids, weights, counter, w_down, latent, glu, prefetch)
    S = glu[1].shape[1] if glu is not None else 0
    preload = preload_setting()
    layout = prefetch_layout(prefetch[0], prefetch[2]) if prefetch is not None else None
    key = ("moe_entry", float(scaling), S, preload, layout, topk_form(), *signature(*args))
    op = MoEEntry(x.shape[0], w_router.shape[0], x.shape[1], ids.shape[1], scaling, w_down.shape[0], S, preload,
                  layout)
    align = _align(args)
    return compile_kernel(key, op, *(fake_like(t, align=align(t)) for t in args))


def moe_entry(w_router: torch.Tensor, x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor, counter: torch.Tensor, w_down: torch.Tensor, latent: torch.Tensor, *,
              scaling: float, glu: tuple | None = None, prefetch: tuple | None = None) -> torch.Tensor:
    """`router_topk` (ids, weights and logits of x's rows, `counter` one int32 at 0 that no other kernel uses at the
    same time) and latent = x @ w_down.T (bf16), in one kernel on the current stream; returns latent. `glu=(gate_up,
    act)`: also act = SiTU-GLU(x @ gate.T, x @ up.T) (the shared experts' first half; bf16 act [M, S]).
    `prefetch=(w13, flags, used)`: also ask L2 for the used rows of the selected experts' w1 and w3 codes (w13 uint8
    [E, 2I, L/2], contiguous; `flags` two int32 at 0 that no other kernel uses at the same time, left at 0)."""
    args = _args(w_router, x, logits, bias, ids, weights, counter, w_down, latent, glu, prefetch)
    fn = compile_moe_entry(w_router, x, logits, bias, ids, weights, counter, w_down, latent, scaling, glu, prefetch)
    launch(fn, *args, align=_align(args))
    return latent
