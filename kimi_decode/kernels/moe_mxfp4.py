"""Routed experts at small batch with MXFP4 weights dequantised in registers, in two kernels and no padding.

`moe_w13_act`: for each (token, selected expert) and each intermediate row j, a warp computes the w1 and w3 rows
against the token's latent vector and writes SiTU-GLU(h1, h3). `moe_w2_sum`: for each token and each latent row r, a
warp sums, over the token's k experts, routing weight x (w2 row r . activation): the weighted sum over experts
happens in registers, so no per-expert output and no reduction kernel.

Each lane works on 16-byte chunks of packed weights: 32 e2m1 codes sharing one ue8m0 scale (one MX group), so a
16-byte load, one scale byte and 32 activations make one unit of work. Codes become floats with integer arithmetic
(value * 2 = ((2 + m) << e) >> 1, zero for code 0) and the group's scale 2**(s - 128) is applied once per chunk.
Only the expert rows the math needs are read: padded intermediate rows (TP16 stores 256, uses 192) are skipped.
"""
from __future__ import annotations

import torch

from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, fake_like, launch, signature

GROUP = 32  # codes per MX group = per 16-byte chunk
WARPS = 4

if HAVE_CUTE:
    from cutlass import Float32, Int32

    @cute.jit
    def _code_value(code: Int32) -> Float32:
        """2 * e2m1 value of a 4-bit code, as Float32 (the caller folds the 0.5 into the scale)."""
        mag = code & 7
        e = mag >> 1
        m = mag & 1
        v = (((m + 2) << e) >> 1) + ((mag + 7) >> 3) - 1
        return Float32(v * (1 - 2 * (code >> 3)))

    @cute.jit
    def _chunk_dot(w_bytes: cute.Tensor, x: cute.Tensor) -> Float32:
        """sum over 32 codes (16 bytes, low nibble first) of 2*value(code) * x (32 Float32 values)."""
        acc = Float32(0.0)
        for i in cutlass.range_constexpr(GROUP // 2):
            byte = Int32(w_bytes[i])
            acc = acc + _code_value(byte & 15) * x[2 * i] + _code_value(byte >> 4) * x[2 * i + 1]
        return acc

    @cute.jit
    def _scale(s) -> Float32:
        return cute.math.exp2(Float32(Int32(s)) - Float32(128.0))

    class MoEW13Act:
        """act[p, j] = SiTU-GLU(w1[e_p, j] . x_p, w3[e_p, j] . x_p) for j < used_inter."""

        def __init__(self, latent: int, inter: int, used: int, topk: int):
            self.L, self.I, self.used, self.topk = latent, inter, used, topk
            self.chunks = latent // GROUP

        @cute.jit
        def __call__(self, x: cute.Tensor, ids: cute.Tensor, w: cute.Tensor, w_scale: cute.Tensor,
                     act: cute.Tensor, stream):
            P = act.shape[0]
            gW = cute.zipped_divide(w, (1, 1, GROUP // 2))  # ((1,1,16), (E, 2I, chunks))
            gX = cute.zipped_divide(x, (1, GROUP))  # ((1,32), (B, chunks))
            self.kernel(gX, ids, gW, w_scale, act).launch(
                grid=[cute.ceil_div(self.used, WARPS), P, 1], block=[32 * WARPS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, gX: cute.Tensor, ids: cute.Tensor, gW: cute.Tensor, w_scale: cute.Tensor,
                   act: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bx, p, _ = cute.arch.block_idx()
            lane = tidx % 32
            j = bx * WARPS + tidx // 32
            b = p // self.topk
            e = ids[b, p % self.topk]
            acc1 = Float32(0.0)
            acc3 = Float32(0.0)
            if j < self.used:
                for it in cutlass.range_constexpr(-(-self.chunks // 32)):
                    c = it * 32 + lane
                    if c < self.chunks:
                        t1 = gW[(None, (e, j, c))]
                        r1 = cute.make_rmem_tensor_like(t1)
                        cute.autovec_copy(t1, r1)
                        t3 = gW[(None, (e, self.I + j, c))]
                        r3 = cute.make_rmem_tensor_like(t3)
                        cute.autovec_copy(t3, r3)
                        tx = gX[(None, (b, c))]
                        rx = cute.make_rmem_tensor_like(tx)
                        cute.autovec_copy(tx, rx)
                        xf = cute.make_rmem_tensor((GROUP,), Float32)
                        xf.store(rx.load().to(Float32))
                        acc1 = acc1 + _chunk_dot(r1, xf) * _scale(w_scale[e, j, c])
                        acc3 = acc3 + _chunk_dot(r3, xf) * _scale(w_scale[e, self.I + j, c])
                h1 = cute.arch.warp_reduction(acc1, lambda a, z: a + z)
                h3 = cute.arch.warp_reduction(acc3, lambda a, z: a + z)
                if lane == 0:
                    # SiTU-GLU: 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25)
                    gate = Float32(4.0) * cute.math.tanh(h1 * Float32(0.25)) / (
                        Float32(1.0) + cute.math.exp(Float32(0.0) - h1))
                    up = Float32(25.0) * cute.math.tanh(h3 * Float32(0.04))
                    act[p, j] = (gate * up).to(act.element_type)

    class MoEW2Sum:
        """out[b, r] = sum_j weight[b, j] * (w2[e_bj, r, :used] . act[b*k + j, :used])."""

        def __init__(self, used: int, topk: int):
            self.used, self.topk = used, topk
            self.chunks = used // GROUP

        @cute.jit
        def __call__(self, act: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor, w: cute.Tensor,
                     w_scale: cute.Tensor, out: cute.Tensor, stream):
            B, L = out.shape
            gW = cute.zipped_divide(w, (1, 1, GROUP // 2))  # ((1,1,16), (E, L, I/32))
            gA = cute.zipped_divide(act, (1, GROUP))  # ((1,32), (P, used/32 or more))
            self.kernel(gA, ids, weights, gW, w_scale, out, L).launch(
                grid=[cute.ceil_div(L, WARPS), B, 1], block=[32 * WARPS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, gA: cute.Tensor, ids: cute.Tensor, weights: cute.Tensor, gW: cute.Tensor,
                   w_scale: cute.Tensor, out: cute.Tensor, L: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            bx, b, _ = cute.arch.block_idx()
            lane = tidx % 32
            r = bx * WARPS + tidx // 32
            acc = Float32(0.0)
            items = self.topk * self.chunks
            if r < L:
                for it in cutlass.range_constexpr(-(-items // 32)):
                    item = it * 32 + lane
                    if item < items:
                        j = item // self.chunks
                        c = item % self.chunks
                        e = ids[b, j]
                        tw = gW[(None, (e, r, c))]
                        rw = cute.make_rmem_tensor_like(tw)
                        cute.autovec_copy(tw, rw)
                        ta = gA[(None, (b * self.topk + j, c))]
                        ra = cute.make_rmem_tensor_like(ta)
                        cute.autovec_copy(ta, ra)
                        af = cute.make_rmem_tensor((GROUP,), Float32)
                        af.store(ra.load().to(Float32))
                        acc = acc + weights[b, j] * _chunk_dot(rw, af) * _scale(w_scale[e, r, c])
                total = cute.arch.warp_reduction(acc, lambda a, z: a + z)
                if lane == 0:
                    out[b, r] = total


def _check(latent, ids, w13, w13_scale, w2, w2_scale, used):
    E, two_i, half_l = w13.shape
    if latent.shape[1] != 2 * half_l or latent.shape[1] % GROUP or used % GROUP or used > two_i // 2:
        raise ValueError("MoE MXFP4: latent width and expert slice must be multiples of 32 and chain")
    if ids.dtype != torch.int32 or ids.shape[0] != latent.shape[0]:
        raise ValueError("MoE MXFP4: ids must be int32 [batch, top_k]")
    for t in (latent, ids, w13, w13_scale, w2, w2_scale):
        if not t.is_contiguous():
            raise ValueError("MoE MXFP4: inputs must be contiguous")


def compile_moe(latent, ids, weights, w13, w13_scale, w2, w2_scale, act, out, used: int):
    L, I, k = latent.shape[1], w13.shape[1] // 2, ids.shape[1]
    f13 = compile_kernel(("moe_w13_act", used, *signature(latent, ids, w13, w13_scale, act)),
                         MoEW13Act(L, I, used, k), *(fake_like(t, align=16) for t in (latent, ids, w13, w13_scale,
                                                                                        act)))
    f2 = compile_kernel(("moe_w2_sum", used, *signature(act, ids, weights, w2, w2_scale, out)),
                        MoEW2Sum(used, k), *(fake_like(t, align=16) for t in (act, ids, weights, w2, w2_scale, out)))
    return f13, f2


def moe_mxfp4(latent, ids, weights, w13, w13_scale, w2, w2_scale, used: int, act=None, out=None):
    """Routed experts of one rank: latent [B, L] bf16, ids [B, k] int32, weights [B, k] fp32 -> out [B, L] fp32
    (the weighted sum over the k experts, before any cross-rank reduction). `used` is the expert slice without
    padding. `act` [B*k, used] bf16 and `out` may be given (their contents are overwritten)."""
    _check(latent, ids, w13, w13_scale, w2, w2_scale, used)
    B, k = ids.shape
    act = act if act is not None else torch.empty(B * k, used, dtype=torch.bfloat16, device=latent.device)
    out = out if out is not None else torch.empty(B, latent.shape[1], dtype=torch.float32, device=latent.device)
    f13, f2 = compile_moe(latent, ids, weights, w13, w13_scale, w2, w2_scale, act, out, used)
    launch(f13, latent, ids, w13, w13_scale, act)
    launch(f2, act, ids, weights, w2, w2_scale, out)
    return out
