"""RMSNorm of fp32 rows to bf16 (the latent MoE output's norm before the up-projection), one CTA per row.

Each thread keeps its slice of the row in registers between the sum of squares and the scaled write, so the row is
read once; the block sum goes through warp shuffles and one shared-memory step.

`routed_norm` is the same norm for the grouped expert kernels' output, which comes per (token, expert) pair: each CTA
first adds its token's k pair rows, fp32 or bf16 (1024 threads, 4 values of the row each, all of its k loads
independent, the terms added in fp32 in a fixed order, so the result does not depend on timing), and optionally adds
the shared experts' output into the residual (`residual += addend`, another width), so that the MoE tail above the
tensor-core projection's rows is this kernel and one cuBLAS GEMM accumulating into the residual, where the generic
tail runs six kernels (sum over k, norm, cast, GEMM, two adds).

`routed_norm(..., split=(counters, parts))` spreads each token over `split_ctas(W)` CTAs of SPLIT_THREADS threads
(`RoutedNormSplit`; at the K3 latent width a batch of B tokens then runs on 7 B CTAs instead of B): each CTA sums its
slice of the pair rows and updates its slice of the residual, stores its part of the sum of squares, and waits until
its token's other CTAs have stored theirs (a counter per token; a token's CTAs are adjacent in launch order and the
host checks that the grid fits on the GPU at SPLIT_MAX_CTAS_PER_SM, so the wait ends), then adds the parts in a fixed
order and writes its slice of the norm. The last CTA of a token to leave sets its counters back
to 0, so the kernel replays in a CUDA graph as it is.
"""
from __future__ import annotations

import torch

from .cute_common import (HAVE_CUTE, compile_kernel, cute, cutlass, fake_like, launch, norm_weight_first,
                          signature, sm_count)

if HAVE_CUTE:
    from .cute_common import pdl_launch_dependents, pdl_wait

THREADS = 256
ROUTED_THREADS = 1024  # `RoutedNorm`: a 3584-wide row is 896 16-byte groups, one per thread, all k loads in flight
SPLIT_THREADS = 128  # `RoutedNormSplit`: a 16-byte group of the row per thread, as in `RoutedNorm`
SPLIT_MAX_ROWS = 64  # the tokens one set of `routed_norm_scratch` serves
SPLIT_MAX_CTAS_PER_SM = 4  # the most CTAs per SM the split form may need resident at once (its wait needs them all)

if HAVE_CUTE:
    from cutlass import Float32

    @cute.jit
    def block_sum(v, tidx, threads: int, red: cute.Tensor):
        """The sum of `v` over the CTA's `threads` threads, in every thread: a warp reduction, one step through `red`
        (threads / 32 fp32 of shared memory) and a barrier, then every thread adds the warps' sums in a fixed order."""
        v = cute.arch.warp_reduction(v, lambda a, b: a + b)
        if tidx % 32 == 0:
            red[tidx // 32] = v
        cute.arch.barrier()
        total = Float32(0.0)
        for i in cutlass.range_constexpr(threads // 32):
            total = total + red[i]
        return total

    @cute.jit
    def inverse_rms(ss, tidx, threads: int, width: int, eps: float):
        """1 / sqrt(mean square + eps) of a row of `width` values whose sum of squares is spread over the CTA's
        `threads` threads (`ss` in each): `block_sum` through the kernel's only shared memory."""
        smem = cutlass.utils.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout(threads // 32), 16)
        return cute.math.rsqrt(block_sum(ss, tidx, threads, red) / Float32(width) + Float32(eps))

    class RMSNormRows:
        def __init__(self, width: int, eps: float, w_first: bool = False):
            """`w_first`: the weight loaded before the first store (`norm_weight_first`)."""
            self.W, self.eps = width, eps
            self.per_thread = -(-width // THREADS)
            self.w_first = w_first

        @cute.jit
        def __call__(self, x: cute.Tensor, w: cute.Tensor, out: cute.Tensor, stream):
            self.kernel(x, w, out).launch(grid=[x.shape[0], 1, 1], block=[THREADS, 1, 1], stream=stream,
                                          use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, x: cute.Tensor, w: cute.Tensor, out: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            row, _, _ = cute.arch.block_idx()
            pdl_launch_dependents(self.pdl)
            wr = cute.make_rmem_tensor((self.per_thread if self.w_first else 1,), Float32)
            if cutlass.const_expr(self.w_first):
                for i in cutlass.range_constexpr(self.per_thread):
                    wr[i] = w[cutlass.min(tidx + THREADS * i, self.W - 1)]
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
                    if cutlass.const_expr(self.w_first):
                        out[row, c] = (vals[i] * scale * wr[i]).to(out.element_type)
                    else:
                        out[row, c] = (vals[i] * scale * w[c]).to(out.element_type)


if HAVE_CUTE:
    from .cute_common import load4

    class RoutedNorm:
        """out[b] = RMSNorm(sum_j x[b * terms + j]) * w, and with `hidden` > 0 also res[b, :hidden] += add[b]."""

        def __init__(self, width: int, eps: float, terms: int, hidden: int, w_first: bool = False):
            """`w_first`: the weight loaded before the first store (`norm_weight_first`)."""
            self.W, self.eps, self.terms, self.H = width, eps, terms, hidden
            self.groups = width // 4  # 16-byte groups of a row
            self.per_thread = -(-self.groups // ROUTED_THREADS)
            self.per_thread_h = -(-hidden // ROUTED_THREADS)
            self.w_first = w_first

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
                        v = load4(gX[(None, (row * self.terms + j, g))])  # 16 bytes, or 8 of bf16 pairs
                        for c in cutlass.range_constexpr(4):
                            acc[4 * i + c] = acc[4 * i + c] + v[c].to(Float32)
                for c in cutlass.range_constexpr(4):
                    ss = ss + acc[4 * i + c] * acc[4 * i + c]
            # "w_first": the weight after the pair loads (their registers come first), before any store
            wr = cute.make_rmem_tensor((self.per_thread * 4 if self.w_first else 1,), Float32)
            if cutlass.const_expr(self.w_first):
                for i in cutlass.range_constexpr(self.per_thread):
                    g = cutlass.min(tidx + ROUTED_THREADS * i, self.groups - 1)
                    for c in cutlass.range_constexpr(4):
                        wr[4 * i + c] = w[4 * g + c]
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
                        if cutlass.const_expr(self.w_first):
                            out[row, 4 * g + c] = (acc[4 * i + c] * scale * wr[4 * i + c]).to(out.element_type)
                        else:
                            out[row, 4 * g + c] = (acc[4 * i + c] * scale * w[4 * g + c]).to(out.element_type)


if HAVE_CUTE:
    from .cute_common import copy_async_16, count_done, last_cta, wait_count

    class RoutedNormSplit:
        """`RoutedNorm` with each token over `split_ctas(width)` CTAs (grid [CTAs, B]): CTA s takes the row's 16-byte
        groups s * SPLIT_THREADS .. and the residual's columns s * ceil(H / CTAs) ..; `counters` [2 cap] int32 (the
        arrivals of token b at b, its departures at cap + b), `parts` [cap * CTAs] fp32 (the CTAs' sums of squares)."""

        def __init__(self, width: int, eps: float, terms: int, hidden: int, cap: int, w_first: bool = False):
            """`w_first`: the weight loaded before the first store (`norm_weight_first`)."""
            self.W, self.eps, self.terms, self.H, self.cap = width, eps, terms, hidden, cap
            self.groups = width // 4
            self.S = split_ctas(width)
            self.cols_h = -(-hidden // self.S)  # residual columns per CTA
            self.per_thread_h = -(-self.cols_h // SPLIT_THREADS)
            self.w_first = w_first

        @cute.jit
        def __call__(self, x: cute.Tensor, w: cute.Tensor, out: cute.Tensor, res: cute.Tensor, add: cute.Tensor,
                     counters: cute.Tensor, parts: cute.Tensor, stream):
            gX = cute.zipped_divide(x, (1, 4))  # ((1, 4), (pairs, W / 4))
            self.kernel(gX, w, out, res, add, counters, parts).launch(
                grid=[self.S, out.shape[0], 1], block=[SPLIT_THREADS, 1, 1], stream=stream, use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, gX: cute.Tensor, w: cute.Tensor, out: cute.Tensor, res: cute.Tensor, add: cute.Tensor,
                   counters: cute.Tensor, parts: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            s, row, _ = cute.arch.block_idx()  # a token's CTAs next to each other in launch order
            pdl_launch_dependents(self.pdl)
            wr = cute.make_rmem_tensor((4,), Float32)
            if cutlass.const_expr(self.w_first):
                gw = cutlass.min(s * SPLIT_THREADS + tidx, self.groups - 1)
                for c in cutlass.range_constexpr(4):
                    wr[c] = w[4 * gw + c]
            pdl_wait(self.pdl)
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout(SPLIT_THREADS // 32), 16)
            flag = smem.allocate_tensor(cutlass.Int32, cute.make_layout(1), 4)
            # the token's k pair groups copied into shared memory (`cp.async`, all k in flight at once: loaded into
            # registers, ptxas keeps only 3 or 4 of them in flight, as in `RoutedNorm`, one L2 round trip after
            # another), the residual's old values and addends loaded meanwhile
            xbuf = smem.allocate_tensor(Float32, cute.make_layout(((1, 4), SPLIT_THREADS * self.terms)), 16)
            g = s * SPLIT_THREADS + tidx
            if g < self.groups:
                for j in cutlass.range_constexpr(self.terms):
                    copy_async_16(gX[(None, (row * self.terms + j, g))], xbuf[(None, j * SPLIT_THREADS + tidx)])
            cute.arch.cp_async_commit_group()
            old = cute.make_rmem_tensor((max(self.per_thread_h, 1),), Float32)
            inc = cute.make_rmem_tensor((max(self.per_thread_h, 1),), Float32)
            if cutlass.const_expr(self.H > 0):
                for i in cutlass.range_constexpr(self.per_thread_h):
                    c = s * self.cols_h + tidx + SPLIT_THREADS * i
                    old[i] = Float32(0.0)
                    inc[i] = Float32(0.0)
                    if c < self.H and tidx + SPLIT_THREADS * i < self.cols_h:
                        old[i] = res[row, c]
                        inc[i] = add[row, c].to(Float32)
            cute.arch.cp_async_wait_group(0)  # (each thread reads only the slots it copied into)
            acc = cute.make_rmem_tensor((4,), Float32)
            for c in cutlass.range_constexpr(4):
                acc[c] = Float32(0.0)
            if g < self.groups:
                for j in cutlass.range_constexpr(self.terms):  # the terms in a fixed order, as in `RoutedNorm`
                    v = load4(xbuf[(None, j * SPLIT_THREADS + tidx)])
                    for c in cutlass.range_constexpr(4):
                        acc[c] = acc[c] + v[c]
            ss = Float32(0.0)
            for c in cutlass.range_constexpr(4):
                ss = ss + acc[c] * acc[c]
            if cutlass.const_expr(self.H > 0):
                for i in cutlass.range_constexpr(self.per_thread_h):
                    c = s * self.cols_h + tidx + SPLIT_THREADS * i
                    if c < self.H and tidx + SPLIT_THREADS * i < self.cols_h:
                        res[row, c] = old[i] + inc[i]
            part = block_sum(ss, tidx, SPLIT_THREADS, red)
            if tidx == 0:
                parts[row * self.S + s] = part
            count_done(counters, row, tidx)  # this CTA's part is stored
            wait_count(counters, row, self.S, tidx)  # ... and every CTA's of the token
            total = Float32(0.0)
            for i in cutlass.range_constexpr(self.S):  # a fixed order: the same sum in every CTA and every run
                total = total + parts[row * self.S + i]
            scale = cute.math.rsqrt(total / Float32(self.W) + Float32(self.eps))
            if g < self.groups:
                for c in cutlass.range_constexpr(4):
                    if cutlass.const_expr(self.w_first):
                        out[row, 4 * g + c] = (acc[c] * scale * wr[c]).to(out.element_type)
                    else:
                        out[row, 4 * g + c] = (acc[c] * scale * w[4 * g + c]).to(out.element_type)
            # the token's last CTA to get past the wait sets its arrivals back to 0 (`last_cta` resets departures)
            if last_cta(counters, flag, tidx, self.S, self.cap + row) != 0:
                if tidx == 0:
                    counters[row] = cutlass.Int32(0)


def split_ctas(width: int) -> int:
    """CTAs per token of `RoutedNormSplit` for a row of `width` fp32 values: one 16-byte group per thread."""
    return -(-(width // 4) // SPLIT_THREADS)


def routed_norm_scratch(width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The split form's (counters, parts) for up to SPLIT_MAX_ROWS tokens: int32 counters, 0 between launches (the
    kernel leaves them so), and fp32 parts. Made once, outside any capture, and kept."""
    return (torch.zeros(2 * SPLIT_MAX_ROWS, dtype=torch.int32, device=device),
            torch.zeros(SPLIT_MAX_ROWS * split_ctas(width), dtype=torch.float32, device=device))


def routed_norm(pairs: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float,
                residual: tuple[torch.Tensor, torch.Tensor] | None = None,
                split: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """out = RMSNorm(pairs.sum(1)) * weight: pairs [B, k, W] fp32 or bf16 (each token's k expert outputs, contiguous,
    W a multiple of 4; summed in fp32), weight [W] fp32 -> out [B, W] bf16, written in place. With `residual` = (res
    [B, H] fp32, addend [B, H] bf16) the same kernel also does res += addend. With `split` =
    `routed_norm_scratch(W, device)` each token runs on `split_ctas(W)` CTAs (`RoutedNormSplit`, fp32 pairs) instead
    of one."""
    if pairs.dim() != 3 or pairs.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != torch.float32 \
            or out.dtype != torch.bfloat16:
        raise ValueError("routed_norm: fp32 or bf16 pairs [B, k, W], fp32 weight and bf16 out expected")
    if split is not None and pairs.dtype != torch.float32:
        raise ValueError("routed_norm: the split form takes fp32 pairs")
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
    if split is not None:
        return _routed_norm_split(x, weight, out, res, add, float(eps), k, hidden, split)
    first = norm_weight_first(B)
    key = ("routed_norm", float(eps), k, hidden, first, *signature(x, weight, out, res, add))
    fn = compile_kernel(key, RoutedNorm(W, float(eps), k, hidden, first),
                        *(fake_like(t, align=16 if t is x else 4) for t in (x, weight, out, res, add)))
    launch(fn, x, weight, out, res, add, align=lambda t: 16 if t is x else 4)
    return out


def _routed_norm_split(x, weight, out, res, add, eps: float, k: int, hidden: int, split) -> torch.Tensor:
    counters, parts = split
    B, W = out.shape
    S = split_ctas(W)
    if (counters.dtype != torch.int32 or parts.dtype != torch.float32 or counters.numel() < 2 * B
            or parts.numel() < B * S or not (counters.is_contiguous() and parts.is_contiguous())):
        raise ValueError("routed_norm: split must be routed_norm_scratch's (int32 counters, fp32 parts) for the rows")
    if B * S > SPLIT_MAX_CTAS_PER_SM * sm_count(out.device):
        raise ValueError(f"routed_norm: {B} rows need {B * S} CTAs resident at once, more than "
                         f"{SPLIT_MAX_CTAS_PER_SM} per SM on this GPU")
    first = norm_weight_first(B)
    key = ("routed_norm_split", eps, k, hidden, first, *signature(x, weight, out, res, add, counters, parts))
    fn = compile_kernel(key, RoutedNormSplit(W, eps, k, hidden, counters.numel() // 2, first),
                        *(fake_like(t, align=16 if t is x else 4) for t in (x, weight, out, res, add, counters, parts)))
    launch(fn, x, weight, out, res, add, counters, parts, align=lambda t: 16 if t is x else 4)
    return out


def rmsnorm_rows(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> torch.Tensor:
    """out = RMSNorm(x) * weight, x [B, W] fp32, weight [W] fp32 -> out [B, W] bf16, written in place."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or out.dtype != torch.bfloat16:
        raise ValueError("rmsnorm_rows: fp32 x and weight, bf16 out expected")
    if out.shape != x.shape or weight.shape != (x.shape[1],) or not (x.is_contiguous() and out.is_contiguous()):
        raise ValueError("rmsnorm_rows: contiguous x and out of one shape, weight of the row width expected")
    first = norm_weight_first(x.shape[0])
    key = ("rmsnorm_rows", float(eps), first, *signature(x, weight, out))
    fn = compile_kernel(key, RMSNormRows(x.shape[1], float(eps), first),
                        *(fake_like(t, align=4) for t in (x, weight, out)))
    launch(fn, x, weight, out, align=4)
    return out
