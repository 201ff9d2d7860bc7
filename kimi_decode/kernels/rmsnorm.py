"""RMSNorm of fp32 rows to bf16 (the latent MoE output's norm before the up-projection), one CTA per row.

Each thread keeps its slice of the row in registers between the sum of squares and the scaled write, so the row is
read once; the block sum goes through warp shuffles and one shared-memory step.

`routed_norm` is the same norm for the grouped expert kernels' output, which comes per (token, expert) pair: each CTA
first adds its token's k pair rows (1024 threads, a 16-byte group of the row each, all of its k loads independent,
the terms added in a fixed order, so the result does not depend on timing), and optionally adds the shared experts'
output into the residual (`residual += addend`, another width), so that the MoE tail above the tensor-core
projection's rows is this kernel and one cuBLAS GEMM accumulating into the residual, where the generic tail runs six
kernels (sum over k, norm, cast, GEMM, two adds).
"""
from __future__ import annotations

import torch

from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, fake_like, launch, signature

if HAVE_CUTE:
    from .cute_common import pdl_launch_dependents, pdl_wait

THREADS = 256
ROUTED_THREADS = 1024  # `RoutedNorm`: a 3584-wide row is 896 16-byte groups, one per thread, all k loads in flight

if HAVE_CUTE:
    from cutlass import Float32

    @cute.jit
    def inverse_rms(ss, tidx, threads: int, width: int, eps: float):
        """1 / sqrt(mean square + eps) of a row of `width` values whose sum of squares is spread over the CTA's
        `threads` threads (`ss` in each): a warp reduction, one shared-memory step and a barrier, then every thread
        adds the warps' sums (the kernel's only shared memory)."""
        ss = cute.arch.warp_reduction(ss, lambda a, b: a + b)
        smem = cutlass.utils.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout(threads // 32), 16)
        if tidx % 32 == 0:
            red[tidx // 32] = ss
        cute.arch.barrier()
        total = Float32(0.0)
        for i in cutlass.range_constexpr(threads // 32):
            total = total + red[i]
        return cute.math.rsqrt(total / Float32(width) + Float32(eps))

    class RMSNormRows:
        def __init__(self, width: int, eps: float):
            self.W, self.eps = width, eps
            self.per_thread = -(-width // THREADS)

        @cute.jit
        def __call__(self, x: cute.Tensor, w: cute.Tensor, out: cute.Tensor, stream):
            self.kernel(x, w, out).launch(grid=[x.shape[0], 1, 1], block=[THREADS, 1, 1], stream=stream,
                                          use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, x: cute.Tensor, w: cute.Tensor, out: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            row, _, _ = cute.arch.block_idx()
            pdl_launch_dependents(self.pdl)
            pdl_wait(self.pdl)
            vals = cute.make_rmem_tensor((self.per_thread,), Float32)
            ss = Float32(0.0)
            for i in cutlass.range_constexpr(self.per_thread):
                c = tidx + THREADS * i
                vals[i] = Float32(0.0)
                if c < self.W:
                    vals[i] = x[row, c]
                ss = ss + vals[i] * vals[i]
            scale = inverse_rms(ss, tidx, THREADS, self.W, self.eps)
            for i in cutlass.range_constexpr(self.per_thread):
                c = tidx + THREADS * i
                if c < self.W:
                    out[row, c] = (vals[i] * scale * w[c]).to(out.element_type)


if HAVE_CUTE:
    from .cute_common import load4

    class RoutedNorm:
        """out[b] = RMSNorm(sum_j x[b * terms + j]) * w, and with `hidden` > 0 also res[b, :hidden] += add[b]."""

        def __init__(self, width: int, eps: float, terms: int, hidden: int):
            self.W, self.eps, self.terms, self.H = width, eps, terms, hidden
            self.groups = width // 4  # 16-byte groups of a row
            self.per_thread = -(-self.groups // ROUTED_THREADS)
            self.per_thread_h = -(-hidden // ROUTED_THREADS)

        @cute.jit
        def __call__(self, x: cute.Tensor, w: cute.Tensor, out: cute.Tensor, res: cute.Tensor, add: cute.Tensor,
                     stream):
            gX = cute.zipped_divide(x, (1, 4))  # ((1, 4), (pairs, W / 4))
            self.kernel(gX, w, out, res, add).launch(grid=[out.shape[0], 1, 1], block=[ROUTED_THREADS, 1, 1],
                                                     stream=stream, use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, gX: cute.Tensor, w: cute.Tensor, out: cute.Tensor, res: cute.Tensor, add: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            row, _, _ = cute.arch.block_idx()
            pdl_launch_dependents(self.pdl)
            pdl_wait(self.pdl)
            # the residual's new values first, all loads before any store (a store between them would keep the
            # compiler from issuing the next loads early: one round trip per element)
            upd = cute.make_rmem_tensor((max(self.per_thread_h, 1),), Float32)
            if cutlass.const_expr(self.H > 0):
                for i in cutlass.range_constexpr(self.per_thread_h):
                    c = tidx + ROUTED_THREADS * i
                    upd[i] = Float32(0.0)
                    if c < self.H:
                        upd[i] = res[row, c] + add[row, c].to(Float32)
            acc = cute.make_rmem_tensor((self.per_thread * 4,), Float32)
            ss = Float32(0.0)
            for i in cutlass.range_constexpr(self.per_thread):
                g = tidx + ROUTED_THREADS * i
                for c in cutlass.range_constexpr(4):
                    acc[4 * i + c] = Float32(0.0)
                if g < self.groups:
                    for j in cutlass.range_constexpr(self.terms):
                        v = load4(gX[(None, (row * self.terms + j, g))])
                        for c in cutlass.range_constexpr(4):
                            acc[4 * i + c] = acc[4 * i + c] + v[c]
                for c in cutlass.range_constexpr(4):
                    ss = ss + acc[4 * i + c] * acc[4 * i + c]
            if cutlass.const_expr(self.H > 0):
                for i in cutlass.range_constexpr(self.per_thread_h):
                    c = tidx + ROUTED_THREADS * i
                    if c < self.H:
                        res[row, c] = upd[i]
            scale = inverse_rms(ss, tidx, ROUTED_THREADS, self.W, self.eps)
            for i in cutlass.range_constexpr(self.per_thread):
                g = tidx + ROUTED_THREADS * i
                if g < self.groups:
                    for c in cutlass.range_constexpr(4):
                        out[row, 4 * g + c] = (acc[4 * i + c] * scale * w[4 * g + c]).to(out.element_type)


def routed_norm(pairs: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float,
                residual: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """out = RMSNorm(pairs.sum(1)) * weight: pairs [B, k, W] fp32 (each token's k expert outputs, contiguous, W a
    multiple of 4), weight [W] fp32 -> out [B, W] bf16, written in place. With `residual` = (res [B, H] fp32, addend
    [B, H] bf16) the same kernel also does res += addend."""
    if pairs.dim() != 3 or pairs.dtype != torch.float32 or weight.dtype != torch.float32 \
            or out.dtype != torch.bfloat16:
        raise ValueError("routed_norm: fp32 pairs [B, k, W] and weight, bf16 out expected")
    B, k, W = pairs.shape
    if out.shape != (B, W) or weight.shape != (W,) or W % 4 or not (pairs.is_contiguous() and out.is_contiguous()):
        raise ValueError("routed_norm: contiguous pairs [B, k, W] (W a multiple of 4), out [B, W], weight [W] expected")
    if residual is not None:
        res, add = residual
        if res.dtype != torch.float32 or add.dtype != torch.bfloat16 or res.shape != add.shape \
                or res.shape[0] != B or not (res.is_contiguous() and add.is_contiguous()):
            raise ValueError("routed_norm: residual must be (fp32 res, bf16 addend) of one shape [B, H], contiguous")
        hidden = res.shape[1]
    else:
        res, add, hidden = out, out, 0  # stand-ins, never read
    x = pairs.view(B * k, W)
    key = ("routed_norm", float(eps), k, hidden, *signature(x, weight, out, res, add))
    fn = compile_kernel(key, RoutedNorm(W, float(eps), k, hidden),
                        *(fake_like(t, align=16 if t is x else 4) for t in (x, weight, out, res, add)))
    launch(fn, x, weight, out, res, add, align=lambda t: 16 if t is x else 4)
    return out


def rmsnorm_rows(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> torch.Tensor:
    """out = RMSNorm(x) * weight, x [B, W] fp32, weight [W] fp32 -> out [B, W] bf16, written in place."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or out.dtype != torch.bfloat16:
        raise ValueError("rmsnorm_rows: fp32 x and weight, bf16 out expected")
    if out.shape != x.shape or weight.shape != (x.shape[1],) or not (x.is_contiguous() and out.is_contiguous()):
        raise ValueError("rmsnorm_rows: contiguous x and out of one shape, weight of the row width expected")
    key = ("rmsnorm_rows", float(eps), *signature(x, weight, out))
    fn = compile_kernel(key, RMSNormRows(x.shape[1], float(eps)), *(fake_like(t, align=4) for t in (x, weight, out)))
    launch(fn, x, weight, out, align=4)
    return out
