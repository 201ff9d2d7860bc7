"""Small-batch projection (1 to 8 rows) on CUDA cores: y[m, n] = sum_k x[m, k] * W[n, k], bf16 in, fp32 accumulate.

Each warp owns one output row n and streams W[n, :] with 16-byte loads (8 bf16 per lane, 256 per warp and
iteration); the few activation rows stay in L1. At batch <= 8 the weights are the only bytes that matter, and a
warp per row keeps thousands of independent 16-byte loads in flight. The epilogue either stores y (bf16 or fp32) or
adds it into an fp32 residual (`accumulate=True`), which fuses the residual update of output projections.
"""
from __future__ import annotations

import torch

from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, fake_like, launch, signature

VEC = 8  # bf16 per 16-byte load
WARPS = 4
MAX_ROWS = 8

if HAVE_CUTE:
    from cutlass import Float32, Int32

    class SmallBatchGemv:
        def __init__(self, M: int, K: int, accumulate: bool):
            self.M, self.K, self.accumulate = M, K, accumulate
            self.iters = -(-K // (32 * VEC))

        @cute.jit
        def __call__(self, mW: cute.Tensor, mX: cute.Tensor, mY: cute.Tensor, stream):
            gW = cute.zipped_divide(mW, (1, VEC))
            gX = cute.zipped_divide(mX, (1, VEC))
            N = mW.shape[0]
            self.kernel(gW, gX, mY, N).launch(grid=[cute.ceil_div(N, WARPS), 1, 1], block=[32 * WARPS, 1, 1],
                                              stream=stream)

        @cute.kernel
        def kernel(self, gW: cute.Tensor, gX: cute.Tensor, mY: cute.Tensor, N: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            lane = tidx % 32
            n = bidx * WARPS + tidx // 32
            acc = cute.make_rmem_tensor((self.M,), Float32)
            acc.fill(0.0)
            if n < N:
                for it in cutlass.range(self.iters, unroll=4):
                    kk = it * 32 + lane
                    if kk * VEC < self.K:
                        tW = gW[(None, (n, kk))]
                        rW = cute.make_rmem_tensor_like(tW)
                        cute.autovec_copy(tW, rW)
                        w = rW.load().to(Float32)
                        for m in cutlass.range_constexpr(self.M):
                            tX = gX[(None, (m, kk))]
                            rX = cute.make_rmem_tensor_like(tX)
                            cute.autovec_copy(tX, rX)
                            acc[m] = acc[m] + (w * rX.load().to(Float32)).reduce(
                                cute.ReductionOp.ADD, Float32(0.0), 0)
                for m in cutlass.range_constexpr(self.M):
                    total = cute.arch.warp_reduction(acc[m], lambda a, b: a + b)
                    if lane == 0:
                        if cutlass.const_expr(self.accumulate):
                            mY[m, n] = mY[m, n] + total
                        else:
                            mY[m, n] = total.to(mY.element_type)


def _check(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, accumulate: bool) -> None:
    M, K = x.shape
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"small-batch GEMV takes 1..{MAX_ROWS} rows, got {M}")
    if w.shape[1] != K or y.shape != (M, w.shape[0]):
        raise ValueError(f"shapes do not chain: W {tuple(w.shape)}, x {tuple(x.shape)}, y {tuple(y.shape)}")
    if w.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or K % VEC:
        raise ValueError("W and x must be bf16 with K a multiple of 8")
    if w.stride(1) != 1 or x.stride(1) != 1 or y.stride(1) != 1 or w.stride(0) % VEC or x.stride(0) % VEC:
        raise ValueError("rows must be contiguous and 16-byte aligned")
    if accumulate and y.dtype != torch.float32:
        raise ValueError("accumulating into y needs an fp32 y")


def compile_gemv(w, x, y, accumulate: bool = False):
    key = ("gemv", accumulate, *signature(w, x, y))
    return compile_kernel(key, SmallBatchGemv(x.shape[0], x.shape[1], accumulate), fake_like(w), fake_like(x),
                          fake_like(y))


def gemv(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """y = x @ w.T (or y += x @ w.T with `accumulate`), written in place on the current stream."""
    _check(w, x, y, accumulate)
    launch(compile_gemv(w, x, y, accumulate), w, x, y)
    return y
