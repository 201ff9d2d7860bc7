"""Small-batch projection (1 to 8 rows) on CUDA cores: y[m, n] = sum_k x[m, k] * W[n, k], bf16 in, fp32 accumulate.

Each warp streams one output row n of W with 16-byte loads (8 bf16 per lane, 256 per warp and iteration); the few
activation rows stay in L1. At batch <= 8 the weights are the only bytes that matter, and enough independent 16-byte
loads must be in flight to cover the memory latency: when W has few rows (the router's 896, the shared experts' 768)
the 4 warps of a CTA split one row's K between them (split-K inside the CTA, partial sums added through shared
memory), so four times as many warps stream the same bytes. The epilogue either stores y (bf16 or fp32) or adds it
into an fp32 residual (`accumulate=True`), optionally with a bf16 addend (`y += x @ W.T + addend`), which fuses the
residual update of output projections; with `glu=True` each warp streams a gate row and its up row and the epilogue
stores SiTU-GLU of the pair (the shared experts' gate/up projection and activation in one kernel).

Under PDL each warp copies the first `preload` 16-byte slices of its row(s) per lane into shared memory with
`cp.async` before it waits for the previous kernel (`KIMI_DECODE_GEMV_PRELOAD`, default PRELOAD): the weights do not
depend on it, and unlike loads into registers the copies hold no registers, so the CTAs that start while a small
kernel before them runs (AttnRes, the last CTA of the output projection, the w2 expert kernel) stream weights
meanwhile. Each lane reads back only what it copied, so no barrier is needed, only the wait for its own copies. The
copies slow that kernel's own loads, which queue behind them: on the H200 2 slices per lane came out ahead, 4 and 8
cost more than they saved (benchmarks/NOTES.md, v16).
"""
from __future__ import annotations

import torch

from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, env_flag, env_int, fake_like, launch, signature

if HAVE_CUTE:
    from .cute_common import (copy_async_16, gemv_prefetch_iters, pdl_launch_dependents, pdl_wait, prefetch_l2,
                              situ_glu)

VEC = 8  # bf16 per 16-byte load
WARPS = 4
MAX_ROWS = 8
PRELOAD = 2  # slices per lane and row copied into shared memory before the PDL wait (NOTES, v16: 4 and 8 lose)


def preload_setting() -> int:
    """KIMI_DECODE_GEMV_PRELOAD: the 16-byte slices per lane and row a GEMV warp copies into shared memory before the
    PDL wait (0: none; default PRELOAD)."""
    return env_int("KIMI_DECODE_GEMV_PRELOAD", PRELOAD, 0, 1024, "a number of slices")

if HAVE_CUTE:
    from cutlass import Float32, Int32

    def _regs(tile: cute.Tensor) -> cute.Tensor:
        """A small global tile copied into registers (a plain function: inlined where it is called)."""
        r = cute.make_rmem_tensor_like(tile)
        cute.autovec_copy(tile, r)
        return r

    def store_output(mY: cute.Tensor, mAdd: cute.Tensor, m, n, val, accumulate: bool, addend: bool) -> None:
        """The projections' store of output (m, n), fp32 `val`: y = val in y's dtype, or y += val (+ addend[m, n])
        into an fp32 y."""
        if accumulate:
            if addend:
                mY[m, n] = mY[m, n] + val + mAdd[m, n].to(Float32)
            else:
                mY[m, n] = mY[m, n] + val
        else:
            mY[m, n] = val.to(mY.element_type)

    def preload_output(mY: cute.Tensor, mAdd: cute.Tensor, m, n, pre: cute.Tensor, i: int, addend: bool) -> None:
        """y[m, n] (and addend[m, n]) into registers pre[2 i] (pre[2 i + 1]), loaded ahead of a kernel's main loop
        for `store_preloaded`, so that the epilogue's read-modify-write waits for no load after it."""
        pre[2 * i] = mY[m, n]
        if addend:
            pre[2 * i + 1] = mAdd[m, n].to(Float32)

    def store_preloaded(mY: cute.Tensor, mAdd: cute.Tensor, m, n, val, pre: cute.Tensor, i: int, accumulate: bool,
                        addend: bool) -> None:
        """`store_output` with y and the addend taken from `preload_output`'s registers pre[2 i], pre[2 i + 1]."""
        if accumulate:
            total = pre[2 * i] + val
            if addend:
                total = total + pre[2 * i + 1]
            mY[m, n] = total
        else:
            store_output(mY, mAdd, m, n, val, False, False)

    class SmallBatchGemv:
        """`scaled`: each output row m is multiplied by rsqrt(ssq[m].sum() / K + eps), the sum of squares of an
        RMSNorm's input coming as partial sums `ssq` [M, parts] from the kernel that produced x (which also applied
        the norm's weight)."""

        def __init__(self, M: int, N: int, K: int, accumulate: bool, addend: bool, parts: int = 0, eps: float = 0.0,
                     scaled: bool = False, glu: bool = False, warps: int = WARPS, split: int | None = None,
                     epi_early: bool = False, preload: int = 0, row_lanes: int = 32, norm_after: bool = False):
            """`warps` per CTA: WARPS for this kernel; a kernel that runs `project` in CTAs of its own size (the
            expert kernels, with the shared experts' GEMV CTAs beside theirs) passes that, and may set the warps
            per output row (`split`, a divisor of `warps`; else `split_for`'s). `preload`: slices per lane and row
            copied into shared memory before the PDL wait (under PDL only; the kernel allocates the buffer with
            `allocate_preload`). `row_lanes` (32, 16, 8 or 4; below 32 without split-K): lanes per output row, so
            a warp takes 32 // row_lanes rows side by side, for rows too short to keep a whole warp's loads busy
            (the shared experts' down-projection: 384 or 768 of K). `norm_after` (`scaled`, `norm_after()`): the
            partial sums of squares are loaded before the weight loop and added after it, instead of before it."""
            self.M, self.K, self.accumulate, self.addend = M, K, accumulate, addend
            self.parts, self.eps, self.scaled = parts, eps, scaled
            self.glu = glu  # W is [gate; up] (2N rows): y[m, n] = SiTU-GLU(x . W[n], x . W[N + n])
            self.warps = warps
            self.epi_early = epi_early  # with `accumulate`: y (and the addend) read before the weight loop
            self.norm_after = norm_after and scaled
            self.split = split if split is not None else split_for(2 * N if glu else N, K, warps)
            assert warps % self.split == 0
            assert row_lanes in (32, 16, 8, 4) and (row_lanes == 32 or self.split == 1)
            self.row_lanes = row_lanes
            self.per_warp = 32 // row_lanes  # output rows side by side in a warp
            self.rows = warps // self.split * self.per_warp  # output rows per CTA
            self.iters = -(-(-(-K // (row_lanes * VEC))) // self.split)  # iterations of one K slice
            self.preload = min(preload, self.iters)

        def preloaded(self) -> int:
            """The slices per lane and row this kernel copies before its wait (none without PDL)."""
            return self.preload if self.pdl else 0

        def allocate_preload(self, smem, slices: int | None = None):
            """The shared memory `project` copies the preloaded weights into: [16 bytes, lane, slice, row of the
            CTA] (a 16-byte stand-in when nothing is preloaded). A kernel running several GEMVs allocates for the
            largest (`slices`, rows as this one's)."""
            slices = self.preloaded() if slices is None else slices
            if slices == 0:
                return smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((1, VEC)), 16)
            return smem.allocate_tensor(cutlass.BFloat16, cute.make_layout(
                ((1, VEC), 32, slices, self.warps * (2 if self.glu else 1))), 16)

        @cute.jit
        def __call__(self, mW: cute.Tensor, mX: cute.Tensor, mY: cute.Tensor, mAdd: cute.Tensor, mSsq: cute.Tensor,
                     stream):
            gW = cute.zipped_divide(mW, (1, VEC))
            gX = cute.zipped_divide(mX, (1, VEC))
            N = mY.shape[1]
            self.kernel(gW, gX, mY, mAdd, mSsq, N).launch(grid=[cute.ceil_div(N, self.rows), 1, 1],
                                                              block=[32 * WARPS, 1, 1], stream=stream,
                                                              use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, gW: cute.Tensor, gX: cute.Tensor, mY: cute.Tensor, mAdd: cute.Tensor, mSsq: cute.Tensor,
                   N: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 2 * self.M)), 16)
            pre = self.allocate_preload(smem)
            self.project(gW, gX, mY, mAdd, mSsq, N, red, tidx, bidx, pre)

        @cute.jit
        def project(self, gW: cute.Tensor, gX: cute.Tensor, mY: cute.Tensor, mAdd: cute.Tensor, mSsq: cute.Tensor,
                    N: Int32, red: cute.Tensor, tidx: Int32, bidx: Int32, sPre: cute.Tensor):
            """This CTA's output rows (the whole kernel but for its shared memory, `red` [warps, 2 M] fp32 and `sPre`
            (`allocate_preload`), which the caller allocates: kernels that do more after the GEMV own one
            allocator)."""
            lane = tidx % 32
            warp = tidx // 32
            RL = self.row_lanes
            rl = lane  # the lane's place in its row's lanes
            if cutlass.const_expr(RL == 32):
                n = bidx * self.rows + warp // self.split
            else:
                rl = lane % RL
                n = bidx * self.rows + warp * self.per_warp + lane // RL
            part = warp % self.split
            P = self.preloaded()
            pdl_launch_dependents(self.pdl)
            if cutlass.const_expr(self.pdl):  # the weights do not depend on the previous kernel: start them
                if n < N:
                    for it in cutlass.range_constexpr(gemv_prefetch_iters()):
                        kk = (part * self.iters + it) * RL + rl
                        if kk * VEC < self.K:
                            prefetch_l2(gW[(None, (n, kk))])
            if cutlass.const_expr(P > 0):
                if n < N:
                    for it in cutlass.range_constexpr(P):
                        kk = (part * self.iters + it) * RL + rl
                        if kk * VEC < self.K:
                            copy_async_16(gW[(None, (n, kk))], sPre[(None, lane, it, warp)])
                            if cutlass.const_expr(self.glu):
                                copy_async_16(gW[(None, (N + n, kk))], sPre[(None, lane, it, self.warps + warp)])
                cute.arch.cp_async_commit_group()
            pdl_wait(self.pdl)
            acc = cute.make_rmem_tensor((self.M,), Float32)
            acc.fill(0.0)
            acc_up = cute.make_rmem_tensor((self.M,), Float32)  # the up rows' sums (glu)
            acc_up.fill(0.0)
            # `scaled`: the lane's partial sums of squares, loaded now; added before the weight loop, or after it
            # (`norm_after`)
            rstd = cute.make_rmem_tensor((self.M,), Float32)
            qs = cute.make_rmem_tensor((self.M, -(-self.parts // 32) if self.scaled else 1), Float32)
            if cutlass.const_expr(self.scaled):
                qs.fill(0.0)
                for m in cutlass.range_constexpr(self.M):
                    for i in cutlass.range_constexpr(-(-self.parts // 32)):
                        if lane + 32 * i < self.parts:
                            qs[m, i] = mSsq[m, lane + 32 * i]
                if cutlass.const_expr(not self.norm_after):
                    self.norm_scales(qs, rstd)
            # what the epilogue adds to (the residual, the addend), read before the weight loop so that no warp waits
            # for it at the end (`epi_early`)
            pre = cute.make_rmem_tensor((2 * self.M,), Float32)
            if cutlass.const_expr(self.accumulate and self.epi_early):
                if n < N:
                    if rl == 0:
                        if part == 0:
                            for m in cutlass.range_constexpr(self.M):
                                pre[m] = mY[m, n]
                                if cutlass.const_expr(self.addend):
                                    pre[self.M + m] = mAdd[m, n].to(Float32)
            if n < N:
                for it in cutlass.range(P, self.iters, unroll=4):
                    kk = (part * self.iters + it) * RL + rl
                    if kk * VEC < self.K:
                        w = _regs(gW[(None, (n, kk))]).load().to(Float32)
                        u = w
                        if cutlass.const_expr(self.glu):
                            u = _regs(gW[(None, (N + n, kk))]).load().to(Float32)
                        self.add_slice(acc, acc_up, w, u, gX, kk)
            if cutlass.const_expr(P > 0):  # the preloaded slices, once this thread's copies have landed
                cute.arch.cp_async_wait_group(0)
                if n < N:
                    for it in cutlass.range_constexpr(P):
                        kk = (part * self.iters + it) * RL + rl
                        if kk * VEC < self.K:
                            w = sPre[(None, lane, it, warp)].load().to(Float32)
                            u = w
                            if cutlass.const_expr(self.glu):
                                u = sPre[(None, lane, it, self.warps + warp)].load().to(Float32)
                            self.add_slice(acc, acc_up, w, u, gX, kk)
            if cutlass.const_expr(self.norm_after):
                self.norm_scales(qs, rstd)
            for m in cutlass.range_constexpr(self.M):
                acc[m] = cute.arch.warp_reduction(acc[m], lambda a, b: a + b, threads_in_group=RL)
                if cutlass.const_expr(self.glu):
                    acc_up[m] = cute.arch.warp_reduction(acc_up[m], lambda a, b: a + b, threads_in_group=RL)
            if cutlass.const_expr(self.split > 1):
                if lane == 0:
                    for m in cutlass.range_constexpr(self.M):
                        red[warp, m] = acc[m]
                        if cutlass.const_expr(self.glu):
                            red[warp, self.M + m] = acc_up[m]
                cute.arch.barrier()
                if lane == 0 and part == 0:
                    for m in cutlass.range_constexpr(self.M):
                        total = Float32(0.0)
                        total_up = Float32(0.0)
                        for i in cutlass.range_constexpr(self.split):
                            total = total + red[warp + i, m]
                            if cutlass.const_expr(self.glu):
                                total_up = total_up + red[warp + i, self.M + m]
                        acc[m] = total
                        acc_up[m] = total_up
            if n < N and rl == 0 and part == 0:
                for m in cutlass.range_constexpr(self.M):
                    if cutlass.const_expr(self.glu):
                        acc[m] = situ_glu(acc[m], acc_up[m])
                    if cutlass.const_expr(self.scaled):
                        acc[m] = acc[m] * rstd[m]
                    if cutlass.const_expr(self.accumulate and self.epi_early):
                        total = pre[m] + acc[m]
                        if cutlass.const_expr(self.addend):
                            total = total + pre[self.M + m]
                        mY[m, n] = total
                    else:
                        store_output(mY, mAdd, m, n, acc[m], self.accumulate, self.addend)


        @cute.jit
        def norm_scales(self, qs: cute.Tensor, rstd: cute.Tensor):
            """rstd[m] = rsqrt(sum of row m's partial sums of squares / K + eps), from each lane's share of them in
            qs[m, :] (zeros past the last), the warp's lanes adding theirs."""
            for m in cutlass.range_constexpr(self.M):
                q = Float32(0.0)
                for i in cutlass.range_constexpr(-(-self.parts // 32)):
                    q = q + qs[m, i]
                q = cute.arch.warp_reduction(q, lambda a, b: a + b)
                rstd[m] = cute.math.rsqrt(q / Float32(self.K) + Float32(self.eps))

        def add_slice(self, acc: cute.Tensor, acc_up: cute.Tensor, w, u, gX: cute.Tensor, kk) -> None:
            """acc[m] += w . x[m, slice kk] for every row m (and acc_up[m] += u . x[m, slice kk] with `glu`), w and
            u a lane's 8 weights in fp32. Inlined where it is called (a plain function, no condition inside)."""
            for m in range(self.M):
                xv = _regs(gX[(None, (m, kk))]).load().to(Float32)
                acc[m] = acc[m] + (w * xv).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                if self.glu:
                    acc_up[m] = acc_up[m] + (u * xv).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)


def norm_after() -> bool:
    """KIMI_DECODE_GEMV_NORM_AFTER: whether a GEMV with a row scale (the batch-1 MoE tail: the routed sum's RMSNorm)
    adds its partial sums of squares after the weight loop ("1", the default; loaded before it) or before ("0"), where
    the adding waits for their loads and the loop's first weight loads wait for the adding. On the H200 "1" was
    0.7-1.1 us per KDA layer faster at TP16 and 1.1-1.8 at TP8 (benchmarks/NOTES.md item 80)."""
    return env_flag("KIMI_DECODE_GEMV_NORM_AFTER", "1")


def split_for(N: int, K: int, warps: int = WARPS) -> int:
    """Warps per output row: split K while the grid has few warps (under 4096) and each slice keeps >= 1024 of K
    (the split divides the CTA's `warps`)."""
    split = 1
    while warps % (split * 2) == 0 and N * split * 2 <= 4096 and K // (split * 2) >= 1024:
        split *= 2
    return split


def _check(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, accumulate: bool, addend, row_scale=None,
           glu: bool = False) -> None:
    M, K = x.shape
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"small-batch GEMV takes 1..{MAX_ROWS} rows, got {M}")
    if glu:
        check_glu(w, y, accumulate, addend, row_scale)
    if w.shape[1] != K or y.shape != (M, w.shape[0] // 2 if glu else w.shape[0]):
        raise ValueError(f"shapes do not chain: W {tuple(w.shape)}, x {tuple(x.shape)}, y {tuple(y.shape)}")
    if w.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or K % VEC:
        raise ValueError("W and x must be bf16 with K a multiple of 8")
    if w.stride(1) != 1 or x.stride(1) != 1 or y.stride(1) != 1 or w.stride(0) % VEC or x.stride(0) % VEC:
        raise ValueError("rows must be contiguous and 16-byte aligned")
    check_epilogue(y, accumulate, addend, row_scale)


def check_glu(w: torch.Tensor, y: torch.Tensor, accumulate: bool, addend, row_scale) -> None:
    """The SiTU-GLU epilogue's arguments (this GEMV's and the warpgroup-mma projection's): [gate; up] weights with an
    even row count, a bf16 y, no accumulate, addend or row scale."""
    if accumulate or addend is not None or row_scale is not None or y.dtype != torch.bfloat16 or w.shape[0] % 2:
        raise ValueError("the SiTU-GLU epilogue takes [gate; up] weights with an even row count and a bf16 y, and no "
                         "accumulate, addend or row scale")


def check_epilogue(y: torch.Tensor, accumulate: bool, addend, row_scale) -> None:
    """The epilogue arguments both projection kernels take: accumulate into an fp32 y, a bf16 addend shaped like y
    (with accumulate only), `row_scale=(ssq, eps)` with fp32 partial sums of squares [M, parts]."""
    if accumulate and y.dtype != torch.float32:
        raise ValueError("accumulating into y needs an fp32 y")
    if addend is not None and (not accumulate or addend.shape != y.shape or addend.dtype != torch.bfloat16
                               or addend.stride(1) != 1):
        raise ValueError("an addend needs accumulate=True and a bf16 tensor shaped like y")
    if row_scale is not None:
        ssq = row_scale[0]
        if ssq.dim() != 2 or ssq.shape[0] != y.shape[0] or ssq.dtype != torch.float32 or not ssq.is_contiguous():
            raise ValueError("the partial sums of squares must be fp32 [M, parts]")


def _kernel_tensors(y, addend, row_scale) -> tuple:
    """(addend, ssq) as the kernel takes them; y stands in for the tensors a mode does not read."""
    return (addend if addend is not None else y, row_scale[0] if row_scale is not None else y)


def compile_gemv(w, x, y, accumulate: bool = False, addend=None, row_scale=None, glu: bool = False):
    extra, ssq = _kernel_tensors(y, addend, row_scale)
    eps = float(row_scale[1]) if row_scale is not None else 0.0
    epi_early = accumulate and env_flag("KIMI_DECODE_GEMV_EPI_EARLY", "1")
    preload = preload_setting()
    after = row_scale is not None and norm_after()
    key = ("gemv", accumulate, addend is not None, row_scale is not None, glu, eps, epi_early, preload, after,
           *signature(w, x, y, extra, ssq))
    op = SmallBatchGemv(x.shape[0], y.shape[1], x.shape[1], accumulate, addend is not None,
                        ssq.shape[1] if row_scale is not None else 0, eps, row_scale is not None, glu,
                        epi_early=epi_early, preload=preload, norm_after=after)
    return compile_kernel(key, op, *(fake_like(t) for t in (w, x, y, extra, ssq)))


def gemv(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, accumulate: bool = False,
         addend: torch.Tensor | None = None, row_scale: tuple | None = None, glu: bool = False) -> torch.Tensor:
    """y = x @ w.T, or y += x @ w.T (+ addend) with `accumulate`, written in place on the current stream.

    `row_scale=(ssq, eps)` multiplies row m of x @ w.T by rsqrt(ssq[m].sum() / K + eps): an RMSNorm of x whose
    weight x already carries, its sum of squares left as partial sums by the producer of x. `glu`: w is [gate; up]
    with 2N rows and y [M, N] = SiTU-GLU(x @ gate.T, x @ up.T) (the shared experts' first half in one kernel)."""
    _check(w, x, y, accumulate, addend, row_scale, glu)
    launch(compile_gemv(w, x, y, accumulate, addend, row_scale, glu), w, x, y, *_kernel_tensors(y, addend, row_scale))
    return y
