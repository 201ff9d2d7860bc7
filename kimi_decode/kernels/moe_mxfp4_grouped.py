"""Routed experts at batches 9..64, grouped by expert: each selected expert's MXFP4 rows are read once per step.

At batch 64 the 1,024 (token, expert) pairs select about 610 distinct experts of 896, so the per-pair kernels of
`moe_mxfp4.py` read most experts more than once (1.7 times on average). Here the pairs are first sorted by expert
(`moe_align`, the generic path's kernel: pair order, and per distinct expert its start, length and id), and each CTA
works on one expert segment, up to 8 of its pairs at a time: the 8 columns of the `mma.sync m16n8k16` activation
operand, which the per-pair kernels fill with one token, here carry 8 different pairs of the same expert. The
dequantisation (the e2m1 code shifted into an fp16, scale per 32 codes) is the one of `moe_mxfp4.py`.

`moe_w13_grouped`: CTA (row tile of 8 intermediate rows, segment); the 8 warps split K (the latent) and add their
partial sums through shared memory; SiTU-GLU(h1, h3) -> act [pair, used] fp16. `moe_w2_grouped`: CTA (128 latent
rows, segment), each warp 16 rows over the whole (short) K = used; -> routing weight x partial output per pair
[pair, latent] fp32, summed over each token's k pairs afterwards (no atomics: the result does not depend on the
order in which CTAs finish). Segments past the number of distinct experts have length 0 and exit at once.
"""
from __future__ import annotations

import torch

from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, fake_like, launch, signature
from .moe_mxfp4 import GROUP, ROWS13, WARPS, _words, check_expert_args, fits_int32_offsets

COLS = 8  # pairs per mma tile (the n of m16n8k16)
ROWS2_CTA = 16 * WARPS  # latent rows per w2 CTA

if HAVE_CUTE:
    from cutlass import Float32, Int32

    from .cute_common import load4, situ_glu
    from .moe_mxfp4 import group_mma_fragment, mx_scale

    class MoEW13Grouped:
        """act[p, j] = SiTU-GLU(w1[e, j] . x_b, w3[e, j] . x_b) for every pair p = (b, slot) of expert e, j < used."""

        def __init__(self, latent: int, inter: int, used: int, topk: int):
            self.I, self.used, self.topk = inter, used, topk
            self.groups = latent // GROUP
            self.per_warp = -(-self.groups // WARPS)

        @cute.jit
        def __call__(self, x: cute.Tensor, w: cute.Tensor, w_scale: cute.Tensor, order: cute.Tensor,
                     seg_start: cute.Tensor, seg_len: cute.Tensor, seg_expert: cute.Tensor, act: cute.Tensor,
                     stream):
            P = act.shape[0]
            gX = cute.zipped_divide(x, (1, 4))  # int32 pairs of bf16: ((1,4), (B, L/8))
            self.kernel(gX, w, w_scale, order, seg_start, seg_len, seg_expert, act).launch(
                grid=[self.used // ROWS13, P, 1], block=[32 * WARPS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, gX: cute.Tensor, w: cute.Tensor, w_scale: cute.Tensor, order: cute.Tensor,
                   seg_start: cute.Tensor, seg_len: cute.Tensor, seg_expert: cute.Tensor, act: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bx, s, _ = cute.arch.block_idx()
            warp = tidx // 32
            lane = tidx % 32
            g = lane // 4
            t = lane % 4
            j = bx * ROWS13 + g
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((2 * ROWS13, COLS, WARPS)), 16)
            length = seg_len[s]
            if length > 0:
                start = seg_start[s]
                e = seg_expert[s]
                for tile in cutlass.range((length + COLS - 1) // COLS):
                    col = tile * COLS + g  # this lane group's pair: mma column g
                    if col >= length:  # past the segment: any pair of it, its column is not stored
                        col = length - 1
                    b = order[start + col] // self.topk
                    a10 = Float32(0.0)
                    a11 = Float32(0.0)
                    a30 = Float32(0.0)
                    a31 = Float32(0.0)
                    for it in cutlass.range_constexpr(self.per_warp):
                        G = warp * self.per_warp + it
                        if G < self.groups:
                            xs = load4(gX[(None, (b, G * 4 + t))])
                            c = group_mma_fragment(w[e, j, G * 4 + t], w[e, self.I + j, G * 4 + t],
                                                   [xs[0], xs[1], xs[2], xs[3]], True)
                            s1 = mx_scale(w_scale[e, j, G])
                            s3 = mx_scale(w_scale[e, self.I + j, G])
                            a10 = a10 + c[0] * s1
                            a11 = a11 + c[1] * s1
                            a30 = a30 + c[2] * s3
                            a31 = a31 + c[3] * s3
                    red[g, 2 * t, warp] = a10
                    red[g, 2 * t + 1, warp] = a11
                    red[ROWS13 + g, 2 * t, warp] = a30
                    red[ROWS13 + g, 2 * t + 1, warp] = a31
                    cute.arch.barrier()
                    if tidx < ROWS13 * COLS:
                        r = tidx // COLS
                        n = tidx % COLS
                        if tile * COLS + n < length:
                            h1 = Float32(0.0)
                            h3 = Float32(0.0)
                            for i in cutlass.range_constexpr(WARPS):
                                h1 = h1 + red[r, n, i]
                                h3 = h3 + red[ROWS13 + r, n, i]
                            act[order[start + tile * COLS + n], bx * ROWS13 + r] = situ_glu(h1, h3).to(
                                act.element_type)
                    cute.arch.barrier()  # the next tile reuses `red`

    class MoEW2Grouped:
        """out[p, r] = weight[p] * (w2[e, r, :used] . act[p, :used]) for every pair p of expert e."""

        def __init__(self, used: int, topk: int):
            self.topk = topk
            self.groups = used // GROUP

        @cute.jit
        def __call__(self, act: cute.Tensor, weights: cute.Tensor, w: cute.Tensor, w_scale: cute.Tensor,
                     order: cute.Tensor, seg_start: cute.Tensor, seg_len: cute.Tensor, seg_expert: cute.Tensor,
                     out: cute.Tensor, stream):
            P, L = out.shape
            gA = cute.zipped_divide(act, (1, 4))  # int32 pairs of fp16: ((1,4), (P, used/8))
            self.kernel(gA, weights, w, w_scale, order, seg_start, seg_len, seg_expert, out).launch(
                grid=[L // ROWS2_CTA, P, 1], block=[32 * WARPS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, gA: cute.Tensor, weights: cute.Tensor, w: cute.Tensor, w_scale: cute.Tensor,
                   order: cute.Tensor, seg_start: cute.Tensor, seg_len: cute.Tensor, seg_expert: cute.Tensor,
                   out: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bx, s, _ = cute.arch.block_idx()
            warp = tidx // 32
            lane = tidx % 32
            g = lane // 4
            t = lane % 4
            ra = bx * ROWS2_CTA + warp * 16 + g
            rb = ra + 8
            length = seg_len[s]
            if length > 0:
                start = seg_start[s]
                e = seg_expert[s]
                for tile in cutlass.range((length + COLS - 1) // COLS):
                    col = tile * COLS + g
                    if col >= length:
                        col = length - 1
                    p = order[start + col]
                    a0 = Float32(0.0)
                    a1 = Float32(0.0)
                    b0 = Float32(0.0)
                    b1 = Float32(0.0)
                    for G in cutlass.range_constexpr(self.groups):
                        xs = load4(gA[(None, (p, G * 4 + t))])
                        c = group_mma_fragment(w[e, ra, G * 4 + t], w[e, rb, G * 4 + t],
                                               [xs[0], xs[1], xs[2], xs[3]], False)
                        sa = mx_scale(w_scale[e, ra, G])
                        sb = mx_scale(w_scale[e, rb, G])
                        a0 = a0 + c[0] * sa
                        a1 = a1 + c[1] * sa
                        b0 = b0 + c[2] * sb
                        b1 = b1 + c[3] * sb
                    # this lane holds columns 2t and 2t + 1 of rows ra and rb
                    n0 = tile * COLS + 2 * t
                    if n0 < length:
                        q = order[start + n0]
                        wt = weights[q // self.topk, q % self.topk]
                        out[q, ra] = wt * a0
                        out[q, rb] = wt * b0
                    if n0 + 1 < length:
                        q = order[start + n0 + 1]
                        wt = weights[q // self.topk, q % self.topk]
                        out[q, ra] = wt * a1
                        out[q, rb] = wt * b1


def _check(latent, ids, weights, w13, w13_scale, w2, w2_scale, used, align, act, pair_out):
    """The per-pair kernels' checks (layouts, chaining, dtypes, contiguity, 32-bit offsets), then what grouping adds."""
    check_expert_args(latent, ids, w13, w13_scale, w2, w2_scale, used, act, pair_out)
    P, L = ids.numel(), latent.shape[1]
    if not fits_int32_offsets(pair_out):
        raise ValueError("grouped MoE MXFP4: a per-pair output of 2**31 bytes or more needs 64-bit offsets, which "
                         "these kernels do not use")
    if L % ROWS2_CTA:
        raise ValueError(f"grouped MoE MXFP4: latent width must be a multiple of {ROWS2_CTA}")
    if any(a.shape != (P,) or a.dtype != torch.int32 or not a.is_contiguous() for a in align):
        raise ValueError("grouped MoE MXFP4: the alignment must be four contiguous int32 [pairs]")
    if not weights.is_contiguous():
        raise ValueError("grouped MoE MXFP4: inputs must be contiguous")
    if act.shape != (P, used) or pair_out.shape != (P, L):
        raise ValueError(f"grouped MoE MXFP4: act must be [{P}, {used}] and the per-pair output [{P}, {L}]")


def compile_grouped(latent, ids, weights, w13, w13_scale, w2, w2_scale, align, act, pair_out, used: int):
    L, I, k = latent.shape[1], w13.shape[1] // 2, ids.shape[1]
    a13 = (_words(latent), _words(w13), w13_scale, *align, act)
    f13 = compile_kernel(("moe_w13_grouped", used, *signature(*a13)), MoEW13Grouped(L, I, used, k),
                         *(fake_like(t, align=16) for t in a13))
    a2 = (_words(act), weights, _words(w2), w2_scale, *align, pair_out)
    f2 = compile_kernel(("moe_w2_grouped", used, *signature(*a2)), MoEW2Grouped(used, k),
                        *(fake_like(t, align=16) for t in a2))
    return f13, f2


def moe_mxfp4_grouped(latent, ids, weights, w13, w13_scale, w2, w2_scale, used: int, align, act=None,
                      pair_out=None):
    """Routed experts of one rank, each selected expert read once: latent [B, L] bf16, ids [B, k] int32, weights
    [B, k] fp32, `align` the four int32 [B*k] outputs of `moe_align(ids)` (order, segment start, length, expert)
    -> [B, L] fp32, the weighted sum over each token's k experts. `act` [B*k, used] fp16 and `pair_out`
    [B*k, L] fp32 may be given (overwritten)."""
    B, k = ids.shape
    L = latent.shape[1]
    act = act if act is not None else torch.empty(B * k, used, dtype=torch.float16, device=latent.device)
    pair_out = pair_out if pair_out is not None else torch.empty(B * k, L, dtype=torch.float32, device=latent.device)
    _check(latent, ids, weights, w13, w13_scale, w2, w2_scale, used, align, act, pair_out)
    f13, f2 = compile_grouped(latent, ids, weights, w13, w13_scale, w2, w2_scale, align, act, pair_out, used)
    launch(f13, _words(latent), _words(w13), w13_scale, *align, act)
    launch(f2, _words(act), weights, _words(w2), w2_scale, *align, pair_out)
    return pair_out.view(B, k, L).sum(1)
