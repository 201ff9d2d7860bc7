"""AttnRes step in one CTA per sequence: residual update, block commit, softmax mix over candidates, input RMSNorm.

Same function as the Triton `_attn_res_kernel` (and the torch twin in `AutoBackend.attn_res`):
  commit:        blocks[b, n_blocks - 1] = partial[b]            (the old partial, before the update)
  delta_mode 1:  partial[b] += delta[b];  2: partial[b] = delta[b]
  candidates:    blocks[b, 0 .. n_blocks - 1], then partial[b] (the updated one) if use_partial
  score_s = <c_s, query * key_norm> / sqrt(mean(c_s**2) + eps);  mix = sum_s softmax(score)_s c_s
  out[b] = bf16(mix * rsqrt(mean(mix**2) + eps) * input_norm)

The Triton kernel is latency-bound (one block-wide reduction per candidate, in sequence). Here every thread owns
`CHUNKS` 16-byte slices of the row (`THREADS` threads per row), so:
  1. the weights (query * key_norm, input_norm) are loaded before the PDL wait, and so are the committed blocks,
     which AttnRes steps two or more kernels back wrote (`blocks_early`); then every candidate slice is read once, and
     each thread forms all its partial sums (dot and sum of squares per candidate) in registers;
  2. all of them are reduced at once: a transposing butterfly inside each warp (P - 1 shuffles for P values instead of
     5 P), one shared-memory step, a barrier, then warp 0 alone adds the warps' sums, takes the softmax and writes the
     weights to shared memory (a second barrier) -- doing it redundantly in every warp would cost more shuffle and
     shared-memory throughput than the extra barrier;
  3. the mix is formed in registers, and its sum of squares goes through one more (scalar) block reduction.
Candidate slices stay in registers as far as the register file allows (the most recent ones: the partial and the
newly committed block first); the older blocks are read a second time for the mix (L1 / L2 hits).
n_blocks, commit, delta_mode and use_partial are compile-time constants.
"""
from __future__ import annotations

import torch

from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, env_flag, fake_like, launch, signature

if HAVE_CUTE:
    from .cute_common import pdl_launch_dependents, pdl_reads_ahead, pdl_wait

VEC = 4  # fp32 per 16-byte access
MAX_THREADS = 512
REG_FILE = 65536  # 32-bit registers per SM (one CTA per row, so the CTA may use all of them)
REG_RESERVE = 24  # registers per thread kept free for addresses, indices, loop state


def plan(hidden: int) -> tuple[int, int]:
    """(threads, 16-byte chunks per thread) covering a row of `hidden` fp32 with at most MAX_THREADS threads."""
    n4 = hidden // VEC
    chunks = -(-n4 // MAX_THREADS)
    threads = -(-n4 // chunks)
    return -(-threads // 32) * 32, chunks


def blocks_early() -> bool:
    """Whether the AttnRes kernel under PDL reads the committed blocks before its wait (`KIMI_DECODE_ATTN_RES_EARLY`:
    "1", the default, or "0": after it, with the partial)."""
    return env_flag("KIMI_DECODE_ATTN_RES_EARLY", "1")


def loads_first() -> bool:
    """Whether the AttnRes kernel issues all of a thread's loads of the partial and the delta (written by the kernels
    just before it) ahead of its first store (`KIMI_DECODE_ATTN_RES_LOADS_FIRST`: "1", the default; "0": each
    slice's loads, add and store in turn). As far as the compiler knows, a store to the partial (or the committed
    block) may alias the delta's next slice, so in the "0" form each slice's delta load is issued only once the
    slice before it is stored, which waits for that slice's loads: one L2 round trip per slice (4 at H = 7168), one
    after another. On the H200 "1" was 0.3-1.0 us faster per KDA layer at TP16 batches 1 and 8, and even elsewhere
    (benchmarks/NOTES.md, item 86)."""
    return env_flag("KIMI_DECODE_ATTN_RES_LOADS_FIRST", "1")


def _next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


if HAVE_CUTE:
    from cutlass import BFloat16, Float32, Int32

    def _sel(cond, a, b):
        return Float32(cutlass.select_(cond, Float32(a), Float32(b)))

    def _max(a, b):
        return _sel(a > b, a, b)

    def _warp_transpose_sum(vals: list, lane):
        """Sums each of the P = len(vals) (a power of two <= 32) values over the warp, leaving the total of value
        `lane >> (5 - log2 P)` in each lane: at each butterfly step a lane keeps one half of its values and sends the
        other half to its partner, so the P values cost P - 1 shuffles (plus 5 - log2 P for the last one)."""
        n, off = len(vals), 16
        while n > 1:
            half = n // 2
            upper = (lane & off) != 0  # this lane keeps the upper half
            new = []
            for i in range(half):
                send = _sel(upper, vals[i], vals[i + half])
                keep = _sel(upper, vals[i + half], vals[i])
                new.append(keep + cute.arch.shuffle_sync_bfly(send, offset=off))
            vals, n, off = new, half, off // 2
        v = vals[0]
        while off >= 1:
            v = v + cute.arch.shuffle_sync_bfly(v, offset=off)
            off //= 2
        return v

    @cute.jit
    def _load4(tile: cute.Tensor, dst: cute.Tensor):
        cute.autovec_copy(tile, dst)

    class AttnRes:
        def __init__(self, hidden: int, n_blocks: int, commit: bool, delta_mode: int, use_partial: bool,
                     eps: float):
            self.H, self.NB, self.commit, self.delta_mode, self.use_partial = (
                hidden, n_blocks, bool(commit), int(delta_mode), bool(use_partial))
            self.eps = float(eps)
            self.blocks_early = blocks_early()
            self.loads_first = loads_first()
            self.T, self.K = plan(hidden)
            self.W = self.T // 32
            self.n4 = hidden // VEC
            self.exact = self.T * self.K == self.n4
            self.NC = n_blocks + int(self.use_partial)  # candidates
            self.P = 2 * _next_pow2(self.NC)  # reduced values: dots at [0, P/2), sums of squares at [P/2, P)
            self.NCP = -(-self.NC // VEC) * VEC  # softmax weights, padded to whole 16-byte loads
            self.WS = self.W | 1  # odd row stride of the warp partial sums: conflict-free reads by lane
            self.W4 = -(-self.W // VEC) * VEC
            # candidates kept in registers: the newest first (the partial, the committed block), as many as fit
            # the register file is split between the 4 schedulers: a thread gets 1/4 of it over the warps of the
            # busiest scheduler (14 warps -> 4 on some scheduler -> 128 registers)
            regcap = min(255, (REG_FILE // 4) // (32 * -(-self.W // 4)) // 8 * 8)
            fixed = 2 * VEC * self.K + 2 * self.NC + REG_RESERVE  # query*key_norm, input_norm, partial sums
            fit = max(0, (regcap - fixed) // (VEC * self.K))
            special = int(self.use_partial) + int(self.commit)
            self.R = min(self.NC, max(fit, special, 1))
            self.resident = list(range(self.NC - self.R, self.NC))
            self.reload = list(range(self.NC - self.R))  # plain blocks, read-only here

        @cute.jit
        def __call__(self, blocks: cute.Tensor, partial: cute.Tensor, delta: cute.Tensor, query: cute.Tensor,
                     key_norm: cute.Tensor, input_norm: cute.Tensor, out: cute.Tensor, stream):
            gB, gP, gD, gQ, gK, gN, gO = self.tiles(blocks, partial, delta, query, key_norm, input_norm, out)
            self.kernel(gB, gP, gD, gQ, gK, gN, gO).launch(grid=[partial.shape[0], 1, 1], block=[self.T, 1, 1],
                                                           stream=stream, use_pdl=self.pdl_launch)

        @staticmethod
        def tiles(blocks, partial, delta, query, key_norm, input_norm, out) -> tuple:
            """The tensors as `body` takes them: 16-byte slices along the hidden dimension."""
            return (cute.zipped_divide(blocks, (1, 1, VEC)), cute.zipped_divide(partial, (1, VEC)),
                    cute.zipped_divide(delta, (1, VEC)), cute.zipped_divide(query, (VEC,)),
                    cute.zipped_divide(key_norm, (VEC,)), cute.zipped_divide(input_norm, (VEC,)),
                    cute.zipped_divide(out, (1, VEC)))

        @cute.kernel
        def kernel(self, gB: cute.Tensor, gP: cute.Tensor, gD: cute.Tensor, gQ: cute.Tensor, gK: cute.Tensor,
                   gN: cute.Tensor, gO: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            b, _, _ = cute.arch.block_idx()
            pdl_launch_dependents(self.pdl)
            smem = cutlass.utils.SmemAllocator()
            red, sW, red2 = self.allocate(smem)
            self.body(gB, gP, gD, gQ, gK, gN, gO, b, tidx, red, sW, red2, self.pdl)

        def allocate(self, smem):
            """The shared memory `body` uses, from the kernel's one allocator."""
            return (smem.allocate_tensor(Float32, cute.make_layout(self.P * self.WS), 16),
                    smem.allocate_tensor(Float32, cute.make_layout(self.NCP), 16),
                    smem.allocate_tensor(Float32, cute.make_layout(self.W4), 16))

        def plain_blocks(self, gB: cute.Tensor, b, j, k: int, vals: cute.Tensor, acc: cute.Tensor, qk: cute.Tensor,
                         tmp: cute.Tensor):
            """Slice j (this thread's k-th) of the blocks that are read only: into `vals` where they stay resident,
            else straight into their partial sums (dot with query * key_norm, sum of squares)."""
            P = self.P  # a plain helper, traced inline: Python loops and conditions on constants
            for s in range(self.NB - int(self.commit)):
                if s >= self.NC - self.R:
                    _load4(gB[(None, (b, s, j))], vals[(None, k, s - (self.NC - self.R))])
                else:
                    _load4(gB[(None, (b, s, j))], tmp)
                    for e in range(VEC):
                        acc[s] = acc[s] + tmp[e] * qk[e, k]
                        acc[P // 2 + s] = acc[P // 2 + s] + tmp[e] * tmp[e]

        def update_loads(self, gP: cute.Tensor, gD: cute.Tensor, b, j, k: int, vals: cute.Tensor, dl: cute.Tensor,
                         gB: cute.Tensor | None = None):
            """The residual update / commit at slice j (this thread's k-th): the partial's loads into `vals` (slot
            R - 1 when it is a candidate, the old partial, when committed, just below it) and the delta's into `dl`.
            With `gB` (the "0" form of `loads_first`) each slice's stores follow its loads here (`update_stores`),
            as the kernel was first written; without it the caller stores once every slice is loaded. A plain
            function: inlined where it is called."""
            r_new = self.R - 1
            r_old = self.R - 1 - int(self.use_partial)
            if self.commit:
                _load4(gP[(None, (b, j))], vals[(None, k, r_old)])
                if gB is not None:
                    cute.autovec_copy(vals[(None, k, r_old)], gB[(None, (b, self.NB - 1, j))])
            if self.use_partial:
                if self.delta_mode != 2:  # the partial before the delta: the old one as committed, or loaded
                    if self.commit:
                        if gB is not None:
                            for e in range(VEC):
                                vals[e, k, r_new] = vals[e, k, r_old]
                    else:
                        _load4(gP[(None, (b, j))], vals[(None, k, r_new)])
                if self.delta_mode:
                    _load4(gD[(None, (b, j))], dl)
                    if gB is not None:
                        self.update_partial(gP, b, j, k, vals, dl)

        def update_stores(self, gB: cute.Tensor, gP: cute.Tensor, b, j, k: int, vals: cute.Tensor, dl: cute.Tensor):
            """`update_loads`'s stores at slice j once every slice is loaded: the commit, and the updated partial."""
            r_new = self.R - 1
            r_old = self.R - 1 - int(self.use_partial)
            if self.commit:
                cute.autovec_copy(vals[(None, k, r_old)], gB[(None, (b, self.NB - 1, j))])
                if self.use_partial and self.delta_mode != 2:
                    for e in range(VEC):
                        vals[e, k, r_new] = vals[e, k, r_old]
            if self.use_partial and self.delta_mode:
                self.update_partial(gP, b, j, k, vals, dl)

        def update_partial(self, gP: cute.Tensor, b, j, k: int, vals: cute.Tensor, dl: cute.Tensor):
            """The partial at slice j updated with the delta in `dl` (delta_mode 1: added, 2: replaced) and stored."""
            r_new = self.R - 1
            for e in range(VEC):
                if self.delta_mode == 1:
                    vals[e, k, r_new] = vals[e, k, r_new] + dl[e].to(Float32)
                else:
                    vals[e, k, r_new] = dl[e].to(Float32)
            cute.autovec_copy(vals[(None, k, r_new)], gP[(None, (b, j))])

        @cute.jit
        def body(self, gB: cute.Tensor, gP: cute.Tensor, gD: cute.Tensor, gQ: cute.Tensor, gK: cute.Tensor,
                 gN: cute.Tensor, gO: cute.Tensor, b: Int32, tidx: Int32, red: cute.Tensor, sW: cute.Tensor,
                 red2: cute.Tensor, pdl: cutlass.Constexpr):
            """Sequence b's AttnRes step by the T threads of one CTA (the whole kernel but for its launch and shared
            memory, so that another kernel's last CTA can run it); with `pdl` it waits for the previous kernel after
            loading the weights."""
            lane = tidx % 32
            warp = tidx // 32
            K, T, P = self.K, self.T, self.P

            # weights first: they do not depend on the previous kernel
            qk = cute.make_rmem_tensor((VEC, K), Float32)
            nrm = cute.make_rmem_tensor((VEC, K), Float32)
            qk.fill(0.0)
            nrm.fill(0.0)
            tmp = cute.make_rmem_tensor((VEC,), Float32)
            for k in cutlass.range_constexpr(K):
                j = tidx + T * k
                if self.exact or j < self.n4:
                    _load4(gQ[(None, j)], qk[(None, k)])
                    _load4(gK[(None, j)], tmp)
                    _load4(gN[(None, j)], nrm[(None, k)])
                    for e in cutlass.range_constexpr(VEC):
                        qk[e, k] = qk[e, k] * tmp[e]
            vals = cute.make_rmem_tensor((VEC, K, self.R), Float32)
            vals.fill(0.0)
            acc = cute.make_rmem_tensor((P,), Float32)
            acc.fill(0.0)
            # the committed blocks were written by AttnRes steps two or more kernels back: under PDL with the trigger
            # after the wait they are read (and the older ones' partial sums formed) before it
            early = bool(pdl and self.blocks_early and pdl_reads_ahead())  # a trace-time constant
            if cutlass.const_expr(early):
                for k in cutlass.range_constexpr(K):
                    j = tidx + T * k
                    if self.exact or j < self.n4:
                        self.plain_blocks(gB, b, j, k, vals, acc, qk, tmp)
            pdl_wait(pdl)

            # residual update / commit, then the candidates' partial sums
            dl = cute.make_rmem_tensor((VEC,), BFloat16)
            first = self.loads_first  # a trace-time constant
            dls = cute.make_rmem_tensor((VEC, K if first else 1), BFloat16)
            if cutlass.const_expr(first):
                for k in cutlass.range_constexpr(K):
                    j = tidx + T * k
                    if self.exact or j < self.n4:
                        self.update_loads(gP, gD, b, j, k, vals, dls[(None, k)])
                for k in cutlass.range_constexpr(K):
                    j = tidx + T * k
                    if self.exact or j < self.n4:
                        self.update_stores(gB, gP, b, j, k, vals, dls[(None, k)])
            for k in cutlass.range_constexpr(K):
                j = tidx + T * k
                if self.exact or j < self.n4:
                    if cutlass.const_expr(not first):
                        self.update_loads(gP, gD, b, j, k, vals, dl, gB)
                    if cutlass.const_expr(not early):
                        self.plain_blocks(gB, b, j, k, vals, acc, qk, tmp)
                    for r in cutlass.range_constexpr(self.R):
                        s = self.NC - self.R + r
                        for e in cutlass.range_constexpr(VEC):
                            acc[s] = acc[s] + vals[e, k, r] * qk[e, k]
                            acc[P // 2 + s] = acc[P // 2 + s] + vals[e, k, r] * vals[e, k, r]

            wts = self.softmax_weights(acc, tidx, lane, warp, red, sW, red2)
            self.mix_and_store(gB, gO, b, tidx, lane, warp, vals, wts, nrm, tmp, red2)

        @cute.jit
        def sums_to_smem(self, acc: cute.Tensor, lane: Int32, warp: Int32, red: cute.Tensor):
            """The first half of a block reduction of the P sums `acc` of every thread: a transposing butterfly in
            each warp, its totals into `red` [P, WS], then a barrier; `summed(red, i)` adds up sum i."""
            P = self.P
            tot = _warp_transpose_sum([acc[i] for i in range(P)], lane)
            if lane % (32 // P) == 0:
                red[(lane // (32 // P)) * self.WS + warp] = tot
            cute.arch.barrier()

        def summed(self, red: cute.Tensor, i):
            """Sum i (< P) over the warps, from `sums_to_smem`'s `red` (a plain function, inlined)."""
            t = Float32(0.0)
            for w in range(self.W):
                t = t + red[i * self.WS + w]
            return t

        @cute.jit
        def softmax_weights(self, acc: cute.Tensor, tidx: Int32, lane: Int32, warp: Int32, red: cute.Tensor,
                            sW: cute.Tensor, red2: cute.Tensor) -> cute.Tensor:
            """The softmax weights of the candidates, in every thread's registers, from each thread's partial sums
            `acc` (dots at [0, P/2), sums of squares at [P/2, P)); also zeroes red2's padding for `mix_and_store`."""
            NC, P = self.NC, self.P
            # one block reduction of all 2 NC sums: transposing butterfly, shared memory, warp 0 finishes
            self.sums_to_smem(acc, lane, warp, red)
            if warp == 0:
                t = Float32(0.0)
                if lane < P:
                    t = self.summed(red, lane)
                ssq = cute.arch.shuffle_sync_down(t, offset=P // 2)
                valid = lane < NC
                score = _sel(valid, t * cute.math.rsqrt(ssq * Float32(1.0 / self.H) + Float32(self.eps)),
                             Float32(-3.0e38))
                mx = cute.arch.warp_reduction(score, _max, threads_in_group=P // 2)
                ex = cute.math.exp(score - mx)
                den = cute.arch.warp_reduction(ex, lambda x, y: x + y, threads_in_group=P // 2)
                wgt = _sel(valid, ex / den, Float32(0.0))
                if lane < self.NCP:
                    sW[lane] = wgt
            if tidx < self.W4 - self.W:
                red2[self.W + tidx] = Float32(0.0)
            cute.arch.barrier()
            wts = cute.make_rmem_tensor((self.NCP,), Float32)
            sW4 = cute.zipped_divide(sW, (VEC,))
            wts4 = cute.zipped_divide(wts, (VEC,))
            for i in cutlass.range_constexpr(self.NCP // VEC):
                cute.autovec_copy(sW4[(None, i)], wts4[(None, i)])
            return wts

        @cute.jit
        def mix_and_store(self, gB: cute.Tensor, gO: cute.Tensor, b: Int32, tidx: Int32, lane: Int32, warp: Int32,
                          vals: cute.Tensor, wts: cute.Tensor, nrm: cute.Tensor, tmp: cute.Tensor, red2: cute.Tensor):
            """out = bf16(mix * rstd(mix) * input_norm) for this thread's slices: the mix of the resident candidates
            `vals` (the R newest) and the plain blocks read again, weighted by `wts`."""
            K, T = self.K, self.T
            # the mix (in place of the newest candidate's registers) and its sum of squares
            mss = Float32(0.0)
            for k in cutlass.range_constexpr(K):
                j = tidx + T * k
                if self.exact or j < self.n4:
                    for e in cutlass.range_constexpr(VEC):
                        tmp[e] = Float32(0.0)
                    for s in cutlass.range_constexpr(len(self.reload)):
                        mv = cute.make_rmem_tensor((VEC,), Float32)
                        _load4(gB[(None, (b, s, j))], mv)
                        for e in cutlass.range_constexpr(VEC):
                            tmp[e] = tmp[e] + wts[s] * mv[e]
                    for r in cutlass.range_constexpr(self.R):
                        s = self.NC - self.R + r
                        for e in cutlass.range_constexpr(VEC):
                            tmp[e] = tmp[e] + wts[s] * vals[e, k, r]
                    for e in cutlass.range_constexpr(VEC):
                        vals[e, k, self.R - 1] = tmp[e]
                        mss = mss + tmp[e] * tmp[e]
            mss = cute.arch.warp_reduction(mss, lambda x, y: x + y)
            if lane == 0:
                red2[warp] = mss
            cute.arch.barrier()
            parts = cute.make_rmem_tensor((self.W4,), Float32)
            red24 = cute.zipped_divide(red2, (VEC,))
            parts4 = cute.zipped_divide(parts, (VEC,))
            for i in cutlass.range_constexpr(self.W4 // VEC):
                cute.autovec_copy(red24[(None, i)], parts4[(None, i)])
            total = Float32(0.0)
            for i in cutlass.range_constexpr(self.W4):
                total = total + parts[i]
            rstd = cute.math.rsqrt(total * Float32(1.0 / self.H) + Float32(self.eps))

            o = cute.make_rmem_tensor((VEC,), BFloat16)
            for k in cutlass.range_constexpr(K):
                j = tidx + T * k
                if self.exact or j < self.n4:
                    for e in cutlass.range_constexpr(VEC):
                        o[e] = (vals[e, k, self.R - 1] * rstd * nrm[e, k]).to(BFloat16)
                    cute.autovec_copy(o, gO[(None, (b, j))])


def _check(blocks, partial, delta, query, key_norm, input_norm, out, n_blocks, commit, delta_mode, use_partial):
    if blocks.dim() != 3 or partial.dim() != 2:
        raise ValueError("attn_res: blocks [B, NB, H] and partial [B, H] expected")
    B, H = partial.shape
    if blocks.shape[0] != B or blocks.shape[2] != H or H % VEC:
        raise ValueError(f"attn_res: blocks {tuple(blocks.shape)} do not match partial {tuple(partial.shape)} "
                         f"(hidden a multiple of {VEC})")
    if not 0 <= n_blocks <= blocks.shape[1] or n_blocks + int(bool(use_partial)) < 1 or (commit and n_blocks < 1):
        raise ValueError(f"attn_res: n_blocks {n_blocks} out of range for {blocks.shape[1]} blocks")
    if n_blocks + int(bool(use_partial)) > 16:
        raise ValueError("attn_res: at most 16 candidates")
    if delta_mode not in (0, 1, 2):
        raise ValueError(f"attn_res: delta_mode {delta_mode} is not 0, 1 or 2")
    if delta_mode and not use_partial:
        raise ValueError("attn_res: a residual update (delta_mode 1 or 2) needs use_partial")
    if delta_mode and (delta is None or delta.shape != partial.shape or delta.dtype != torch.bfloat16):
        raise ValueError("attn_res: delta must be bf16 [B, H] when delta_mode is 1 or 2")
    if blocks.dtype != torch.float32 or partial.dtype != torch.float32 or out.dtype != torch.bfloat16:
        raise ValueError("attn_res: fp32 blocks and partial, bf16 out expected")
    if out.shape != partial.shape:
        raise ValueError(f"attn_res: out {tuple(out.shape)} must be [B, H] = {tuple(partial.shape)}")
    for name, w in (("query", query), ("key_norm", key_norm), ("input_norm", input_norm)):
        if w.shape != (H,) or w.dtype != torch.float32:
            raise ValueError(f"attn_res: {name} must be fp32 [{H}]")
    tensors = [blocks, partial, query, key_norm, input_norm, out] + ([delta] if delta_mode else [])
    for t in tensors:
        if t.stride(-1) != 1 or any(s % VEC for s in t.stride()[:-1]):
            raise ValueError("attn_res: rows must be contiguous, with row strides a multiple of 4 elements")
        if t.data_ptr() % (VEC * t.element_size()):
            raise ValueError("attn_res: tensors must be aligned to 4 elements")


def _align(t: torch.Tensor) -> int:
    return VEC * t.element_size()


def compile_attn_res(blocks, partial, delta, query, key_norm, input_norm, out, *, n_blocks: int, commit: bool,
                     delta_mode: int, use_partial: bool, eps: float):
    """Checks the arguments and compiles (once per flags and layouts); returns (compiled kernel, its arguments)."""
    _check(blocks, partial, delta, query, key_norm, input_norm, out, n_blocks, commit, delta_mode, use_partial)
    return _compile(blocks, partial, delta, query, key_norm, input_norm, out, n_blocks, commit, delta_mode,
                    use_partial, eps)


def _compile(blocks, partial, delta, query, key_norm, input_norm, out, n_blocks, commit, delta_mode, use_partial,
             eps):
    if not delta_mode:
        delta = out  # not read; any bf16 [B, H] tensor of the right layout keeps the signature fixed
    args = (blocks, partial, delta, query, key_norm, input_norm, out)
    key = ("attn_res", int(n_blocks), bool(commit), int(delta_mode), bool(use_partial), float(eps), blocks_early(),
           loads_first(), *signature(*args))
    fn = compile_kernel(key, AttnRes(partial.shape[1], n_blocks, commit, delta_mode, use_partial, eps),
                        *(fake_like(t, align=_align(t)) for t in args))
    return fn, args


def attn_res(blocks, partial, delta, query, key_norm, input_norm, out, *, n_blocks: int, commit: bool,
             delta_mode: int, use_partial: bool, eps: float) -> torch.Tensor:
    """The AttnRes step in place (see the module docstring): blocks [B, NB, H] fp32 (any row strides), partial
    [B, H] fp32, delta [B, H] bf16 or None (delta_mode 0), query / key_norm / input_norm [H] fp32, out [B, H] bf16.
    Same arguments and effects as `triton_kernels.attn_res`."""
    _check(blocks, partial, delta, query, key_norm, input_norm, out, n_blocks, commit, delta_mode, use_partial)
    if not all(t.is_cuda for t in (blocks, partial, query, key_norm, input_norm, out)):
        raise ValueError("attn_res: CUDA tensors expected")
    fn, args = _compile(blocks, partial, delta, query, key_norm, input_norm, out, n_blocks, commit, delta_mode,
                        use_partial, eps)
    launch(fn, *args, align=_align)
    return out
