"""The attention output projection and the AttnRes step after it in one kernel, for one sequence (batch 1).

  a = bf16(o @ W.T)              (W the output projection [H, K], o the attention output [1, K])
  then the AttnRes step with delta a (`attn_res.AttnRes`: residual update, softmax mix, input RMSNorm)

The kernel has one CTA per SM, each of the T threads AttnRes uses (448 for H = 7168), since AttnRes's registers
allow only one such CTA per SM anyway. For the projection every warp holds the whole of o in registers (K / 256
16-byte slices per lane) and takes output rows warp, warp + all warps, ... two at a time, so each lane has 2 K / 256
independent 16-byte weight loads in flight; a row's dot product is one warp reduction. The weights do not depend on the
attention output the kernel waits for, so under PDL they are fetched before the wait (`KIMI_DECODE_OPROJ_EARLY`):
"smem" copies all of the CTA's rows into shared memory with `cp.async` where they fit (SMEM_BUDGET; else as "1"),
so the whole weight stream can pass while the KDA kernel runs; "1" (the default: "smem" measured slower, NOTES v16)
loads the first two rows into registers, and the rest right after the wait (`KIMI_DECODE_OPROJ_REST`); "0" loads
after the wait. The CTA that finishes last
(`cute_common.last_cta`) runs the AttnRes step, reading a as the other CTAs wrote it. Compared with the projection
kernel followed by the AttnRes kernel, what goes is the gap between the two kernels (the AttnRes kernel cannot start
until the last projection CTA is done, and then has to be launched and fetch its code).

`KIMI_DECODE_OPROJ_RES` says how the AttnRes step is split between the CTAs. "last": the last CTA runs all of it.
"split" (the default: 2.1 / 2.3 us faster per layer at TP16 / TP8 on the H200, NOTES v19): every CTA first does the part that is per hidden element for its own output rows, lane i of a
warp taking the warp's row i: the residual update (partial += a, stored) and the candidates' contributions to the
score sums (dot with query * key_norm, sum of squares), whose CTA totals it stores in `parts` [ctas, P]. Those loads
(the blocks, the old partial, query and key_norm at the warp's rows) do not depend on the attention output and are
issued before the PDL wait. The last CTA then adds the CTAs' totals in a fixed order, takes the softmax and forms the
mix and its RMSNorm: about half the bytes through its one SM (no weights but input_norm, no delta, no partial
store) and one block reduction fewer. Outputs are the same as "last"'s up to the order of the fp32 sums.
"""
from __future__ import annotations

import torch

from .attn_res import _align as _res_align
from .attn_res import _next_pow2
from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, env_choice, fake_like, launch, signature, sm_count

if HAVE_CUTE:
    from cutlass import BFloat16, Float32, Int32

    from .attn_res import AttnRes, _load4
    from .cute_common import copy_async_16, last_cta, pdl_launch_dependents, pdl_reads_ahead, pdl_wait

VEC = 8  # bf16 per 16-byte load
ROWS_AT_ONCE = 2  # output rows a warp streams together
EARLY_MODES = ("smem", "1", "0")
SMEM_BUDGET = 192 * 1024  # bytes of shared memory the preloaded weights may take per CTA (the SM has 227 KB)
RES_MODES = ("last", "split")


def res_mode() -> str:
    """KIMI_DECODE_OPROJ_RES: "split" (the default: each CTA does the per-element part for its rows, the last CTA the
    softmax and the mix) or "last" (the last CTA runs the whole AttnRes step)."""
    return env_choice("KIMI_DECODE_OPROJ_RES", "split", RES_MODES)


REST_MODES = ("loop", "ahead")


def rest_mode() -> str:
    """KIMI_DECODE_OPROJ_REST: where the projection's rows after each warp's first pass (two rows) are loaded, with
    the first pass's in registers before the wait (`KIMI_DECODE_OPROJ_EARLY=1`): "ahead" (the default) all of them
    into registers of their own right after the wait, the passes unrolled; "loop" each pass's after the pass before
    it, so their HBM round trips follow one another after the wait. On the H200 "ahead" was 0.4-1.1 us per KDA
    layer faster at TP16 and 1.0-1.7 at TP8 (benchmarks/NOTES.md item 79)."""
    return env_choice("KIMI_DECODE_OPROJ_REST", "ahead", REST_MODES)


def parts_width(n_blocks: int) -> int:
    """Score sums per CTA in "split" mode: a dot and a sum of squares per candidate, padded to a power of two."""
    return 2 * _next_pow2(n_blocks + 1)


if HAVE_CUTE:
    class OProjAttnRes:
        def __init__(self, hidden: int, K: int, ctas: int, n_blocks: int, delta_mode: int, eps: float,
                     early: str = "1", split: bool = True, rest: str = "ahead"):
            """`early`, `split`, `rest`: KIMI_DECODE_OPROJ_EARLY, whether KIMI_DECODE_OPROJ_RES is "split", and
            KIMI_DECODE_OPROJ_REST, their defaults by default (`compile_oproj_attn_res` passes the settings)."""
            self.res = AttnRes(hidden, n_blocks, False, delta_mode, True, eps)
            self.res.pdl = False  # the fused kernel waits for the previous one itself
            self.H, self.K, self.ctas = hidden, K, ctas
            self.T = self.res.T
            self.W = self.T // 32
            self.iters = -(-K // (32 * VEC))  # 16-byte slices of o per lane
            self.exact = self.iters * 32 * VEC == K
            self.per_warp = -(-hidden // (ctas * self.W))  # output rows per warp
            self.rows_pre = -(-self.per_warp // ROWS_AT_ONCE) * ROWS_AT_ONCE  # the same, whole passes
            if early == "smem" and self.rows_pre * self.iters * 32 * VEC * 2 * self.W > SMEM_BUDGET:
                early = "1"
            self.early = early  # KIMI_DECODE_OPROJ_EARLY, "smem" where it fits
            # "split" needs a lane per output row of a warp (every GPU with 8 SMs or more, at H = 7168)
            self.split = bool(split) and self.per_warp <= 32
            self.rest = rest  # KIMI_DECODE_OPROJ_REST

        def rest_ahead(self) -> bool:
            """Whether the rows after the first pass are loaded into registers of their own right after the wait,
            all passes unrolled ("ahead"), rather than each pass's after the one before it ("loop"); with the first
            pass's rows in registers only (`in_regs`)."""
            return self.rest == "ahead" and self.in_regs() and self.rows_pre > ROWS_AT_ONCE

        def in_smem(self) -> bool:
            """Whether the weights go through shared memory (only under PDL: without it nothing runs before)."""
            return self.pdl and self.early == "smem"

        def in_regs(self) -> bool:
            """Whether the first pass's rows are loaded into registers before the wait."""
            return self.early == "1" or (self.early == "smem" and not self.pdl)

        @cute.jit
        def __call__(self, mW: cute.Tensor, mX: cute.Tensor, mA: cute.Tensor, blocks: cute.Tensor,
                     partial: cute.Tensor, query: cute.Tensor, key_norm: cute.Tensor, input_norm: cute.Tensor,
                     out: cute.Tensor, mCnt: cute.Tensor, mParts: cute.Tensor, stream):
            gW = cute.zipped_divide(mW, (1, VEC))
            gX = cute.zipped_divide(mX, (1, VEC))
            gB, gP, gD, gQ, gK, gN, gO = self.res.tiles(blocks, partial, mA, query, key_norm, input_norm, out)
            self.kernel(gW, gX, mA, gB, gP, gD, gQ, gK, gN, gO, mCnt, blocks, partial, query, key_norm,
                        mParts).launch(
                grid=[self.ctas, 1, 1], block=[self.T, 1, 1], stream=stream, use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, gW: cute.Tensor, gX: cute.Tensor, mA: cute.Tensor, gB: cute.Tensor, gP: cute.Tensor,
                   gD: cute.Tensor, gQ: cute.Tensor, gK: cute.Tensor, gN: cute.Tensor, gO: cute.Tensor,
                   mCnt: cute.Tensor, mB: cute.Tensor, mP: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor,
                   mParts: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            lane = tidx % 32
            warp = tidx // 32
            pdl_launch_dependents(self.pdl)
            smem = cutlass.utils.SmemAllocator()
            red, sW, red2 = self.res.allocate(smem)
            flag = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
            stride = self.ctas * self.W
            gw = bidx * self.W + warp
            per_warp = self.per_warp
            # the weights before the PDL wait (they do not depend on the previous kernel), so their HBM latency
            # passes while the KDA kernel finishes: all rows into shared memory, or the first pass's into registers
            wt = cute.make_rmem_tensor((VEC, self.iters, ROWS_AT_ONCE), gW.element_type)
            # the shared memory the rows are copied into ("smem"; else a 16-byte stand-in, never touched)
            pre = smem.allocate_tensor(gW.element_type, cute.make_layout(
                (VEC, 32, self.iters, self.rows_pre, self.W) if self.in_smem() else (VEC, 1, 1, 1, 1)), 16)
            if cutlass.const_expr(self.in_smem()):
                self.preload_rows(gW, pre, gw, stride, lane, warp)
            if cutlass.const_expr(self.in_regs()):
                self.load_rows(gW, wt, gw, stride, Int32(0), lane)
            # "split": the candidates at the lane's row (written two or more kernels back), before the wait under PDL
            n_mine = gw + stride * lane
            cs = cute.make_rmem_tensor((self.res.NC,), Float32)
            qk = cute.make_rmem_tensor((1,), Float32)
            split_early = bool(self.split and self.pdl and pdl_reads_ahead())  # trace-time constants
            split_late = bool(self.split and not split_early)
            if cutlass.const_expr(split_early):
                self.row_candidates(mB, mP, mQ, mK, n_mine, cs, qk)
            pdl_wait(self.pdl)
            # "ahead": the later passes' rows, issued before anything waits on the attention output
            wr = cute.make_rmem_tensor((VEC, self.iters, max(self.rows_pre - ROWS_AT_ONCE, 1)), gW.element_type)
            if cutlass.const_expr(self.rest_ahead()):
                for j in cutlass.range_constexpr(ROWS_AT_ONCE, self.rows_pre):
                    for it in cutlass.range_constexpr(self.iters):
                        cute.autovec_copy(self.row_slice(gW, gw, stride, j, it, lane), wr[None, it, j - ROWS_AT_ONCE])
            if cutlass.const_expr(split_late):
                self.row_candidates(mB, mP, mQ, mK, n_mine, cs, qk)

            xs = cute.make_rmem_tensor((VEC, self.iters), Float32)
            xs.fill(0.0)
            for it in cutlass.range_constexpr(self.iters):
                kk = it * 32 + lane
                if self.exact or kk * VEC < self.K:
                    tX = gX[(None, (0, kk))]
                    rX = cute.make_rmem_tensor_like(tX)
                    cute.autovec_copy(tX, rX)
                    for e in cutlass.range_constexpr(VEC):
                        xs[e, it] = rX[e].to(Float32)
            if cutlass.const_expr(self.in_smem()):
                cute.arch.cp_async_wait_group(0)  # this thread's copies (each lane reads back only its own)
            mine = Float32(0.0)  # "split": the sum of the lane's row
            if cutlass.const_expr(self.rest_ahead()):
                for j in cutlass.range_constexpr(0, self.rows_pre, ROWS_AT_ONCE):
                    mine = self.rows_pass(wt if j == 0 else wr, 0 if j == 0 else j - ROWS_AT_ONCE, xs, mA, gw,
                                          stride, j, lane, mine)
            else:
                for j in cutlass.range(0, per_warp, ROWS_AT_ONCE, unroll=1):
                    if cutlass.const_expr(self.in_smem()):
                        for r in cutlass.range_constexpr(ROWS_AT_ONCE):
                            for it in cutlass.range_constexpr(self.iters):
                                cute.autovec_copy(pre[(None, lane, it, j + r, warp)], wt[None, it, r])
                    elif cutlass.const_expr(self.in_regs()):
                        if j > 0:
                            self.load_rows(gW, wt, gw, stride, j, lane)
                    else:
                        self.load_rows(gW, wt, gw, stride, j, lane)
                    mine = self.rows_pass(wt, 0, xs, mA, gw, stride, j, lane, mine)
            if cutlass.const_expr(self.split):
                self.publish(mine, cs, qk, n_mine, tidx, lane, warp, bidx, mP, mParts, red)
                if last_cta(mCnt, flag, tidx, self.ctas) != 0:
                    self.finish(gB, gP, gN, gO, mParts, tidx, lane, warp, red, sW, red2)
            else:
                if last_cta(mCnt, flag, tidx, self.ctas) != 0:
                    self.res.body(gB, gP, gD, gQ, gK, gN, gO, Int32(0), tidx, red, sW, red2, False)

        @cute.jit
        def rows_pass(self, wt: cute.Tensor, r0: cutlass.Constexpr, xs: cute.Tensor, mA: cute.Tensor, gw: Int32,
                      stride: Int32, j: Int32, lane: Int32, mine: Float32):
            """One pass: the dot products of rows j, j + 1 of the warp (their slices at wt[:, :, r0], r0 + 1) with
            the activations xs, each stored to a by lane 0; returns `mine` ("split": the sum of the lane's row, if
            it is one of them)."""
            acc = cute.make_rmem_tensor((ROWS_AT_ONCE,), Float32)
            acc.fill(0.0)
            for r in cutlass.range_constexpr(ROWS_AT_ONCE):
                for it in cutlass.range_constexpr(self.iters):
                    w = wt[None, it, r0 + r].load().to(Float32)
                    for e in cutlass.range_constexpr(VEC):
                        acc[r] = acc[r] + w[e] * xs[e, it]
            for r in cutlass.range_constexpr(ROWS_AT_ONCE):
                n = gw + stride * (j + r)
                tot = cute.arch.warp_reduction(acc[r], lambda a, b: a + b)
                if n < self.H and lane == 0:
                    mA[0, n] = tot.to(mA.element_type)
                if cutlass.const_expr(self.split):
                    if lane == j + r:
                        mine = tot
            return mine

        def row_candidates(self, mB: cute.Tensor, mP: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor, n, cs, qk):
            """The committed blocks and (delta_mode 1) the old partial at hidden element n (clamped), into cs, and
            query * key_norm there into qk[0]. A plain function: inlined where it is called."""
            nn = cutlass.min(n, self.H - 1)
            for s in range(self.res.NB):
                cs[s] = mB[0, s, nn]
            if self.res.delta_mode == 1:
                cs[self.res.NB] = mP[0, nn]
            qk[0] = mQ[nn] * mK[nn]

        @cute.jit
        def publish(self, mine: Float32, cs: cute.Tensor, qk: cute.Tensor, n_mine: Int32, tidx: Int32, lane: Int32,
                    warp: Int32, bidx: Int32, mP: cute.Tensor, mParts: cute.Tensor, red: cute.Tensor):
            """"split", every CTA: the residual update at the lane's row (lane < rows per warp), then the CTA's totals
            of the score sums (dots at [0, P/2), sums of squares at [P/2, P)) into mParts[bidx]."""
            NB, NC, P = self.res.NB, self.res.NC, self.res.P
            a = mine.to(BFloat16).to(Float32)  # a as stored (bf16), as the "last" form reads it
            if cutlass.const_expr(self.res.delta_mode == 1):
                cs[NB] = cs[NB] + a
            else:
                cs[NB] = a
            acc = cute.make_rmem_tensor((P,), Float32)
            acc.fill(0.0)
            if lane < self.per_warp:
                if n_mine < self.H:
                    mP[0, n_mine] = cs[NB]
                    for s in cutlass.range_constexpr(NC):
                        acc[s] = cs[s] * qk[0]
                        acc[P // 2 + s] = cs[s] * cs[s]
            self.res.sums_to_smem(acc, lane, warp, red)
            if tidx < P:
                mParts[bidx, tidx] = self.res.summed(red, tidx)

        @cute.jit
        def finish(self, gB: cute.Tensor, gP: cute.Tensor, gN: cute.Tensor, gO: cute.Tensor, mParts: cute.Tensor,
                   tidx: Int32, lane: Int32, warp: Int32, red: cute.Tensor, sW: cute.Tensor, red2: cute.Tensor):
            """"split", the last CTA: the CTAs' score sums added (one CTA's per thread, a fixed order), the softmax,
            and the mix of the candidates (the updated partial as the other CTAs stored it) with its RMSNorm."""
            res = self.res
            K, T, NC, NB, P, R = res.K, res.T, res.NC, res.NB, res.P, res.R
            nrm = cute.make_rmem_tensor((VEC, K), Float32)
            vals = cute.make_rmem_tensor((VEC, K, R), Float32)
            nrm.fill(0.0)
            vals.fill(0.0)
            tmp = cute.make_rmem_tensor((VEC,), Float32)
            for k in cutlass.range_constexpr(K):
                j = tidx + T * k
                if res.exact or j < res.n4:
                    _load4(gN[(None, j)], nrm[(None, k)])
                    for r in cutlass.range_constexpr(R):
                        if cutlass.const_expr(NC - R + r < NB):
                            _load4(gB[(None, (0, NC - R + r, j))], vals[(None, k, r)])
                        else:
                            _load4(gP[(None, (0, j))], vals[(None, k, r)])
            acc = cute.make_rmem_tensor((P,), Float32)
            acc.fill(0.0)
            for c in cutlass.range_constexpr(-(-self.ctas // T)):
                t = tidx + T * c
                if t < self.ctas:
                    for i in cutlass.range_constexpr(P):
                        acc[i] = acc[i] + mParts[t, i]
            wts = res.softmax_weights(acc, tidx, lane, warp, red, sW, red2)
            res.mix_and_store(gB, gO, Int32(0), tidx, lane, warp, vals, wts, nrm, tmp, red2)

        def row_slice(self, gW: cute.Tensor, gw, stride, j, it, lane) -> cute.Tensor:
            """The lane's 16-byte slice `it` of the warp's row j (row gw + stride * j of W): a row past the last
            reads the last row (its sum is not stored), a slice past K the last slice (its activations are zeros).
            Plain functions from here on, inlined where they are called (so no condition inside)."""
            n = cutlass.min(gw + stride * j, self.H - 1)
            kk = it * 32 + lane
            if not self.exact:
                kk = cutlass.min(kk, self.K // VEC - 1)
            return gW[(None, (n, kk))]

        def preload_rows(self, gW: cute.Tensor, pre: cute.Tensor, gw, stride, lane, warp):
            """All of the warp's rows (`rows_pre`), the lane's 16-byte slices, copied into shared memory `pre`
            [slice, lane, k-slice, row, warp] with `cp.async`, then committed."""
            for j in range(self.rows_pre):
                for it in range(self.iters):
                    copy_async_16(self.row_slice(gW, gw, stride, j, it, lane), pre[(None, lane, it, j, warp)])
            cute.arch.cp_async_commit_group()

        def load_rows(self, gW: cute.Tensor, wt: cute.Tensor, gw, stride, j, lane):
            """Rows gw + stride * (j + r) of W, r < ROWS_AT_ONCE, the lane's 16-byte slices, into wt."""
            for r in range(ROWS_AT_ONCE):
                for it in range(self.iters):
                    cute.autovec_copy(self.row_slice(gW, gw, stride, j + r, it, lane), wt[None, it, r])


def _check(w, x, a, partial, counter) -> None:
    H, K = w.shape
    if x.shape != (1, K) or a.shape != (1, H) or partial.shape != (1, H):
        raise ValueError(f"oproj_attn_res: one sequence: x [1, {K}], a and partial [1, {H}] expected, got x "
                         f"{tuple(x.shape)}, a {tuple(a.shape)}, partial {tuple(partial.shape)}")
    if w.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or a.dtype != torch.bfloat16 or K % VEC:
        raise ValueError("oproj_attn_res: bf16 W [H, K], o [1, K] and a [1, H], K a multiple of 8")
    if not (w.is_contiguous() and x.is_contiguous() and a.is_contiguous()) or w.data_ptr() % 16 or x.data_ptr() % 16:
        raise ValueError("oproj_attn_res: W, o and a must be contiguous, W and o 16-byte aligned")
    if counter.dtype != torch.int32 or counter.shape != (1,):
        raise ValueError("oproj_attn_res: the counter must be one int32")


def _aligns(args) -> list[int]:
    """The alignment each argument is compiled for: 16 bytes for W and o (16-byte loads), 4 for the counter, and
    AttnRes's own (4 elements) for its tensors and the score sums."""
    return [16, 16] + [_res_align(t) for t in args[2:9]] + [4, _res_align(args[10])]


def _parts_view(parts, ctas: int, n_blocks: int) -> torch.Tensor:
    """The [ctas, P] fp32 view of `parts` the "split" form stores its CTAs' score sums in."""
    need = ctas * parts_width(n_blocks)
    if (parts is None or parts.dtype != torch.float32 or parts.dim() != 1 or not parts.is_contiguous()
            or parts.numel() < need or parts.data_ptr() % 16):
        raise ValueError(f"oproj_attn_res: KIMI_DECODE_OPROJ_RES=split needs `parts`, a contiguous 16-byte aligned "
                         f"fp32 vector of at least {need} elements")
    return parts[:need].view(ctas, parts_width(n_blocks))


def compile_oproj_attn_res(w, x, a, blocks, partial, query, key_norm, input_norm, out, counter, *, n_blocks: int,
                           delta_mode: int, eps: float, ctas: int | None = None, parts: torch.Tensor | None = None):
    """Checks the arguments and compiles (once per shape and setting); returns (compiled kernel, its arguments).
    `parts`: scratch for the "split" form (`KIMI_DECODE_OPROJ_RES`), fp32, at least ctas * 32 elements will do for
    any n_blocks; not read otherwise."""
    from .attn_res import _check as check_res

    _check(w, x, a, partial, counter)
    check_res(blocks, partial, a, query, key_norm, input_norm, out, n_blocks, False, delta_mode, True)
    if delta_mode not in (1, 2):
        raise ValueError("oproj_attn_res: the projection is the residual update: delta_mode 1 or 2")
    ctas = ctas or sm_count()
    early = env_choice("KIMI_DECODE_OPROJ_EARLY", "1", EARLY_MODES)
    rest = rest_mode()
    op = OProjAttnRes(w.shape[0], w.shape[1], ctas, n_blocks, delta_mode, eps, early, split=res_mode() == "split",
                      rest=rest)
    # the score sums' scratch; in the "last" form the partial stands in (never read)
    scratch = _parts_view(parts, ctas, n_blocks) if op.split else partial
    args = (w, x, a, blocks, partial, query, key_norm, input_norm, out, counter, scratch)
    # the "last" form runs AttnRes's body, whose residual update follows KIMI_DECODE_ATTN_RES_LOADS_FIRST
    key = ("oproj_attn_res", int(n_blocks), int(delta_mode), float(eps), ctas, early, op.split, rest,
           op.res.loads_first and not op.split, *signature(*args))
    return compile_kernel(key, op, *(fake_like(t, align=al) for t, al in zip(args, _aligns(args)))), args


def oproj_attn_res(w, x, a, blocks, partial, query, key_norm, input_norm, out, counter, *, n_blocks: int,
                   delta_mode: int, eps: float, parts: torch.Tensor | None = None) -> torch.Tensor:
    """a = bf16(x @ w.T), then `attn_res.attn_res(blocks, partial, a, ..., out, n_blocks=n_blocks, commit=False,
    delta_mode=delta_mode, use_partial=True, eps=eps)`, in one kernel, for one sequence. `counter` is one int32
    that is 0 (and left at 0) that no other kernel uses at the same time; `parts` the "split" form's scratch
    (`compile_oproj_attn_res`). Returns out."""
    fn, args = compile_oproj_attn_res(w, x, a, blocks, partial, query, key_norm, input_norm, out, counter,
                                      n_blocks=n_blocks, delta_mode=delta_mode, eps=eps, parts=parts)
    aligns = {id(t): al for t, al in zip(args, _aligns(args))}
    launch(fn, *args, align=lambda t: aligns[id(t)])
    return out
