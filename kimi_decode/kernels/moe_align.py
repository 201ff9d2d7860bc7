"""The grouped experts' alignment in one CTA by counting, and the latent's fp16 mma operands in the other CTAs.

`moe_align` writes what `triton_kernels.moe_align` writes (the pairs sorted by expert, stably, and per distinct expert
in ascending order its segment's start, length and id; the other segment slots have length 0), for up to THREADS
pairs, without a sort: thread p of CTA 0 adds 1 to its expert's count in shared memory (`atom.shared.add`, whose
return value is p's place among its expert's pairs in whatever order the atomics ran), one scan over the experts'
counts gives every expert its start and its segment (the count of non-empty experts before it, both in one packed
int32: counts in the low 16 bits, non-empty experts in the high 16), and each pair takes its place. The atomics'
order is then made the pairs' order: each pair counts the pairs of its segment with a smaller index (segments are at
most the batch long), so the result is the one a stable sort gives, independent of timing.

The Triton kernel sorts 2**k keys in one program (a bitonic network of 55 steps at 1,024 pairs) with three round trips
through global memory between its steps; here the steps are one shared-memory pass each.

With `latent` and `operands`, CTAs 1.. turn the latent [B, L] bf16 into the grouped w13 kernel's fp16 operand order
(`moe_mxfp4_grouped.latent_operands`: 16 bytes per thread), beside the alignment and in the same launch, so that the
w13 kernel loads its operands as they are instead of converting them in every CTA of every row block.
"""
from __future__ import annotations

import torch

from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, fake_like, launch, signature
from .moe_mxfp4 import _words

THREADS = 1024  # pairs per alignment (one per thread of CTA 0); batch 64 x top-16
PACK = 16  # counts in bits 0..15 of a packed scan value (at most THREADS), non-empty experts above
MAX_BINS = 8  # experts per scan thread: two int32 per expert of shared memory, 64 KB at 8

if HAVE_CUTE:
    from cutlass import Int32

    from .cute_common import atomic_add_u32, pdl_launch_dependents, pdl_wait
    from .moe_mxfp4 import select_i32, store_operands

    class MoEAlign:
        """ids [P] -> order, seg_start, seg_len, seg_expert [P] (CTA 0); latent words -> operand words (CTAs 1..)."""

        def __init__(self, pairs: int, experts: int, units: int):
            """`units`: 16-byte groups of the latent to convert (B * L / 8), 0 for none."""
            self.P, self.E, self.units = pairs, experts, units
            self.bins = -(-experts // THREADS)  # experts per thread in the scan, consecutive
            self.convert_ctas = -(-units // THREADS)

        @cute.jit
        def __call__(self, ids: cute.Tensor, order: cute.Tensor, seg_start: cute.Tensor, seg_len: cute.Tensor,
                     seg_expert: cute.Tensor, x: cute.Tensor, xo: cute.Tensor, stream):
            gX, gO = x, xo  # without the conversion: stand-ins of any shape, never read
            if cutlass.const_expr(self.units > 0):
                gX = cute.zipped_divide(x, (1, 4))  # int32 pairs of bf16: ((1,4), (B, L/8))
                gO = cute.zipped_divide(xo, (1, 4))
            self.kernel(ids, order, seg_start, seg_len, seg_expert, gX, gO).launch(
                grid=[1 + self.convert_ctas, 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, ids: cute.Tensor, order: cute.Tensor, seg_start: cute.Tensor, seg_len: cute.Tensor,
                   seg_expert: cute.Tensor, gX: cute.Tensor, gO: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bx, _, _ = cute.arch.block_idx()
            pdl_launch_dependents(self.pdl)
            pdl_wait(self.pdl)
            smem = cutlass.utils.SmemAllocator()
            count = smem.allocate_tensor(Int32, cute.make_layout(self.bins * THREADS), 16)
            first = smem.allocate_tensor(Int32, cute.make_layout(self.bins * THREADS), 16)
            placed = smem.allocate_tensor(Int32, cute.make_layout(THREADS), 16)
            warp_sums = smem.allocate_tensor(Int32, cute.make_layout(THREADS // 32), 16)
            if bx == 0:
                self.align(ids, order, seg_start, seg_len, seg_expert, count, first, placed, warp_sums, tidx)
            else:
                if cutlass.const_expr(self.units > 0):
                    self.convert(gX, gO, (bx - 1) * THREADS + tidx)

        @cute.jit
        def align(self, ids: cute.Tensor, order: cute.Tensor, seg_start: cute.Tensor, seg_len: cute.Tensor,
                  seg_expert: cute.Tensor, count: cute.Tensor, first: cute.Tensor, placed: cute.Tensor,
                  warp_sums: cute.Tensor, tidx):
            warp, lane = tidx // 32, tidx % 32
            for j in cutlass.range_constexpr(self.bins):
                count[tidx * self.bins + j] = Int32(0)
            inside = tidx < self.P
            e = ids[select_i32(inside, tidx, 0)]
            cute.arch.barrier()
            rank = Int32(0)
            if inside:
                rank = atomic_add_u32(count, 1, e)
            cute.arch.barrier()
            # this thread's experts (bins consecutive ones): counts and non-empty flags, packed
            mine = Int32(0)
            for j in cutlass.range_constexpr(self.bins):
                c = count[tidx * self.bins + j]
                mine = mine + c + (select_i32(c > 0, 1, 0) << PACK)
            scan = mine  # inclusive over the warp
            for d in cutlass.range_constexpr(5):
                up = cute.arch.shuffle_sync_up(scan, offset=1 << d, mask_and_clamp=0)  # (4.3.5 defaults to 31)
                scan = scan + select_i32(lane >= (1 << d), up, 0)
            if lane == 31:
                warp_sums[warp] = scan
            cute.arch.barrier()
            before = Int32(0)  # the warps before this one, packed
            total = Int32(0)
            for w in cutlass.range_constexpr(THREADS // 32):
                s = warp_sums[w]
                before = before + select_i32(w < warp, s, 0)
                total = total + s
            at = before + scan - mine  # exclusive: the experts before this thread's first
            for j in cutlass.range_constexpr(self.bins):
                b = tidx * self.bins + j
                c = count[b]
                start = at & ((1 << PACK) - 1)
                first[b] = start
                if c > 0:
                    s = at >> PACK
                    seg_start[s] = start
                    seg_len[s] = c
                    seg_expert[s] = b
                at = at + c + (select_i32(c > 0, 1, 0) << PACK)
            segments = total >> PACK
            cute.arch.barrier()
            start = Int32(0)
            length = Int32(0)
            if inside:
                start = first[e]
                length = count[e]
                placed[start + rank] = tidx
            cute.arch.barrier()
            if inside:
                stable = Int32(0)  # the pairs of this expert before this one: its place in a stable sort
                for i in cutlass.range(length):
                    stable = stable + select_i32(placed[start + i] < tidx, 1, 0)
                order[start + stable] = tidx
                if tidx >= segments:
                    seg_start[tidx] = Int32(0)
                    seg_len[tidx] = Int32(0)
                    seg_expert[tidx] = Int32(0)

        @cute.jit
        def convert(self, gX: cute.Tensor, gO: cute.Tensor, u):
            """16-byte group u of the latent (8 bf16) -> its 4 fp16x2 mma operands."""
            if u < self.units:
                groups = gX.shape[1][1]
                b, c = u // groups, u % groups
                store_operands(gX[(None, (b, c))], gO[(None, (b, c))])


def moe_align(ids: torch.Tensor, order: torch.Tensor, seg_start: torch.Tensor, seg_len: torch.Tensor,
              seg_expert: torch.Tensor, experts: int, latent: torch.Tensor | None = None,
              operands: torch.Tensor | None = None) -> None:
    """ids [P] int32 (P <= THREADS, every id below `experts`) -> order, seg_start, seg_len, seg_expert [P] int32,
    written in place as `triton_kernels.moe_align` writes them (and segment slots past the distinct experts all 0).
    With `latent` [B, L] bf16, also `operands` [B, L] fp16 = `latent_operands(latent)`, in the same launch."""
    P = ids.numel()
    outs = (order, seg_start, seg_len, seg_expert)
    if P > THREADS or P == 0:
        raise ValueError(f"moe_align (CuTe): 1 to {THREADS} pairs per call, got {P}")
    if not 1 <= experts <= MAX_BINS * THREADS:
        raise ValueError(f"moe_align (CuTe): 1 to {MAX_BINS * THREADS} experts, got {experts}")
    if ids.dtype != torch.int32 or any(t.shape != (P,) or t.dtype != torch.int32 for t in outs):
        raise ValueError("moe_align (CuTe): ids and the four outputs must be int32 [pairs]")
    if not all(t.is_contiguous() for t in (ids, *outs)):
        raise ValueError("moe_align (CuTe): inputs must be contiguous")
    if (latent is None) != (operands is None):
        raise ValueError("moe_align (CuTe): latent and operands go together")
    if latent is not None:
        if latent.dtype != torch.bfloat16 or operands.dtype != torch.float16 or operands.shape != latent.shape:
            raise ValueError("moe_align (CuTe): latent bf16 and operands fp16 of one shape [B, L]")
        if latent.dim() != 2 or latent.shape[1] % 8 or not (latent.is_contiguous() and operands.is_contiguous()):
            raise ValueError("moe_align (CuTe): latent [B, L] contiguous, L a multiple of 8")
        x, xo = _words(latent), _words(operands)
    else:  # stand-ins, never read
        x = xo = ids.view(1, P)
    units = latent.numel() // 8 if latent is not None else 0
    ids = ids.reshape(-1)
    args = (ids, order, seg_start, seg_len, seg_expert, x, xo)
    fn = compile_kernel(("moe_align", experts, units, *signature(*args)), MoEAlign(P, experts, units),
                        *(fake_like(t, align=16 if t.dim() == 2 and units else 4) for t in args))
    launch(fn, *args, align=lambda t: 16 if t.dim() == 2 and units else 4)
