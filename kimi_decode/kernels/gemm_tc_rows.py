"""Projection for 2 to 16 rows on tensor cores, the K of each 16 weight rows split over one CTA's warps:
y[m, n] = sum_k x[m, k] * W[n, k], bf16 in, fp32 accumulate.

The arithmetic is `gemm_tc.py`'s (`mma.sync m16n8k16`, 16 weight rows as A, 8 tokens per B tile; lane (g, t) loads
weights 8t..8t+7 of rows g and g + 8 of a 32-wide K chunk and the same 8 activations of token g, the mma k-slots
assigned so that they pair up). The work split is the small-batch GEMV's (`gemv.py`) instead of a split-K GEMM's: a
CTA owns one tile of 16 weight rows over the whole K, its warps each stream one K slice of them, and their partial
sums meet in shared memory. So there is no workspace, no completion counter and no last CTA reading the other CTAs'
partial sums at the end of the kernel, and the grid has N / 16 CTAs of up to 8 warps (`rows_plan_for`). A warp keeps
`pipe` K chunks of loads in flight (two 16-byte weight loads and one activation load per column tile and lane each),
refilling a chunk's registers as soon as its mma has read them. The epilogues are the GEMV's: store y (bf16 or
fp32), or add into an fp32 y with an optional bf16 addend, optionally scaling row m by an RMSNorm's 1/rms from partial
sums of squares; y and the addend are read, and the sums of squares loaded, before the weight loop, so that nothing
waits on them after it.
"""
from __future__ import annotations

import functools

import torch

from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, env_int, fake_like, launch, signature
from .gemm_tc import CHUNK, check_projection

MIN_ROWS, MAX_ROWS = 2, 16
ROWS = 16  # weight rows per CTA (the mma's M)
MAX_WARPS = 16  # warps per CTA splitting K
DEFAULT_WARPS = 8  # the most a plan takes by default (benchmarks/NOTES.md, item 47)
MAX_PIPE_LOADS = 24  # 16-byte loads in flight per lane (4 registers each)
MAX_PIPE = 7  # chunks in flight per warp (the most measured)
GRID_WARPS = 1500  # warps the grid should have streaming (~11 per SM of the H200's 132)

if HAVE_CUTE:
    from cutlass import Float32, Int32

    from .cute_common import mma_lanes
    from .gemm_tc import fetch_chunk, mma_chunk
    from .gemv import preload_output, store_preloaded

    class RowTileProjection:
        def __init__(self, plan: "RowsPlan", accumulate: bool, addend: bool, scaled: bool, parts: int, eps: float):
            self.p = plan
            self.accumulate, self.addend, self.scaled, self.parts, self.eps = accumulate, addend, scaled, parts, eps

        @cute.jit
        def __call__(self, mW: cute.Tensor, mX: cute.Tensor, mY: cute.Tensor, mAdd: cute.Tensor, mSsq: cute.Tensor,
                     stream):
            gW = cute.zipped_divide(mW, (1, 4))  # 16-byte vectors of int32 pairs of bf16: ((1,4), (N, K/8))
            gX = cute.zipped_divide(mX, (1, 4))
            self.kernel(gW, gX, mY, mAdd, mSsq, Int32(self.p.per_warp)).launch(
                grid=[self.p.ctas, 1, 1], block=[32 * self.p.warps, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, gW: cute.Tensor, gX: cute.Tensor, mY: cute.Tensor, mAdd: cute.Tensor, mSsq: cute.Tensor,
                   per: Int32):
            """`per`: the chunks of a warp, `per_warp`, as a kernel parameter: a constant would let the compiler
            unroll the pipeline's loop and drop its conditions, and then ptxas moves every load down to its mma."""
            p = self.p
            tidx, _, _ = cute.arch.thread_idx()
            bx, _, _ = cute.arch.block_idx()
            warp, lane, g, t = mma_lanes(tidx)
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((ROWS, p.cols, p.warps)), 16)  # rows fastest
            rs = smem.allocate_tensor(Float32, cute.make_layout(p.cols), 16)
            n0 = bx * ROWS
            # before the weights: this thread's outputs' y and addend, and its warp's rows' sums of squares
            outs = self.outputs(tidx)
            pre = cute.make_rmem_tensor((2 * len(outs),), Float32)
            if cutlass.const_expr(self.accumulate):
                for i in cutlass.range_constexpr(len(outs)):
                    m, r = outs[i]
                    if m < p.M:
                        preload_output(mY, mAdd, m, n0 + r, pre, i, self.addend)
            per_warp_rows = -(-p.M // p.warps)  # the tokens whose sums of squares a warp adds: warp, warp + warps, ...
            squares = cute.make_rmem_tensor((per_warp_rows,), Float32)
            squares.fill(0.0)
            if cutlass.const_expr(self.scaled):
                for j in cutlass.range_constexpr(per_warp_rows):
                    if warp + j * p.warps < p.M:
                        for i in cutlass.range_constexpr(-(-self.parts // 32)):
                            if lane + 32 * i < self.parts:
                                squares[j] = squares[j] + mSsq[warp + j * p.warps, lane + 32 * i]
            toks = []
            for nt in cutlass.range_constexpr(p.tiles):
                tok = nt * 8 + g
                if tok >= p.M:  # a column past M: any token, the column is not stored
                    tok = Int32(p.M - 1)
                toks.append(tok)
            rows = (n0 + g, n0 + g + 8)
            acc = cute.make_rmem_tensor((4 * p.tiles,), Float32)
            acc.fill(0.0)
            c0 = warp * p.per_warp
            # `pipe` K chunks of loads in flight per lane, in register slots used round-robin: the loop steps `pipe`
            # chunks at a time, so every slot index is a constant, and each refill sits behind a condition on `per`
            wb = [[cute.make_rmem_tensor((4,), Int32) for q in range(2)] for d in range(p.pipe)]
            xb = [[cute.make_rmem_tensor((4,), Int32) for nt in range(p.tiles)] for d in range(p.pipe)]
            for d in cutlass.range_constexpr(p.pipe):
                fetch_chunk(gW, gX, rows, toks, (c0 + d) * 4 + t, wb[d], xb[d])
            for c in cutlass.range(0, per, p.pipe):
                for d in cutlass.range_constexpr(p.pipe):
                    self.multiply(acc, wb[d], xb[d])
                    if c + d + p.pipe < per:
                        fetch_chunk(gW, gX, rows, toks, (c0 + c + d + p.pipe) * 4 + t, wb[d], xb[d])
            # this lane's accumulators: rows g and g + 8, tokens 2t and 2t + 1 of each column tile
            for nt in cutlass.range_constexpr(p.tiles):
                for h in cutlass.range_constexpr(2):
                    red[g, nt * 8 + 2 * t + h, warp] = acc[4 * nt + h]
                    red[g + 8, nt * 8 + 2 * t + h, warp] = acc[4 * nt + 2 + h]
            if cutlass.const_expr(self.scaled):
                for j in cutlass.range_constexpr(per_warp_rows):
                    m = warp + j * p.warps
                    if m < p.M:
                        ssq = cute.arch.warp_reduction(squares[j], lambda a, b: a + b)
                        if lane == 0:
                            rs[m] = cute.math.rsqrt(ssq / Float32(p.K) + Float32(self.eps))
            cute.arch.barrier()
            for i in cutlass.range_constexpr(len(outs)):
                m, r = outs[i]
                if m < p.M:
                    val = Float32(0.0)
                    for w in cutlass.range_constexpr(p.warps):  # the warps' K slices in a fixed order
                        val = val + red[r, m, w]
                    if cutlass.const_expr(self.scaled):
                        val = val * rs[m]
                    store_preloaded(mY, mAdd, m, n0 + r, val, pre, i, self.accumulate, self.addend)

        def outputs(self, tidx):
            """The (token, row of the tile) outputs thread `tidx` stores: one per CTA-wide step, consecutive threads
            on consecutive rows of one token (m >= M for a thread with none at that step)."""
            p = self.p
            steps = -(-ROWS * p.cols // (32 * p.warps))
            return [((s * 32 * p.warps + tidx) // ROWS, (s * 32 * p.warps + tidx) % ROWS) for s in range(steps)]

        def multiply(self, acc, wv, xv):
            """One K chunk: for each column tile two mma (`gemm_tc.mma_chunk`) on the tile's rows g and g + 8."""
            for nt in range(self.p.tiles):
                mma_chunk(acc, 4 * nt, wv[0], wv[1], xv[nt])


class RowsPlan:
    """Tiling of one projection shape: N / 16 CTAs of `warps` warps, each warp `per_warp` K chunks with `pipe` of
    them in flight."""

    def __init__(self, M: int, N: int, K: int, warps: int, pipe: int):
        self.M, self.N, self.K = M, N, K
        self.tiles = -(-M // 8)  # mma column tiles of 8 tokens
        self.cols = 8 * self.tiles
        self.chunks = K // CHUNK
        if self.chunks % warps:
            raise ValueError(f"{warps} warps do not split {self.chunks} K chunks evenly")
        self.warps = warps
        self.per_warp = self.chunks // warps
        if self.per_warp % pipe:
            raise ValueError(f"{pipe} chunks in flight do not divide a warp's {self.per_warp}")
        self.pipe = pipe
        self.ctas = N // ROWS

    def key(self) -> tuple:
        return (self.M, self.N, self.K, self.warps, self.pipe)


def _divisors(n: int, most: int) -> list[int]:
    return [d for d in range(min(n, most), 0, -1) if n % d == 0]


def rows_plan_for(M: int, N: int, K: int, most_warps: int | None = None) -> RowsPlan:
    """The fewest warps per CTA (4, 8 or 16, up to `max_warps()`, splitting K's chunks evenly) that give the grid
    GRID_WARPS warps, else the most (down to 1 for short K); then the most chunks in flight (up to MAX_PIPE, within
    MAX_PIPE_LOADS loads per lane) that divide a warp's chunks, at least two where the warps' chunks allow. On the
    H200 at 8 rows, each projection alone (benchmarks/NOTES.md, item 47), the rule with 16 warps at most picks the
    fastest tiling measured, or one within 0.6 us of it, on every projection of the TP16 and TP8 shards: few CTAs
    (the router's 56) want the most warps each, many (the MoE tail's 448) 4 to 8 with the most chunks in flight.
    `most_warps` replaces `max_warps()` for one projection."""
    return _rows_plan(M, N, K, most_warps or max_warps())


def max_warps() -> int:
    """KIMI_DECODE_TC_ROWS_WARPS: the most warps per CTA a plan may take (1..16, default DEFAULT_WARPS). 16 was the
    faster tiling of the router and the shared gate/up alone, but in the layer their CTAs of 16 warps took whole SMs
    beside the latent down-projection on the MoE entry's side streams and held it back (TP8 batch 8 +6 us); at 8
    the layer is 0-2 us slower at TP16 and 6 us faster at TP8 batch 8."""
    return env_int("KIMI_DECODE_TC_ROWS_WARPS", DEFAULT_WARPS, 1, MAX_WARPS, "warps per CTA")


@functools.lru_cache(maxsize=None)
def _rows_plan(M: int, N: int, K: int, most_warps: int) -> RowsPlan:
    chunks = K // CHUNK
    # per chunk and lane: two weight rows, a load per column tile
    most = max(1, min(MAX_PIPE, MAX_PIPE_LOADS // (2 + -(-M // 8))))
    counts = [w for w in (1, 2, 4, 8, 16) if w <= most_warps and chunks % w == 0]
    fit = [w for w in counts if w >= 4 and N // ROWS * w >= GRID_WARPS]
    ordered = fit + [w for w in reversed(counts) if w not in fit]
    plans = [RowsPlan(M, N, K, w, _divisors(chunks // w, most)[0]) for w in ordered]
    return next((p for p in plans if p.pipe >= 2), plans[0])


def compile_rows_projection(w, x, y, accumulate: bool = False, addend=None, row_scale=None,
                            plan: RowsPlan | None = None):
    plan = plan or rows_plan_for(x.shape[0], w.shape[0], w.shape[1])
    extra = addend if addend is not None else y
    ssq = row_scale[0] if row_scale is not None else y
    eps = float(row_scale[1]) if row_scale is not None else 0.0
    args = (w.view(torch.int32), x.view(torch.int32), y, extra, ssq)
    key = ("gemm_tc_rows", plan.key(), accumulate, addend is not None, row_scale is not None, eps, *signature(*args))
    op = RowTileProjection(plan, accumulate, addend is not None, row_scale is not None,
                           ssq.shape[1] if row_scale is not None else 0, eps)
    return compile_kernel(key, op, *(fake_like(t) for t in args)), args


def project_rows(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, accumulate: bool = False,
                 addend: torch.Tensor | None = None, row_scale: tuple | None = None, plan: RowsPlan | None = None
                 ) -> torch.Tensor:
    """y = x @ w.T, or y += x @ w.T (+ addend) with `accumulate`, on the current stream; the arguments are those of
    `gemv.gemv` (`plan`: another tiling than `rows_plan_for`'s, for benchmarks)."""
    check_projection(w, x, y, accumulate, addend, row_scale, "row-tile tensor-core projection", (MIN_ROWS, MAX_ROWS),
                     ROWS)
    plan = plan or rows_plan_for(x.shape[0], w.shape[0], w.shape[1])
    if plan.key()[:3] != (x.shape[0], w.shape[0], w.shape[1]):
        raise ValueError(f"plan {plan.key()} is not for this shape")
    fn, args = compile_rows_projection(w, x, y, accumulate, addend, row_scale, plan)
    launch(fn, *args)
    return y
