"""The batch-1 MoE tail of one layer and the AttnRes step that opens the next layer, in one kernel.

  r    = rsqrt(sum(ssq) / K + eps)          (the routed sum's RMSNorm, ssq its partial sums of squares)
  a    = r * (x @ W.T) + shared             (W the up-projection [H, K], x = bf16(routed sum * norm weight) [1, K])
  partial += a                              (the MoE block's residual update)
  out  = the next layer's AttnRes step      (`attn_res.AttnRes`, no commit, on the updated partial; delta_mode 0)

The unfused form is two kernels: the up-projection GEMV (`gemv.SmallBatchGemv` with `row_scale` and an addend,
accumulating into the partial) and, at the start of the next layer, the AttnRes kernel. Here the AttnRes step runs
as the output projection + AttnRes kernel runs it (`oproj_attn_res`, "split" form): every CTA does the per-element
part for its own output rows (the residual update, stored, and the candidates' score sums, whose CTA totals go to a
[ctas, P] scratch), and the CTA that finishes last adds the totals, takes the softmax and forms the mix and its
RMSNorm with the next layer's input_norm. So the AttnRes kernel's launch, its wait for the GEMV's last CTA and its
own reads of the candidates and the partial go, and the residual update is not stored and loaded back in between.

Layout of the projection: one CTA per SM of the T threads AttnRes uses (448 at H = 7168); each warp takes output rows
warp, warp + all warps, ... one row per pass, each lane loading its K / 256 16-byte weight slices of the row at once
(14 at K = 3584), the next row's after the current one's dot product. x is K wide (the latent, 3584), too wide to keep
in every thread's registers as the output projection keeps its K = 768 / 1536: the CTA copies it once into shared
memory (bf16, `cp.async`), and each pass reads a lane's slices of it again. Those reads do not change from pass to
pass, so ptxas would move them out of the row loop and hold all of x, converted to fp32, in registers across it (232
registers; under 448 threads that collapses into spills): their addresses carry a 0 read with `ld.volatile`
(`cute_common.opaque_zero`), which keeps them in the loop (128 registers with cutlass-dsl 4.8.1). Under PDL the
first row's weights (they do not depend on the kernels before) and the lane's AttnRes candidates (written two or more
kernels back: the blocks, and the partial, last stored by the output projection + AttnRes kernel of this layer) are
loaded before the wait; x, the partial sums of squares and the shared experts' output (all three written by the w2
expert kernel just before) after it.

The fp32 sums: each row's dot product is one warp reduction, times r, plus the shared output, then added to the old
partial, so the updated partial matches the GEMV's (old + r * dot) + shared to fp32 rounding (the order of the
last two additions differs).
"""
from __future__ import annotations

import torch

from .attn_res import MAX_CANDIDATES
from .attn_res import _align as _res_align
from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, env_flag, fake_like, launch, signature, sm_count
from .oproj_attn_res import rows_per_warp

VEC = 8  # bf16 per 16-byte load


def fits(hidden: int, K: int, n_blocks: int, ctas: int | None = None) -> bool:
    """Whether the kernel takes an up-projection [hidden, K] and an AttnRes step over `n_blocks` committed blocks and
    the partial on `ctas` CTAs (None: one per SM of the current GPU): K a whole number of warp slices (256), at most
    32 output rows per warp (one lane each, the "split" form) and at most `attn_res.MAX_CANDIDATES` candidates. Where
    it does not, the backend runs the tail as its own GEMV."""
    return (K % (32 * VEC) == 0 and hidden % VEC == 0 and rows_per_warp(hidden, ctas or sm_count()) <= 32
            and n_blocks + 1 <= MAX_CANDIDATES)


def fused_tail_res() -> bool:
    """KIMI_DECODE_FUSED_TAIL_RES: whether `latency_specialized` at batch 1 runs a layer's MoE tail inside the next
    layer's first AttnRes kernel (this module) where the caller chains the two (`decode_layer(defer_tail=True)`):
    "1", or "0" (the default until measured on the H200: the MoE tail's GEMV, then the AttnRes kernel)."""
    return env_flag("KIMI_DECODE_FUSED_TAIL_RES", "0")


if HAVE_CUTE:
    from cutlass import Float32, Int32

    from .cute_common import (copy_async_16, last_cta, opaque_zero, pdl_launch_dependents, pdl_reads_ahead,
                              pdl_wait)
    from .oproj_attn_res import OProjAttnRes

    class TailAttnRes(OProjAttnRes):
        def __init__(self, hidden: int, K: int, ctas: int, n_blocks: int, parts: int, eps_norm: float, eps: float):
            """`parts`: the partial sums of squares per row the expert kernel left; `eps_norm` the routed sum's
            RMSNorm epsilon, `eps` AttnRes's."""
            super().__init__(hidden, K, ctas, n_blocks, 1, eps, early="1", split=True, rest="loop")
            self.round_delta = False  # a is fp32 here: the GEMV adds it to the partial unrounded
            self.parts, self.eps_norm = parts, float(eps_norm)
            self.slices = K // VEC  # 16-byte slices of x
            if not self.split:  # `compile_tail_attn_res` refuses these shapes first (`fits`)
                raise ValueError("tail_attn_res: one lane per output row of a warp: at most 32 rows per warp")

        @cute.jit
        def __call__(self, mW: cute.Tensor, mX: cute.Tensor, mSsq: cute.Tensor, mAdd: cute.Tensor,
                     blocks: cute.Tensor, partial: cute.Tensor, query: cute.Tensor, key_norm: cute.Tensor,
                     input_norm: cute.Tensor, out: cute.Tensor, mCnt: cute.Tensor, mParts: cute.Tensor, stream):
            gW = cute.zipped_divide(mW, (1, VEC))
            gX = cute.zipped_divide(mX, (1, VEC))
            # the AttnRes tiles; the delta's stand-in (the partial) is not read: "split" never runs the body
            gB, gP, gD, gQ, gK, gN, gO = self.res.tiles(blocks, partial, partial, query, key_norm, input_norm, out)
            self.kernel(gW, gX, mSsq, mAdd, gB, gP, gN, gO, mCnt, blocks, partial, query, key_norm, mParts).launch(
                grid=[self.ctas, 1, 1], block=[self.T, 1, 1], stream=stream, use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, gW: cute.Tensor, gX: cute.Tensor, mSsq: cute.Tensor, mAdd: cute.Tensor, gB: cute.Tensor,
                   gP: cute.Tensor, gN: cute.Tensor, gO: cute.Tensor, mCnt: cute.Tensor, mB: cute.Tensor,
                   mP: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor, mParts: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            lane = tidx % 32
            warp = tidx // 32
            pdl_launch_dependents(self.pdl)
            smem = cutlass.utils.SmemAllocator()
            red, sW, red2 = self.res.allocate(smem)
            flag = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
            # x as the expert kernel wrote it (bf16), one 16-byte slice per lane and warp slice: [8, slice]
            sX = smem.allocate_tensor(gX.element_type, cute.make_layout((VEC, self.slices)), 16)
            zero = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
            if tidx == 0:
                zero[0] = Int32(0)
            stride = self.ctas * self.W
            gw = bidx * self.W + warp
            # the first row's weights, and the lane's candidates, before the wait
            wt = cute.make_rmem_tensor((VEC, self.iters), gW.element_type)
            self.load_row(gW, wt, gw, stride, Int32(0), lane)
            n_mine = gw + stride * lane
            cs = cute.make_rmem_tensor((self.res.NC,), Float32)
            qk = cute.make_rmem_tensor((1,), Float32)
            early = bool(self.pdl and pdl_reads_ahead())  # a trace-time constant
            if cutlass.const_expr(early):
                self.row_candidates(mB, mP, mQ, mK, n_mine, cs, qk)
            pdl_wait(self.pdl)
            if cutlass.const_expr(not early):
                self.row_candidates(mB, mP, mQ, mK, n_mine, cs, qk)
            # what the expert kernel just wrote: x into shared memory, the sums of squares, the lane's shared output
            for c in cutlass.range_constexpr(-(-self.slices // self.T)):
                sl = tidx + self.T * c
                if sl < self.slices:
                    copy_async_16(gX[(None, (0, sl))], sX[(None, sl)])
            cute.arch.cp_async_commit_group()
            qs = cute.make_rmem_tensor((-(-self.parts // 32),), Float32)
            qs.fill(0.0)
            for i in cutlass.range_constexpr(-(-self.parts // 32)):
                if lane + 32 * i < self.parts:
                    qs[i] = mSsq[0, lane + 32 * i]
            add = Float32(0.0)
            if lane < self.per_warp:
                if n_mine < self.H:
                    add = mAdd[0, n_mine].to(Float32)
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()  # x staged
            mine = Float32(0.0)  # the lane's row's dot product
            for j in cutlass.range(self.per_warp, unroll=1):
                # x's shared-memory reads stay inside the loop (hoisted, they would hold K / 32 registers of x
                # across the passes beside the weights: more than 448 threads have)
                z = opaque_zero(zero)
                acc = self.row_dot(wt, sX, lane + z)
                if j + 1 < self.per_warp:  # the next row's weights into the registers just read
                    self.load_row(gW, wt, gw, stride, j + 1, lane)
                tot = cute.arch.warp_reduction(acc, lambda a, b: a + b)
                if lane == j:
                    mine = tot
            q = Float32(0.0)
            for i in cutlass.range_constexpr(-(-self.parts // 32)):
                q = q + qs[i]
            q = cute.arch.warp_reduction(q, lambda a, b: a + b)
            rstd = cute.math.rsqrt(q / Float32(self.K) + Float32(self.eps_norm))
            mine = mine * rstd + add
            self.publish(mine, cs, qk, n_mine, tidx, lane, warp, bidx, mP, mParts, red)
            if last_cta(mCnt, flag, tidx, self.ctas) != 0:
                self.finish(gB, gP, gN, gO, mParts, tidx, lane, warp, red, sW, red2)

        @cute.jit
        def row_dot(self, wt: cute.Tensor, sX: cute.Tensor, lane: Int32):
            """The lane's part of a row's dot product with x: its 16-byte slices of the row (in wt) with x's (`lane`:
            the lane's index, plus an opaque 0)."""
            acc = Float32(0.0)
            for it in cutlass.range_constexpr(self.iters):  # K is a whole number of warp slices (`_check`)
                w = wt[None, it].load().to(Float32)
                xv = sX[(None, it * 32 + lane)].load().to(Float32)
                acc = acc + (w * xv).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            return acc

        def load_row(self, gW: cute.Tensor, wt: cute.Tensor, gw, stride, j, lane):
            """Row gw + stride * j of W (clamped to the last row), the lane's 16-byte slices, into wt (a plain
            function: inlined where it is called)."""
            for it in range(self.iters):
                cute.autovec_copy(self.row_slice(gW, gw, stride, j, it, lane), wt[None, it])


def _check(w, x, ssq, add, partial, counter) -> None:
    H, K = w.shape
    if x.shape != (1, K) or add.shape != (1, H) or partial.shape != (1, H):
        raise ValueError(f"tail_attn_res: one sequence: x [1, {K}], shared and partial [1, {H}] expected, got x "
                         f"{tuple(x.shape)}, shared {tuple(add.shape)}, partial {tuple(partial.shape)}")
    if w.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or add.dtype != torch.bfloat16 or K % (32 * VEC):
        raise ValueError("tail_attn_res: bf16 W [H, K], x [1, K] and shared [1, H], K a multiple of 256")
    if not (w.is_contiguous() and x.is_contiguous() and add.is_contiguous()) or w.data_ptr() % 16 or x.data_ptr() % 16:
        raise ValueError("tail_attn_res: W, x and shared must be contiguous, W and x 16-byte aligned")
    if ssq.dtype != torch.float32 or ssq.dim() != 2 or ssq.shape[0] != 1 or not ssq.is_contiguous():
        raise ValueError("tail_attn_res: the partial sums of squares must be fp32 [1, parts]")
    if counter.dtype != torch.int32 or counter.shape != (1,):
        raise ValueError("tail_attn_res: the counter must be one int32")


def _aligns(args) -> list[int]:
    """16 bytes for W and x (16-byte loads), 4 for the sums of squares, the shared output (scalar loads) and the
    counter, AttnRes's own (4 elements) for its tensors and the score sums."""
    return [16, 16, 4, 2] + [_res_align(t) for t in args[4:10]] + [4, _res_align(args[11])]


def compile_tail_attn_res(w, x, ssq, add, blocks, partial, query, key_norm, input_norm, out, counter, *,
                          n_blocks: int, eps_norm: float, eps: float, parts: torch.Tensor, ctas: int | None = None):
    """Checks the arguments and compiles (once per shape); returns (compiled kernel, its arguments). `parts`: the
    score sums' scratch, fp32, at least ctas * 32 elements will do for any n_blocks."""
    from .attn_res import _check as check_res
    from .oproj_attn_res import _parts_view

    _check(w, x, ssq, add, partial, counter)
    check_res(blocks, partial, None, query, key_norm, input_norm, out, n_blocks, False, 0, True)
    ctas = ctas or sm_count(w.device)
    if not fits(w.shape[0], w.shape[1], n_blocks, ctas):
        raise ValueError(f"tail_attn_res: {w.shape[0]} output rows on {ctas} CTAs is more than 32 per warp")
    op = TailAttnRes(w.shape[0], w.shape[1], ctas, n_blocks, ssq.shape[1], eps_norm, eps)
    args = (w, x, ssq, add, blocks, partial, query, key_norm, input_norm, out, counter,
            _parts_view(parts, ctas, n_blocks))
    key = ("tail_attn_res", int(n_blocks), float(eps_norm), float(eps), ctas, *signature(*args))
    return compile_kernel(key, op, *(fake_like(t, align=al) for t, al in zip(args, _aligns(args)))), args


def tail_attn_res(w, x, ssq, add, blocks, partial, query, key_norm, input_norm, out, counter, *, n_blocks: int,
                  eps_norm: float, eps: float, parts: torch.Tensor) -> torch.Tensor:
    """partial += rsqrt(ssq.sum() / K + eps_norm) * (x @ w.T) + add, then `attn_res.attn_res(blocks, partial, None,
    query, key_norm, input_norm, out, n_blocks=n_blocks, commit=False, delta_mode=0, use_partial=True, eps=eps)`, in
    one kernel, for one sequence. `counter` is one int32 that is 0 (and left at 0) that no other kernel uses at the same
    time; `parts` the score sums' scratch (`compile_tail_attn_res`). Returns out."""
    if not all(t.is_cuda and t.device == w.device for t in (w, x, ssq, add, blocks, partial, query, key_norm,
                                                             input_norm, out, counter, parts)):
        raise ValueError("tail_attn_res: CUDA tensors on one device expected")
    fn, args = compile_tail_attn_res(w, x, ssq, add, blocks, partial, query, key_norm, input_norm, out, counter,
                                     n_blocks=n_blocks, eps_norm=eps_norm, eps=eps, parts=parts)
    aligns = {id(t): al for t, al in zip(args, _aligns(args))}
    launch(fn, *args, align=lambda t: aligns[id(t)])
    return out
