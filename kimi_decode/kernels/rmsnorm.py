"""RMSNorm of fp32 rows to bf16 (the latent MoE output's norm before the up-projection), one CTA per row.

Each thread keeps its slice of the row in registers between the sum of squares and the scaled write, so the row is
read once; the block sum goes through warp shuffles and one shared-memory step.
"""
from __future__ import annotations

import torch

from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, fake_like, launch, signature

if HAVE_CUTE:
    from .cute_common import pdl_launch_dependents, pdl_wait

THREADS = 256

if HAVE_CUTE:
    from cutlass import Float32

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
            ss = cute.arch.warp_reduction(ss, lambda a, b: a + b)
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout(THREADS // 32), 16)
            if tidx % 32 == 0:
                red[tidx // 32] = ss
            cute.arch.barrier()
            total = Float32(0.0)
            for i in cutlass.range_constexpr(THREADS // 32):
                total = total + red[i]
            scale = cute.math.rsqrt(total / Float32(self.W) + Float32(self.eps))
            for i in cutlass.range_constexpr(self.per_thread):
                c = tidx + THREADS * i
                if c < self.W:
                    out[row, c] = (vals[i] * scale * w[c]).to(out.element_type)


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
