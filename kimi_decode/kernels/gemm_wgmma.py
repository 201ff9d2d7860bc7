"""Projection for 17 to 64 rows on the warpgroup mma: y[m, n] = sum_k x[m, k] * W[n, k], bf16 in, fp32 accumulate.

Above 16 tokens the `mma.sync` projections (`gemm_tc.py`, `gemm_tc_rows.py`) issue an mma and a shared or global
activation load per 8 tokens for every 16 weight rows and 16 k, so their instructions, not the weight bytes, bound
them (benchmarks/NOTES.md, items 10 and 70), and cuBLAS launches one CTA per 64-row tile: 40-112 CTAs for 132 SMs
(item 62). Here one `wgmma.mma_async m64nNk16` serves all the tokens (N = 8 x ceil(M / 8), up to 64) for 64 weight
rows and 16 k, and the split-K plan fills every SM.

Both operands from shared memory. A CTA's `wgs` warpgroups each own 64 weight rows; the CTA streams its rows' and
its tokens' K slice through `stages` shared-memory buffers of KS = 64 k each with 16-byte `cp.async` (a multistage
pipeline: `stages - 1` buffers in flight while the warpgroups multiply the oldest), so the weights never pass
through registers and the loads in flight per SM are as deep as the buffers. Each buffer holds the rows and the
tokens K-major in the 128-byte swizzle: a row's KS k are one 128-byte line, its 16-byte column c at position
c ^ (row % 8), blocks of 8 rows SBO = 1024 bytes apart; a k16 step's descriptor starts 32 bytes further into the
line and the hardware applies the same swizzle. Eight lanes copy one row (lane: row lane // 8, column lane % 8),
so they read 128 contiguous bytes and write one whole line of shared memory, all 32 banks. The layout without
swizzle (core matrices of 8 rows x 16 bytes, so the two halves of every global sector land 128 bytes apart in
shared memory) made each lane's 16-byte copy an L2 request and a shared-memory wavefront of its own, 32 per warp
instead of 16 and 4, and the copies' issue stalled behind them (NOTES item 111). The stage's KS / 16 wgmma are issued,
committed and waited for in one asm block, so the buffer is free for the copies that the next iteration issues
after its CTA barrier (leaving one stage's wgmma in flight while the next stage's copies issue was no faster: NOTES
item 112). Tokens past M are not copied: their columns of D are not stored, and a column of D reads only its own
column of B; rows past N read row N - 1 and are not stored.

The K splits of a row group run as one thread-block cluster (at most MAX_SPLITS CTAs), which adds its partial sums
in shared memory: each CTA stores each of its accumulators into the shared buffer of the CTA that owns the token
(token m belongs to the CTA of rank m % splits; `st.shared::cluster`), one cluster barrier, then each CTA adds its
tokens' partial sums in split order and stores them (each token scaled by its 1/rms first where the projection has
a row scale; added to y and the addend, which each thread loads for its outputs while the first stages' copies are
in flight, where it accumulates). With one split the CTA's own buffer and a CTA barrier do it. The
split-K `mma.sync` kernel's finish (partial sums to a global workspace, a counter, and the last CTA reading them
back) held 41% of o_proj's stall samples at one split and ~60% at two (NOTES item 112); the counters the launch
passes are not used here, and its workspace is a placeholder (`WgmmaPlan.workspace_shape`).

With `glu` (the shared experts' gate/up, W = [gate; up] with 2I rows, y [M, I]) a CTA's 64 rows are 32 gate rows and
the same 32 up rows (I further on), so that the thread finishing gate output (m, j) adds up row j's partial sums from
its own CTA too and stores SiTU-GLU(gate, up): the activation comes out of the projection, one kernel and one round
trip of [M, 2I] fp32 fewer than a SiTU-GLU kernel after it.
"""
from __future__ import annotations

import functools

import torch

from .cute_common import DEFAULT_SMS, HAVE_CUTE, cute, cutlass, sm_count
# `from .gemm_tc import ...` only: cutlass-dsl 4.3.5's preprocessor cannot re-import `from . import gemm_tc`.
from .gemm_tc import check_projection, compile_split_k, run_split_k

MIN_ROWS, MAX_ROWS = 2, 64
MAX_SPLITS = 8  # CTAs of a row group's cluster: the portable cluster size
ROWS = 64  # weight rows per warpgroup: the wgmma's M
KS = 64  # k per pipeline stage (4 wgmma k16 steps)
STAGES = 4  # shared-memory buffers of the pipeline
STAGE_CHOICES = (3, 4, 6, 8)  # the buffer counts `benchmarks/projection_sweep.py` times beside the plan's
LINE = KS * 2  # bytes of one row's stage: a 128-byte swizzle line
SBO = 8 * LINE  # bytes between 8-row (or 8-token) blocks
STEP = 32  # bytes of k of one k16 step within a line
SWIZZLE_128B = 1 << 30  # the descriptor's layout type (bits 62-63 = 1: 128-byte swizzle) in its high word
SMEM_LIMIT = 200 * 1024

if HAVE_CUTE:
    from cutlass import Float32, Int32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    from .cute_common import copy_async_16, mma_lanes, situ_glu, store_cluster_f32
    from .gemm_tc import TensorCoreProjection, row_scales
    from .gemv import preload_output, store_preloaded

    @functools.cache
    def _wgmma_asm(cols: int) -> str:
        """One stage of a warpgroup's 64 rows against `cols` tokens: KS / 16 `wgmma m64n{cols}k16` accumulating into
        the cols / 2 outputs (tied to the first cols / 2 inputs), step s's A and B descriptors' low words the
        inputs after those (A0, B0, A1, B1, ...; high words SBO / 16 and the 128-byte swizzle), then committed and
        waited for."""
        na, steps = cols // 2, KS // 16
        acc = ", ".join(f"${i}" for i in range(na))  # the outputs; $na..$2na-1 are the same values as inputs
        op = f"wgmma.mma_async.sync.aligned.m64n{cols}k16.f32.bf16.bf16"
        lines = ["{", " .reg .b64 da, db;", " .reg .b32 hi;", " .reg .pred p;",
                 f" mov.b32 hi, {(SBO >> 4) | SWIZZLE_128B};", f" setp.eq.b32 p, ${2 * na}, ${2 * na};",
                 " wgmma.fence.sync.aligned;"]
        for s in range(steps):
            a, b = 2 * na + 2 * s, 2 * na + 2 * s + 1
            lines += [f" mov.b64 da, {{${a}, hi}};", f" mov.b64 db, {{${b}, hi}};",
                      f" {op} {{{acc}}}, da, db, p, 1, 1, 0, 0;"]
        lines += [" wgmma.commit_group.sync.aligned;", " wgmma.wait_group.sync.aligned 0;", "}"]
        return "\n".join(lines)

    def wgmma_stage(acc, desc_a, desc_b, cols: int) -> None:
        """acc (cols / 2 fp32 registers, the D fragment) += one stage: the 64 x KS rows whose descriptor's low word
        is `desc_a` against the cols x KS tokens at `desc_b` (each step STEP bytes further into the lines), done
        when it returns. Every warp of the warpgroup calls it together."""
        na = cols // 2
        lows = []
        for s in range(KS // 16):
            lows += [desc_a + s * (STEP >> 4), desc_b + s * (STEP >> 4)]
        res = llvm.inline_asm(
            llvm.StructType.get_literal([T.f32()] * na),
            [Float32(acc[i]).ir_value() for i in range(na)] + [Int32(v).ir_value() for v in lows],
            _wgmma_asm(cols), ",".join(["=f"] * na + [str(i) for i in range(na)] + ["r"] * len(lows)),
            has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
        for i in range(na):
            acc[i] = Float32(llvm.extractvalue(T.f32(), res, [i]))

    def swizzled_unit(row, col):
        """The 16-byte unit of a stage buffer that holds 16-byte column `col` of its row `row` in the 128-byte
        swizzle the descriptors name: the row's line, the column's position in it XOR the row's place in its 8."""
        return row * (KS // 8) + (col ^ (row % 8))

    def desc_low(buf: cute.Tensor):
        """The low word of a shared-memory matrix descriptor of shared tensor `buf`'s start (1024-byte aligned, as
        the swizzle needs): its address / 16 in bits 0-13; the leading byte offset (bits 16-29) is unused by a
        K-major swizzled operand whose k16 step lies within one line, and set to 1."""
        return ((Int32(buf.iterator.toint()) & 0x3FFFF) >> 4) | (1 << 16)

    class WgmmaProjection(TensorCoreProjection):
        """The projection's epilogue settings as the split-K `mma.sync` projection's, with the kernel below,
        launched as a grid of row groups x splits, 32 x `plan.warps` threads per CTA, each row group's splits one
        cluster."""

        @cute.jit
        def start(self, gW: cute.Tensor, gX: cute.Tensor, mY: cute.Tensor, mAdd: cute.Tensor, mSsq: cute.Tensor,
                  mWs: cute.Tensor, mCnt: cute.Tensor, stream):
            """The kernel's launch, each row group's splits one cluster (the workspace and counters unused)."""
            p = self.p
            self.kernel(gW, gX, mY, mAdd, mSsq).launch(grid=[p.groups, p.splits, 1], block=[32 * p.warps, 1, 1],
                                                       cluster=[1, p.splits, 1], stream=stream)

        @cute.kernel
        def kernel(self, gW: cute.Tensor, gX: cute.Tensor, mY: cute.Tensor, mAdd: cute.Tensor, mSsq: cute.Tensor):
            p = self.p
            tidx, _, _ = cute.arch.thread_idx()
            bx, bs, _ = cute.arch.block_idx()
            warp, lane, g, t = mma_lanes(tidx)
            smem = cutlass.utils.SmemAllocator()
            # per stage: the CTA's rows, then its tokens, 16-byte units in the 128-byte swizzle (`swizzled_unit`)
            sW = smem.allocate_tensor(Int32, cute.make_layout(((1, 4), p.stages * p.w_units)), 1024)
            sX = smem.allocate_tensor(Int32, cute.make_layout(((1, 4), p.stages * p.x_units)), 1024)
            # the partial sums of this CTA's tokens, one slice per split: [split, token // splits, row]
            red = smem.allocate_tensor(Float32, cute.make_layout(p.splits * p.owned), 16)
            rs = smem.allocate_tensor(Float32, cute.make_layout(p.cols), 16)
            if cutlass.const_expr(p.splits > 1):
                cute.arch.cluster_arrive_relaxed()  # waited for before the first store into another CTA's memory
            kb0 = bs * p.per_split  # this split's first stage of K
            nkb = Int32(p.per_split)
            if p.blocks - kb0 < nkb:
                nkb = p.blocks - kb0

            ahead = p.stages - 1  # stages whose copies are in flight beside the one multiplied
            for s in cutlass.range_constexpr(ahead):
                if s < nkb:
                    self.load_stage(gW, gX, sW, sX, tidx, bx, kb0 + s, s)
                cute.arch.cp_async_commit_group()
            # with the first stages' copies in flight: y and the addend of this thread's outputs (`finish_outputs`), so
            # that the epilogue's read-modify-writes wait for no load after the loop
            outs = self.finish_outputs(tidx, bx, bs)
            pre = cute.make_rmem_tensor((2 * len(outs),), Float32)
            if cutlass.const_expr(self.accumulate):
                for i in cutlass.range_constexpr(len(outs)):
                    o, _, m, n = outs[i]
                    if o < p.outputs and m < p.M and n < p.n_out:
                        preload_output(mY, mAdd, m, n, pre, i, self.addend)
            acc = cute.make_rmem_tensor((p.cols // 2,), Float32)
            acc.fill(0.0)
            wg = warp // 4
            lo_w = desc_low(sW) + wg * (8 * SBO >> 4)  # this warpgroup's 64 rows: row blocks 8 wg..
            lo_x = desc_low(sX)
            for kb in cutlass.range(nkb):
                # This thread's copies of stage kb, then every thread's. No `fence.proxy.async` (as CUTLASS's
                # cp.async wgmma mainloop has none): ptxas makes it a `MEMBAR.ALL.CTA`, which waits for the copies
                # still in flight too, so that each stage waited for a whole memory round trip (NOTES item 109).
                cute.arch.cp_async_wait_group(ahead - 1)
                # every thread's, and every warpgroup done with the buffer refilled next: stage kb - 1's, whose wgmma
                # each warp waited for at the end of its last iteration
                cute.arch.barrier()
                nxt = kb + ahead
                if nxt < nkb:
                    self.load_stage(gW, gX, sW, sX, tidx, bx, kb0 + nxt, nxt % p.stages)
                cute.arch.cp_async_commit_group()  # (an empty group at the end: the counts stay even)
                slot = kb % p.stages
                wgmma_stage(acc, lo_w + slot * (p.w_units * 16 >> 4), lo_x + slot * (p.x_units * 16 >> 4), p.cols)

            # accumulators -> `red` of the token's CTA (rank m % splits): D rows 16q + g and + 8 of the CTA's rows
            # for its warp q, tokens 8i + 2t and + 1
            rows = ROWS * p.wgs
            if cutlass.const_expr(p.splits > 1):
                cute.arch.cluster_wait()
            for i in cutlass.range_constexpr(p.tiles):
                for h in cutlass.range_constexpr(2):
                    for d in cutlass.range_constexpr(2):
                        m = i * 8 + 2 * t + d
                        if m < p.M:
                            at = bs * p.owned + (m // p.splits) * rows + warp * 16 + g + 8 * h
                            if cutlass.const_expr(p.splits > 1):
                                store_cluster_f32(red, at, m % p.splits, acc[4 * i + 2 * h + d])
                            else:
                                red[at] = acc[4 * i + 2 * h + d]
            if cutlass.const_expr(self.scaled):  # this CTA's tokens' 1/rms, from the partial sums of squares
                row_scales(self, mSsq, rs, bs + p.splits * warp, p.splits * p.warps, lane)
            if cutlass.const_expr(p.splits > 1):  # every CTA's stores into this one's `red` done and visible
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
            else:
                cute.arch.barrier()
            # this CTA's tokens m = rank + splits j: the splits' sums in split order, then the epilogue; a thread a row
            # (with `glu` a gate row, and the up row `p.width` further in `red`)
            for i in cutlass.range_constexpr(len(outs)):
                o, e, m, n = outs[i]
                if o < p.outputs and m < p.M and n < p.n_out:
                    tot = red[e]
                    for s in cutlass.range_constexpr(1, p.splits):
                        tot = tot + red[s * p.owned + e]
                    if cutlass.const_expr(p.glu):
                        up = red[e + p.width]
                        for s in cutlass.range_constexpr(1, p.splits):
                            up = up + red[s * p.owned + e + p.width]
                        mY[m, n] = situ_glu(tot, up).to(mY.element_type)
                    else:
                        if cutlass.const_expr(self.scaled):
                            tot = tot * rs[m]
                        store_preloaded(mY, mAdd, m, n, tot, pre, i, self.accumulate, self.addend)

        def finish_outputs(self, tidx, bx, bs):
            """The outputs thread `tidx` of the CTA at row group `bx`, split `bs` finishes, one per CTA-wide step: (o,
            e, token m, column n), o its index among the CTA's outputs (none where o >= `plan.outputs`), e its
            (gate) row's place in `red`'s first slice; consecutive threads on consecutive columns of one of the CTA's
            tokens m = bs + splits j."""
            p = self.p
            rows = ROWS * p.wgs
            width = p.width
            outs = []
            for i in range(-(-p.outputs // (32 * p.warps))):
                o = tidx + i * 32 * p.warps
                e = o if width == rows else (o // width) * rows + o % width
                outs.append((o, e, bs + p.splits * (o // width), bx * width + o % width))
            return outs

        @cute.jit
        def load_stage(self, gW: cute.Tensor, gX: cute.Tensor, sW: cute.Tensor, sX: cute.Tensor, tidx: Int32,
                       bx: Int32, kb: Int32, slot: Int32):
            """`cp.async` of K stage `kb` (k = KS kb..) of the CTA's rows and of every token into buffer `slot`:
            16-byte column c of row r at unit r * 8 + (c ^ (r % 8)) of the buffer (the 128-byte swizzle), a warp's
            32 copies the 8 columns of 4 rows: row 4 (its copy) + lane // 8, column lane % 8."""
            p = self.p
            units = KS // 8  # 16-byte columns of a row's line
            lane = tidx % 32
            r4 = lane // units
            c = lane % units
            half = ROWS * p.wgs // 2
            for u in cutlass.range_constexpr(p.w_units // (128 * p.wgs)):
                r = (u * 4 * p.wgs + tidx // 32) * 4 + r4  # this warp's copy u * 4 wgs + warp
                row = bx * (ROWS * p.wgs) + r
                if cutlass.const_expr(p.glu):  # the group's gate rows, then the same up rows (N / 2 further on)
                    row = bx * half + r % half + (r // half) * (p.N // 2)
                if row >= p.N:
                    row = Int32(p.N - 1)
                copy_async_16(gW[(None, (row, kb * units + c))], sW[(None, slot * p.w_units + swizzled_unit(r, c))])
            for v in cutlass.range(tidx // 32, p.x_units // 32, 4 * p.wgs):
                m = v * 4 + r4
                if m < p.M:
                    copy_async_16(gX[(None, (m, kb * units + c))], sX[(None, slot * p.x_units + swizzled_unit(m, c))])


class WgmmaPlan:
    """Tiling of one projection shape: `wgs` warpgroups of 64 rows per CTA, K in `splits` slices of `per_split`
    stages of KS, `stages` buffers in the pipeline (`stages - 1` of them in flight); `glu`: the SiTU-GLU epilogue,
    each row group half gate rows and half the same up rows (N a multiple of the CTA's rows, `glu_fits`)."""

    def __init__(self, M: int, N: int, K: int, wgs: int, splits: int, stages: int = STAGES, glu: bool = False):
        if stages < 2:
            raise ValueError(f"the pipeline needs at least 2 stages, got {stages}")
        if not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"a row group's splits are one cluster of 1 to {MAX_SPLITS} CTAs, got {splits}")
        if glu and not glu_fits(N, wgs):
            raise ValueError(f"the SiTU-GLU epilogue needs N a multiple of {ROWS * wgs}, got {N}")
        self.M, self.N, self.K, self.wgs, self.stages, self.glu = M, N, K, wgs, stages, glu
        self.n_out = N // 2 if glu else N  # y's columns
        self.tiles = -(-M // 8)  # 8-token blocks: the wgmma's N is 8 x tiles
        self.cols = 8 * self.tiles
        self.blocks = K // KS
        self.per_split = -(-self.blocks // splits)
        self.splits = -(-self.blocks // self.per_split)  # every split non-empty
        self.groups = -(-N // (ROWS * wgs))
        self.w_units = ROWS * wgs * KS // 8  # 16-byte units of one stage's rows
        self.x_units = self.cols * KS // 8
        self.owned = -(-M // self.splits) * ROWS * wgs  # partial sums of one split for the tokens a CTA finishes
        self.width = ROWS * wgs // 2 if glu else ROWS * wgs  # outputs per token of a row group (glu: its gate rows)
        self.outputs = self.owned // (ROWS * wgs) * self.width  # outputs a CTA finishes: its tokens x width

    @property
    def smem_bytes(self) -> int:
        return self.stages * (self.w_units + self.x_units) * 16 + 1024 + self.splits * self.owned * 4 + self.cols * 4

    @property
    def ctas(self) -> int:
        return self.groups * self.splits

    @property
    def warps(self) -> int:
        return 4 * self.wgs

    @property
    def workspace_shape(self) -> tuple:
        """The kernel's splits meet in shared memory: the launch's workspace is a placeholder of one 16-byte vector."""
        return (1, 1, 4)

    def key(self) -> tuple:
        return (self.M, self.N, self.K, self.wgs, self.splits, self.stages, self.glu)


def glu_fits(N: int, wgs: int = 1) -> bool:
    """Whether [gate; up] weights of N rows take the SiTU-GLU epilogue: whole row groups of `wgs` warpgroups, each
    half gate rows, half up rows."""
    return N % (ROWS * wgs) == 0


@functools.lru_cache(maxsize=None)
def wgmma_plan_for(M: int, N: int, K: int, sms: int = DEFAULT_SMS, glu: bool = False) -> WgmmaPlan:
    """One warpgroup per CTA, K in about as many splits as fill the SMs with one CTA each (the SMs / the row groups,
    rounded, 1 to MAX_SPLITS), and 8 stages where those CTAs fit in one wave, else 6. Fitted to the sweep of NOTES
    item 113 (H100, TP16, 64 rows: the best of the tilings timed at every shape; two warpgroups were slower at
    each)."""
    groups = -(-N // ROWS)
    splits = max(1, min(MAX_SPLITS, K // KS, round(sms / groups)))
    plan = WgmmaPlan(M, N, K, 1, splits, 8, glu)
    return plan if plan.ctas <= sms else WgmmaPlan(M, N, K, 1, splits, 6, glu)


def _check(w, x, y, accumulate: bool, addend, row_scale, counters, glu: bool = False) -> None:
    check_projection(w, x, y, accumulate, addend, row_scale, "wgmma projection", (MIN_ROWS, MAX_ROWS), 16, glu)
    if w.shape[1] % KS:
        raise ValueError(f"wgmma projection needs K a multiple of {KS}, got K={w.shape[1]}")
    if counters.dtype != torch.int32 or counters.dim() != 1 or not counters.is_contiguous():
        raise ValueError("counters must be a contiguous int32 vector")


def compile_wgmma_projection(w, x, y, ws, counters, accumulate: bool = False, addend=None, row_scale=None,
                             plan: WgmmaPlan | None = None, glu: bool = False):
    plan = plan or wgmma_plan_for(x.shape[0], w.shape[0], w.shape[1], sm_count(w.device), glu)
    return compile_split_k("gemm_wgmma", WgmmaProjection, plan, w, x, y, ws, counters, accumulate, addend,
                           row_scale)


def project_wgmma(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, counters: torch.Tensor,
                  accumulate: bool = False, addend: torch.Tensor | None = None, row_scale: tuple | None = None,
                  plan: WgmmaPlan | None = None, glu: bool = False) -> torch.Tensor:
    """y = x @ w.T, or y += x @ w.T (+ addend) with `accumulate`, on the current stream; the arguments are those of
    `gemm_tc.project` (`counters`: a contiguous int32 vector, which the shared split-K launch passes and this
    kernel, whose splits meet in the cluster's shared memory, never reads or writes; `plan`: another tiling, for
    benchmarks). `glu`: w is [gate; up] (2I rows, a multiple of 64) and y [M, I] bf16 = SiTU-GLU(x @ gate.T,
    x @ up.T), as `gemv.gemv(..., glu=True)`."""
    _check(w, x, y, accumulate, addend, row_scale, counters, glu)
    plan = plan or wgmma_plan_for(x.shape[0], w.shape[0], w.shape[1], sm_count(w.device), glu)
    if plan.glu != glu:
        raise ValueError("the plan's SiTU-GLU epilogue does not match glu")
    return run_split_k(compile_wgmma_projection, plan, "wgmma projection", w, x, y, counters, accumulate, addend,
                       row_scale)
