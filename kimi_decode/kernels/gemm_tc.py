"""Projection for batches of 2 to 64 rows on tensor cores: y[m, n] = sum_k x[m, k] * W[n, k], bf16 in, fp32 accumulate.

Decode projections are weight streams: the bytes of W are what costs, and at a few tokens the small-batch GEMV
(`gemv.py`) turns every weight into a float and multiplies it once per token on CUDA cores, which from about 4 rows
on costs more than the bytes. Here the multiplications run as `mma.sync m16n8k16` (bf16 operands, fp32
accumulators) with the weight rows as the 16-row A operand and the tokens as the 8 columns of B, so a warp's 16 rows
serve up to 64 tokens in 8 column tiles.

Work split: a CTA takes `warps` x 32 weight rows (each warp two 16-row tiles) and one K slice (split-K, so that the
few rows of the smaller projections still fill the GPU in one wave, several CTAs per SM where registers and shared
memory allow). It streams its weights from global memory with 16-byte loads: lane (g, t) = (lane // 4, lane % 4)
loads words t of a 32-wide K chunk for rows g and g + 8, i.e. weights 8t..8t+7, and the same 8 activations of token
g. The mma k-slots are assigned so that those pair up (the dot product does not care about the order of k), as in
the MXFP4 expert kernels. Up to 16 tokens ("direct") a warp reads x from global memory (the CTA's other warps hit
L1) and keeps PIPE chunks of loads in flight in register slots; above, the CTA first stages its K slice of all
tokens' x in shared memory (rows padded so the 16-byte reads of one quarter-warp fall in distinct banks). Each CTA
writes its partial sums to an fp32 workspace [splits, N, 8 * tiles]; the CTA of a row group that finishes last
(`cute_common.last_cta`, a completion counter per row group that resets itself) adds the splits in a fixed order, so
the result does not depend on which CTA finishes first, and runs the epilogue of `gemv.py`: store y (bf16 or fp32),
or add into an fp32 y with an optional bf16 addend, optionally scaling row m by an RMSNorm's 1/rms from partial sums
of squares.

On the H200 (benchmarks/NOTES.md, v10) it streams 2.6-2.8 TB/s on the 46-51 MB projections at 4-8 rows, 5-20% behind
cuBLAS's pipelined split-K GEMM, and falls further behind from 16 rows. `latency_specialized` runs the row-tile form
(`gemm_tc_rows.py`) up to 16 rows instead, which measured faster in every layer (NOTES item 47); this kernel stays
for A/B runs (`KIMI_DECODE_TC_FORM=split`) and for more rows than the row tiles take (`KIMI_DECODE_TC_MAX_ROWS`).
"""
from __future__ import annotations

import functools

import torch

from .cute_common import (DEFAULT_SMS, HAVE_CUTE, compile_kernel, cute, cutlass, fake_like, launch, signature,
                          sm_count)
from .gemv import check_epilogue, check_glu

MIN_ROWS, MAX_ROWS = 2, 64
CHUNK = 32  # K per mma step pair (16 int32 words: 4 lanes x 16 bytes per row)
SMEM_LIMIT = 200 * 1024  # bytes of staged activations per CTA
# per SM (sm_90): shared memory (with the 1 KB each CTA reserves), registers, threads
SM_SMEM, SM_REGS, SM_THREADS = 228 * 1024, 65536, 2048
WARPS_ENOUGH = 16  # resident warps per SM past which more do not stream faster (each keeps ~4 KB of loads in flight)
PARTIALS_LIMIT = 0.25  # workspace bytes (written and read back, L2-resident) at most this share of the weight bytes
DIRECT_TILES = 2  # column tiles (of 8 tokens) up to which x is read from global memory rather than staged
PIPE = 3  # K chunks of weight loads in flight per warp (direct mode): 3 x 2 KB per warp
GROUP_PARTIALS_LIMIT = 128 * 1024  # bytes of partial sums the last CTA of a row group reads back (its serial tail)

if HAVE_CUTE:
    from cutlass import Float32, Int32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    from .cute_common import last_cta, load4, mma_lanes
    from .gemv import store_output

    def mma_bf16(a0, a1, a2, a3, b0, b1, c):
        """One m16n8k16 bf16 mma with fp32 accumulators: a0..a3 / b0, b1 the int32 words of the A / B fragments,
        c the 4 accumulator values; returns the 4 new ones."""
        res = llvm.inline_asm(
            llvm.StructType.get_literal([T.f32(), T.f32(), T.f32(), T.f32()]),
            [Int32(v).ir_value() for v in (a0, a1, a2, a3, b0, b1)] + [Float32(v).ir_value() for v in c],
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9},"
            " {$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False, is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT)
        return [Float32(llvm.extractvalue(T.f32(), res, [i])) for i in range(4)]

    def mma_chunk(acc, a, lo, hi, xs) -> None:
        """acc[a..a+3] += one 32-wide K chunk of a 16-row tile against 8 tokens: two mma, lo / hi the 16-byte words of
        rows g / g + 8 (weights 8t..8t+7), xs the same activations of token g (inlined where it is called)."""
        d = mma_bf16(lo[0], hi[0], lo[1], hi[1], xs[0], xs[1], [acc[a + i] for i in range(4)])
        d = mma_bf16(lo[2], hi[2], lo[3], hi[3], xs[2], xs[3], d)
        for i in range(4):
            acc[a + i] = d[i]

    def fetch_chunk(gW, gX, rows, toks, kv, wb, xb) -> None:
        """The 16-byte vectors `kv` of a warp's weight rows and of its tokens' x, into the register tensors wb / xb."""
        for q in range(len(rows)):
            cute.autovec_copy(gW[(None, (rows[q], kv))], wb[q])
        for nt in range(len(toks)):
            cute.autovec_copy(gX[(None, (toks[nt], kv))], xb[nt])

    @cute.jit
    def row_scales(op, mSsq: cute.Tensor, rs: cute.Tensor, first, step, lane: Int32):
        """rs[m] = 1/rms of token m for m = first, first + step, .. < M, one warp a token (`first` the warp's first,
        `step` the warps' stride), from the partial sums of squares in mSsq [M, op.parts] (`op`: a projection with a
        row scale: plan `p`, `parts`, `eps`)."""
        for m in cutlass.range(first, op.p.M, step):
            ssq = Float32(0.0)
            for i in cutlass.range_constexpr(-(-op.parts // 32)):
                if lane + 32 * i < op.parts:
                    ssq = ssq + mSsq[m, lane + 32 * i]
            ssq = cute.arch.warp_reduction(ssq, lambda a, b: a + b)
            if lane == 0:
                rs[m] = cute.math.rsqrt(ssq / Float32(op.p.K) + Float32(op.eps))

    @cute.jit
    def finish_group(op, mY: cute.Tensor, mAdd: cute.Tensor, mSsq: cute.Tensor, gWs: cute.Tensor, rs: cute.Tensor,
                     n: Int32, warp: Int32, lane: Int32, warps: int):
        """A row group's epilogue, in its last CTA, weight row `n` in this thread (none past N): the splits' partial
        sums (`gWs`, fp32 [split, row, token] in 16-byte vectors) added in split order, then the store of
        `gemv.store_output`, each token's sum scaled by its 1/rms first where `op.scaled` (from the partial sums of
        squares in mSsq, computed by the CTA's `warps` warps into `rs`). `op`: the projection (plan `p`, its epilogue
        flags, `parts`, `eps`)."""
        p = op.p
        if cutlass.const_expr(op.scaled):
            row_scales(op, mSsq, rs, warp, warps, lane)
            cute.arch.barrier()
        if n < p.N:
            for j in cutlass.range_constexpr(-(-p.M // 4)):
                tot = cute.make_rmem_tensor((4,), Float32)
                tot.fill(0.0)
                for s in cutlass.range_constexpr(p.splits):  # unrolled: all the loads in flight at once
                    v = load4(gWs[(None, (s, n, j))])
                    for i in cutlass.range_constexpr(4):
                        tot[i] = tot[i] + v[i]
                for i in cutlass.range_constexpr(4):
                    m = j * 4 + i
                    if cutlass.const_expr(m < p.M):
                        val = tot[i]
                        if cutlass.const_expr(op.scaled):
                            val = val * rs[m]
                        store_output(mY, mAdd, m, n, val, op.accumulate, op.addend)

    class TensorCoreProjection:
        def __init__(self, plan: "Plan", accumulate: bool, addend: bool, scaled: bool, parts: int, eps: float):
            self.p = plan
            self.accumulate, self.addend, self.scaled, self.parts, self.eps = accumulate, addend, scaled, parts, eps

        @cute.jit
        def __call__(self, mW: cute.Tensor, mX: cute.Tensor, mY: cute.Tensor, mAdd: cute.Tensor, mSsq: cute.Tensor,
                     mWs: cute.Tensor, mCnt: cute.Tensor, stream):
            gW = cute.zipped_divide(mW, (1, 4))  # 16-byte vectors of int32 pairs of bf16: ((1,4), (N, K/8))
            gX = cute.zipped_divide(mX, (1, 4))
            self.start(gW, gX, mY, mAdd, mSsq, mWs, mCnt, stream)

        @cute.jit
        def start(self, gW: cute.Tensor, gX: cute.Tensor, mY: cute.Tensor, mAdd: cute.Tensor, mSsq: cute.Tensor,
                  mWs: cute.Tensor, mCnt: cute.Tensor, stream):
            """The kernel's launch: a grid of row groups x splits, 32 x `plan.warps` threads per CTA."""
            p = self.p
            gWs = cute.zipped_divide(mWs, (1, 1, 4))
            self.kernel(gW, gX, mY, mAdd, mSsq, mWs, gWs, mCnt).launch(
                grid=[p.groups, p.splits, 1], block=[32 * p.warps, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, gW: cute.Tensor, gX: cute.Tensor, mY: cute.Tensor, mAdd: cute.Tensor, mSsq: cute.Tensor,
                   mWs: cute.Tensor, gWs: cute.Tensor, mCnt: cute.Tensor):
            p = self.p
            tidx, _, _ = cute.arch.thread_idx()
            bx, bs, _ = cute.arch.block_idx()
            warp, lane, g, t = mma_lanes(tidx)
            smem = cutlass.utils.SmemAllocator()
            rs = smem.allocate_tensor(Float32, cute.make_layout(p.cols), 16)
            flag = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
            vecs = p.per_split * 4  # 16-byte vectors of one token's K slice
            v0 = bs * vecs
            nch = Int32(p.per_split)
            if p.chunks - bs * p.per_split < nch:
                nch = p.chunks - bs * p.per_split
            gS = gX
            toks = []
            if cutlass.const_expr(p.direct):  # x straight from global memory (L1): token g of each column tile
                for nt in cutlass.range_constexpr(p.tiles):
                    tok = nt * 8 + g
                    if tok >= p.M:  # a column past M: any token, the column is not stored
                        tok = Int32(p.M - 1)
                    toks.append(tok)
            else:  # this split's K slice of every token's x -> shared memory (tokens past M: zeros)
                sX = smem.allocate_tensor(Int32, cute.make_layout((p.cols, p.stride), stride=(p.stride, 1)), 16)
                gS = cute.zipped_divide(sX, (1, 4))
                for i in cutlass.range(tidx, p.cols * vecs, 32 * p.warps, unroll=4):
                    m = i // vecs
                    j = i % vecs
                    r = cute.make_rmem_tensor((4,), Int32)
                    r.fill(0)
                    if m < p.M:
                        if j < nch * 4:
                            cute.autovec_copy(gX[(None, (m, v0 + j))], r)
                    cute.autovec_copy(r, gS[(None, (m, j))])
                cute.arch.barrier()

            row0 = bx * (32 * p.warps) + warp * 32
            # the warp's two 16-row tiles; a tile past N reads the last one and stores nothing
            base0 = row0
            if base0 >= p.N:
                base0 = Int32(p.N - 16)
            base1 = row0 + 16
            if base1 >= p.N:
                base1 = Int32(p.N - 16)
            base = [base0, base1]
            acc = cute.make_rmem_tensor((2 * p.tiles * 4,), Float32)
            acc.fill(0.0)
            rows = [base[q // 2] + (q % 2) * 8 + g for q in range(4)]  # rows g, g + 8 of each tile
            if cutlass.const_expr(p.direct):
                # PIPE chunks of loads in flight per warp, in register slots used round-robin: the loop steps PIPE
                # chunks at a time, so every slot index is a constant (no local memory)
                wb = [[cute.make_rmem_tensor((4,), Int32) for q in range(4)] for d in range(PIPE)]
                xb = [[cute.make_rmem_tensor((4,), Int32) for nt in range(p.tiles)] for d in range(PIPE)]
                for d in cutlass.range_constexpr(PIPE):
                    if d < nch:
                        fetch_chunk(gW, gX, rows, toks, v0 + d * 4 + t, wb[d], xb[d])
                for c0 in cutlass.range(0, nch, PIPE):
                    for d in cutlass.range_constexpr(PIPE):
                        if c0 + d < nch:
                            self.multiply(acc, wb[d], xb[d])
                            if c0 + d + PIPE < nch:
                                fetch_chunk(gW, gX, rows, toks, v0 + (c0 + d + PIPE) * 4 + t, wb[d], xb[d])
            else:
                for c in cutlass.range(nch, unroll=4):
                    kv = v0 + c * 4 + t
                    wv = [load4(gW[(None, (rows[q], kv))]) for q in range(4)]
                    xv = [load4(gS[(None, (nt * 8 + g, c * 4 + t))]) for nt in range(p.tiles)]
                    self.multiply(acc, wv, xv)
            # partial sums -> workspace [split, row, token]: (row g, tokens 2t, 2t + 1) and (row g + 8, ...)
            for q in cutlass.range_constexpr(2):
                if row0 + 16 * q < p.N:
                    for nt in cutlass.range_constexpr(p.tiles):
                        a = (q * p.tiles + nt) * 4
                        col = nt * 8 + 2 * t
                        mWs[bs, base[q] + g, col] = acc[a]
                        mWs[bs, base[q] + g, col + 1] = acc[a + 1]
                        mWs[bs, base[q] + g + 8, col] = acc[a + 2]
                        mWs[bs, base[q] + g + 8, col + 1] = acc[a + 3]
            is_last = Int32(1)
            if cutlass.const_expr(p.splits > 1):
                is_last = last_cta(mCnt, flag, tidx, p.splits, bx)
            else:
                cute.arch.barrier()
            if is_last != 0:
                finish_group(self, mY, mAdd, mSsq, gWs, rs, bx * (32 * p.warps) + tidx, warp, lane, p.warps)

        def multiply(self, acc, wv, xv):
            """One K chunk: for each column tile and 16-row tile, two mma (weights 8t..8t+7 of rows g, g + 8 against
            the same activations of token g)."""
            for nt in range(self.p.tiles):
                for q in range(2):
                    mma_chunk(acc, (q * self.p.tiles + nt) * 4, wv[2 * q], wv[2 * q + 1], xv[nt])


def _stride(per_split: int) -> int:
    """int32 words per staged token row: ≡ 64 bytes mod 128, so tokens g and g + 1 of a quarter-warp's 16-byte reads
    hit different banks."""
    words = per_split * CHUNK // 2
    return words + (16 if per_split % 2 == 0 else 0)


class Plan:
    """Tiling of one projection shape: `warps` x 32 rows per CTA, K in `splits` slices of `per_split` chunks."""

    def __init__(self, M: int, N: int, K: int, warps: int, splits: int):
        self.M, self.N, self.K, self.warps = M, N, K, warps
        self.tiles = -(-M // 8)  # mma column tiles of 8 tokens
        self.cols = 8 * self.tiles
        self.chunks = K // CHUNK
        self.per_split = -(-self.chunks // splits)
        self.splits = -(-self.chunks // self.per_split)  # every split non-empty
        self.groups = -(-N // (32 * warps))
        self.stride = _stride(self.per_split)
        # up to 2 column tiles (16 tokens) each warp reads x straight from global memory (L1 serves the CTA's other
        # warps); more tokens are staged in shared memory, since every column tile would repeat the global loads
        self.direct = self.tiles <= DIRECT_TILES

    @property
    def smem_bytes(self) -> int:
        return 0 if self.direct else self.cols * self.stride * 4

    @property
    def ctas(self) -> int:
        return self.groups * self.splits

    @property
    def per_sm(self) -> int:
        """CTAs one SM holds: by shared memory, registers (per thread, per `ptxas -v` on sm_90a: staged about 64 + 8
        per column tile, 76 / 100 / 126 at 2 / 5 / 8 tiles; direct, with its PIPE slots, 96 / 125 at 1 / 2) and
        threads."""
        regs = -(-(64 + (32 if self.direct else 8) * self.tiles) // 8) * 8
        threads = 32 * self.warps
        return max(1, min(SM_SMEM // (self.smem_bytes + 1024), SM_REGS // (regs * threads), SM_THREADS // threads))

    @property
    def workspace_shape(self) -> tuple:
        """fp32 [splits, N, 8 * tiles]: the partial sums one launch writes."""
        return (self.splits, self.N, self.cols)

    @property
    def partial_bytes(self) -> int:
        return self.splits * self.N * self.cols * 4 if self.splits > 1 else 0

    def key(self) -> tuple:
        return (self.M, self.N, self.K, self.warps, self.splits)


@functools.lru_cache(maxsize=None)
def plan_for(M: int, N: int, K: int, sms: int = DEFAULT_SMS) -> Plan:
    """The tiling with the most resident warps (up to WARPS_ENOUGH per SM) in one wave, its staged activations within
    SMEM_LIMIT and its workspace within PARTIALS_LIMIT of the weights and GROUP_PARTIALS_LIMIT per row group (where
    no tiling meets the last, as at 64 tokens, the one with the smallest row-group tail); among those within 10% of
    the most warps, the least workspace. A weight stream is as fast as the loads it keeps in flight, which per warp
    is about the same here."""
    fits = []
    for warps in (4, 8):
        for splits in range(1, K // CHUNK + 1):
            p = Plan(M, N, K, warps, splits)
            if p.splits != splits or p.smem_bytes > SMEM_LIMIT or p.ctas > p.per_sm * sms:
                continue
            if p.partial_bytes <= PARTIALS_LIMIT * N * K * 2:
                fits.append(p)
    if not fits:  # more row groups than one wave holds: no split, the smallest K slice that fits
        best = Plan(M, N, K, 8, 1)
        splits = 1
        while best.smem_bytes > SMEM_LIMIT:
            splits += 1
            best = Plan(M, N, K, 8, splits)
        return best
    cands = [p for p in fits if p.partial_bytes // p.groups <= GROUP_PARTIALS_LIMIT]
    if not cands:
        tail = min(p.partial_bytes // p.groups for p in fits)
        cands = [p for p in fits if p.partial_bytes // p.groups == tail]
    warps_of = {id(p): min(p.ctas * p.warps, WARPS_ENOUGH * sms) for p in cands}
    most = max(warps_of.values())
    return min((p for p in cands if warps_of[id(p)] >= 0.9 * most), key=lambda p: (p.partial_bytes, p.splits, p.warps))


def check_projection(w, x, y, accumulate: bool, addend, row_scale, what: str, rows: tuple[int, int],
                     n_multiple: int, glu: bool = False) -> None:
    """The checks both tensor-core projections make (`what` names the kernel in the messages): `rows` (least, most)
    tokens, K a multiple of CHUNK and N of `n_multiple`, bf16 W and x with 16-byte aligned contiguous rows, a bf16 or
    fp32 y, and the GEMV's epilogue arguments (`glu`: its SiTU-GLU epilogue's, y [M, N / 2])."""
    M, K = x.shape
    N = w.shape[0]
    if not rows[0] <= M <= rows[1]:
        raise ValueError(f"{what} takes {rows[0]}..{rows[1]} rows, got {M}")
    if glu:
        check_glu(w, y, accumulate, addend, row_scale)
    if w.shape[1] != K or y.shape != (M, N // 2 if glu else N):
        raise ValueError(f"shapes do not chain: W {tuple(w.shape)}, x {tuple(x.shape)}, y {tuple(y.shape)}")
    if w.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
        raise ValueError("W and x must be bf16")
    if K % CHUNK or N % n_multiple:
        raise ValueError(f"{what} needs K a multiple of {CHUNK} and N of {n_multiple}, got K={K}, N={N}")
    if w.stride(1) != 1 or x.stride(1) != 1 or y.stride(1) != 1 or w.stride(0) % 8 or x.stride(0) % 8:
        raise ValueError("rows must be contiguous and 16-byte aligned")
    if w.storage_offset() % 8 or x.storage_offset() % 8:
        raise ValueError("W and x must start on a 16-byte boundary")
    if y.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError("y must be bf16 or fp32")
    check_epilogue(y, accumulate, addend, row_scale)


def _check(w, x, y, accumulate: bool, addend, row_scale, counters) -> None:
    check_projection(w, x, y, accumulate, addend, row_scale, "tensor-core projection", (MIN_ROWS, MAX_ROWS), 16)
    if counters is not None and (counters.dtype != torch.int32 or counters.dim() != 1 or not counters.is_contiguous()):
        raise ValueError("counters must be a contiguous int32 vector")


def compile_split_k(name: str, op_cls, plan, w, x, y, ws, counters, accumulate: bool, addend, row_scale):
    """Compile split-K projection kernel `op_cls` (this module's, or `gemm_wgmma`'s) for `plan` and these tensors,
    cached under `name`; returns (the compiled kernel, its tensor arguments)."""
    extra = addend if addend is not None else y
    ssq = row_scale[0] if row_scale is not None else y
    eps = float(row_scale[1]) if row_scale is not None else 0.0
    args = (w.view(torch.int32), x.view(torch.int32), y, extra, ssq, ws, counters)
    key = (name, plan.key(), accumulate, addend is not None, row_scale is not None, eps, *signature(*args))
    op = op_cls(plan, accumulate, addend is not None, row_scale is not None,
                ssq.shape[1] if row_scale is not None else 0, eps)
    return compile_kernel(key, op, *(fake_like(t, align=4 if t is counters else 16) for t in args)), args


def compile_projection(w, x, y, ws, counters, accumulate: bool = False, addend=None, row_scale=None,
                       plan: Plan | None = None):
    plan = plan or plan_for(x.shape[0], w.shape[0], w.shape[1], sm_count(w.device))
    return compile_split_k("gemm_tc", TensorCoreProjection, plan, w, x, y, ws, counters, accumulate, addend, row_scale)


def workspace(plan, device) -> torch.Tensor:
    """The fp32 workspace one launch of `plan` (this module's or `gemm_wgmma`'s) takes: `plan.workspace_shape`."""
    return torch.empty(plan.workspace_shape, dtype=torch.float32, device=device)


def run_split_k(compile_fn, plan, what: str, w, x, y, counters, accumulate: bool, addend, row_scale) -> torch.Tensor:
    """Launch a split-K projection for `plan` (checked against the shapes and the counters), compiled by
    `compile_fn` (`compile_projection`'s arguments), with a fresh workspace; returns y."""
    if plan.key()[:3] != (x.shape[0], w.shape[0], w.shape[1]):
        raise ValueError(f"plan {plan.key()} is not for this shape")
    if counters.numel() < plan.groups:
        raise ValueError(f"{what} needs {plan.groups} counters, got {counters.numel()}")
    ws = workspace(plan, w.device)
    fn, args = compile_fn(w, x, y, ws, counters, accumulate, addend, row_scale, plan)
    launch(fn, *args, align=lambda t: 4 if t is counters else 16)
    return y


def project(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, counters: torch.Tensor, accumulate: bool = False,
            addend: torch.Tensor | None = None, row_scale: tuple | None = None, plan: Plan | None = None
            ) -> torch.Tensor:
    """y = x @ w.T, or y += x @ w.T (+ addend) with `accumulate`, on the current stream; the arguments are those of
    `gemv.gemv`. `counters`: int32, at least `plan_for(...).groups` long, all 0 (they are left at 0), used by no
    kernel running at the same time. `plan`: another tiling than `plan_for`'s (benchmarks)."""
    _check(w, x, y, accumulate, addend, row_scale, counters)
    plan = plan or plan_for(x.shape[0], w.shape[0], w.shape[1], sm_count(w.device))
    return run_split_k(compile_projection, plan, "tensor-core projection", w, x, y, counters, accumulate, addend,
                       row_scale)
