"""The whole router in one kernel: router GEMV, sigmoid, correction bias, top-k and renormalisation.

The GEMV is the small-batch GEMV's (`gemv.SmallBatchGemv`, split-K inside the CTA: 896 CTAs of 4 warps for K3's
896 experts), writing fp32 logits. The CTA that finishes last (`cute_common.last_cta`: an atomic counter that
resets itself, so the kernel replays in a CUDA graph as it is) then routes each row from those logits:
  1. each of its 128 threads holds the scores sigmoid(logit) + bias of experts tidx, tidx + 128, ... in registers
     (7 for 896 experts);
  2. each warp finds the top k of its 224 in k rounds of a warp arg-max (a butterfly over (score, expert) pairs;
     the smaller expert id wins a tie), removing each round's winner from its lane's registers by comparison, with
     no indexed register access; lane r keeps round r's winner, so each warp's k candidates come out sorted;
  3. the 4 x k candidates go through shared memory, and each candidate's rank is the number of candidates ahead of
     it (4 k comparisons per thread, one thread per candidate): the candidates of rank < k are the row's top k, in
     descending order, as torch.topk gives them;
  4. one warp reads the selected experts' logits again, and writes the ids and the weights sigmoid / sum x scaling.
The rounds and the comparisons are loops, not unrolled: this code runs once per launch, so its instructions are
fetched cold; with them unrolled (2,280 instructions) the layer was 1.5 us slower than with two kernels on the H200.
Step 2 has two forms (`KIMI_DECODE_TOPK_FORM`): "redux", the default, takes each round's winner with two warp
reductions (`redux.sync`) over the keys as int32 that order as the floats do, the winning lane then taking its next
best; "shuffle" finds it with 5 butterfly steps of (score, expert) pairs after a scan of each lane's keys.
Rows are routed one after another (a row's routing takes ~4 us alone on the H200), so the backend uses this kernel at
batch 1 only. From 2 rows on the router projection writes the logits and `route_topk` routes them: the same steps
in a kernel of one CTA per row, every row at once (5.1-5.4 us per launch alone, the generic Triton top-k 8.3-8.5;
benchmarks/NOTES.md item 49), up to 64 rows by default (item 64; `KIMI_DECODE_CUTE_TOPK`).
"""
from __future__ import annotations

import torch

from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, env_choice, fake_like, launch, signature
from .gemv import MAX_ROWS, VEC, WARPS

if HAVE_CUTE:
    from cutlass import Float32, Int32

    from .cute_common import last_cta, pdl_launch_dependents, pdl_wait, sigmoid
    from .gemv import SmallBatchGemv

THREADS = 32 * WARPS
NEG = -3.0e38  # below every score (sigmoid + bias of bounded logits)
FORMS = ("shuffle", "redux")
_NO_ID = 1 << 30  # above every expert id
_GONE = -(1 << 31)  # below every ordered key: a key already taken


def topk_form() -> str:
    """KIMI_DECODE_TOPK_FORM: how each warp finds its top k, "redux" (the default: two warp reductions per round;
    alone 5.1-5.4 us per launch on the H200 against 6.1-6.3, and 1-2 us faster per layer at batches 2-16,
    benchmarks/NOTES.md item 49) or "shuffle" (butterflies of (score, expert) pairs, for A/B)."""
    return env_choice("KIMI_DECODE_TOPK_FORM", "redux", FORMS)


if HAVE_CUTE:
    from cutlass._mlir.dialects import llvm as _llvm

    def _sel(cond, a, b):
        return cutlass.select_(cond, a, b)

    def _asm(result, text: str, constraints: str, *args, effects: bool = False):
        return result(_llvm.inline_asm(result.mlir_type, [a.ir_value() for a in args], text, constraints,
                                       has_side_effects=effects, is_align_stack=False,
                                       asm_dialect=_llvm.AsmDialect.AD_ATT))

    # fp32 bits <-> an int32 that orders as the float does (negative floats: all but the sign bit flipped); the map
    # is its own inverse
    _ORDER = "{\n .reg .b32 s, b;\n mov.b32 b, $1;\n shr.s32 s, b, 31;\n and.b32 s, s, 0x7FFFFFFF;\n xor.b32 $0, b, s;\n}"
    _UNORDER = "{\n .reg .b32 s, b;\n shr.s32 s, $1, 31;\n and.b32 s, s, 0x7FFFFFFF;\n xor.b32 b, $1, s;\n mov.b32 $0, b;\n}"

    def _ordered(x) -> Int32:
        return _asm(Int32, _ORDER, "=r,f", Float32(x))

    def _from_ordered(k) -> Float32:
        return _asm(Float32, _UNORDER, "=f,r", Int32(k))

    def _warp_max(v) -> Int32:
        return _asm(Int32, "redux.sync.max.s32 $0, $1, 0xffffffff;", "=r,r", Int32(v), effects=True)

    def _warp_min(v) -> Int32:
        return _asm(Int32, "redux.sync.min.s32 $0, $1, 0xffffffff;", "=r,r", Int32(v), effects=True)

    class Routing:
        """The routing of one row from its fp32 logits by a CTA of THREADS threads (steps 1-4 above)."""

        def routing_shape(self, E: int, topk: int, scaling: float) -> None:
            self.E, self.topk, self.scaling = E, topk, float(scaling)
            self.per = -(-E // THREADS)  # scores per thread
            self.exact = self.per * THREADS == E
            self.cands = WARPS * topk
            self.form = topk_form()

        def allocate_routing(self, smem):
            """The shared memory `route` needs: the warps' candidates (values, ids) and the chosen ids."""
            cand_v = smem.allocate_tensor(Float32, cute.make_layout(self.cands), 16)
            cand_i = smem.allocate_tensor(Int32, cute.make_layout(self.cands), 16)
            chosen = smem.allocate_tensor(Int32, cute.make_layout(self.topk), 16)
            return cand_v, cand_i, chosen

        @cute.jit
        def route(self, mL: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor,
                  cand_v: cute.Tensor, cand_i: cute.Tensor, chosen: cute.Tensor, m: Int32, tidx: Int32):
            lane = tidx % 32
            warp = tidx // 32
            key = cute.make_rmem_tensor((self.per,), Float32)
            for i in cutlass.range_constexpr(self.per):
                e = tidx + THREADS * i
                key[i] = Float32(NEG)
                if self.exact or e < self.E:
                    key[i] = sigmoid(mL[m, e]) + mBias[e]
            if cutlass.const_expr(self.form == "redux"):
                self.rounds_redux(key, cand_v, cand_i, tidx, lane, warp)
            else:
                self.rounds_shuffle(key, cand_v, cand_i, tidx, lane, warp)
            cute.arch.barrier()
            if tidx < self.cands:
                v = cand_v[tidx]
                vi = cand_i[tidx]
                rank = Int32(0)
                for j in cutlass.range(self.cands, unroll=4):
                    ov = cand_v[j]
                    oi = cand_i[j]
                    rank = rank + Int32(_sel((ov > v) | ((ov == v) & (oi < vi)), Int32(1), Int32(0)))
                if rank < self.topk:
                    chosen[rank] = vi
            cute.arch.barrier()
            if warp == 0:
                idx = Int32(0)
                s = Float32(0.0)
                if lane < self.topk:
                    idx = chosen[lane]
                    s = sigmoid(mL[m, idx])
                tot = cute.arch.warp_reduction(s, lambda a, b: a + b)
                if lane < self.topk:
                    mIds[m, lane] = idx
                    mWts[m, lane] = s / tot * Float32(self.scaling)
            cute.arch.barrier()  # the next row reuses the candidates' shared memory

        @cute.jit
        def rounds_shuffle(self, key: cute.Tensor, cand_v: cute.Tensor, cand_i: cute.Tensor, tidx: Int32, lane: Int32,
                           warp: Int32):
            """Step 2 as butterflies: each round every lane scans its keys for its best, 5 shuffle steps of (score,
            expert) pairs give the warp's, and its owner drops it; lane r keeps round r's winner."""
            my_v = Float32(NEG)
            my_i = Int32(0)
            for r in cutlass.range(self.topk, unroll=1):  # a loop: unrolled code is fetched cold per replay
                bv = key[0]
                bi = tidx
                for i in cutlass.range_constexpr(1, self.per):
                    take = key[i] > bv
                    bv = Float32(_sel(take, key[i], bv))
                    bi = Int32(_sel(take, tidx + THREADS * i, bi))
                for s in cutlass.range_constexpr(5):
                    off = 16 >> s
                    ov = cute.arch.shuffle_sync_bfly(bv, offset=off)
                    oi = cute.arch.shuffle_sync_bfly(bi, offset=off)
                    take = (ov > bv) | ((ov == bv) & (oi < bi))
                    bv = Float32(_sel(take, ov, bv))
                    bi = Int32(_sel(take, oi, bi))
                for i in cutlass.range_constexpr(self.per):
                    key[i] = Float32(_sel(tidx + THREADS * i == bi, Float32(NEG), key[i]))
                my_v = Float32(_sel(lane == r, bv, my_v))
                my_i = Int32(_sel(lane == r, bi, my_i))
            if lane < self.topk:
                cand_v[warp * self.topk + lane] = my_v
                cand_i[warp * self.topk + lane] = my_i

        @cute.jit
        def rounds_redux(self, key: cute.Tensor, cand_v: cute.Tensor, cand_i: cute.Tensor, tidx: Int32, lane: Int32,
                         warp: Int32):
            """Step 2 with warp reductions (`redux.sync`): the keys as integers that order as the floats do; each
            round one reduction gives the warp's best key, a second the smallest expert id holding it, whose lane
            writes the candidate and drops the key, then takes its next best. Two instructions where the butterfly
            takes five dependent shuffle steps of pairs."""
            ks = cute.make_rmem_tensor((self.per,), Int32)
            for i in cutlass.range_constexpr(self.per):
                ks[i] = _ordered(key[i])
            best, best_id = self.lane_best(ks, tidx)
            for r in cutlass.range(self.topk, unroll=1):  # a loop: unrolled code is fetched cold per replay
                top = _warp_max(best)
                wid = _warp_min(Int32(_sel(best == top, best_id, Int32(_NO_ID))))
                win = (best == top) & (best_id == wid)
                if win:
                    cand_v[warp * self.topk + r] = _from_ordered(top)
                    cand_i[warp * self.topk + r] = wid
                for i in cutlass.range_constexpr(self.per):
                    ks[i] = Int32(_sel(win & (tidx + THREADS * i == wid), Int32(_GONE), ks[i]))
                best, best_id = self.lane_best(ks, tidx)

        @cute.jit
        def lane_best(self, ks: cute.Tensor, tidx: Int32):
            """The lane's largest key and the expert holding it (the smallest such id)."""
            best = ks[0]
            for i in cutlass.range_constexpr(1, self.per):
                best = cutlass.max(best, ks[i])
            best_id = Int32(tidx + THREADS * (self.per - 1))
            for j in cutlass.range_constexpr(self.per - 1):
                i = self.per - 2 - j
                best_id = Int32(_sel(ks[i] == best, tidx + THREADS * i, best_id))
            return best, best_id

    class RouterTopK(SmallBatchGemv, Routing):
        def __init__(self, M: int, E: int, K: int, topk: int, scaling: float, preload: int = 0):
            super().__init__(M, E, K, accumulate=False, addend=False, preload=preload)
            self.routing_shape(E, topk, scaling)

        @cute.jit
        def __call__(self, mW: cute.Tensor, mX: cute.Tensor, mL: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor,
                     mWts: cute.Tensor, mCnt: cute.Tensor, stream):
            gW = cute.zipped_divide(mW, (1, VEC))
            gX = cute.zipped_divide(mX, (1, VEC))
            N = mL.shape[1]
            self.kernel(gW, gX, mL, mBias, mIds, mWts, mCnt, N).launch(
                grid=[cute.ceil_div(N, self.rows), 1, 1], block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, gW: cute.Tensor, gX: cute.Tensor, mL: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor,
                   mWts: cute.Tensor, mCnt: cute.Tensor, N: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            nblk, _, _ = cute.arch.grid_dim()
            smem = cutlass.utils.SmemAllocator()
            red = smem.allocate_tensor(Float32, cute.make_layout((WARPS, 2 * self.M)), 16)
            cand_v, cand_i, chosen = self.allocate_routing(smem)
            flag = smem.allocate_tensor(Int32, cute.make_layout(1), 4)
            pre = self.allocate_preload(smem)
            self.project(gW, gX, mL, mL, mL, N, red, tidx, bidx, pre)
            if last_cta(mCnt, flag, tidx, nblk) != 0:
                for m in cutlass.range(self.M):
                    self.route(mL, mBias, mIds, mWts, cand_v, cand_i, chosen, m, tidx)

    class RouteTopK(Routing):
        """The routing alone, from logits another kernel wrote: one CTA per row, so every row is routed at once."""

        def __init__(self, E: int, topk: int, scaling: float):
            self.routing_shape(E, topk, scaling)

        @cute.jit
        def __call__(self, mL: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor, stream):
            self.kernel(mL, mBias, mIds, mWts).launch(grid=[mL.shape[0], 1, 1], block=[THREADS, 1, 1], stream=stream,
                                                      use_pdl=self.pdl_launch)

        @cute.kernel
        def kernel(self, mL: cute.Tensor, mBias: cute.Tensor, mIds: cute.Tensor, mWts: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            pdl_launch_dependents(self.pdl)
            smem = cutlass.utils.SmemAllocator()
            cand_v, cand_i, chosen = self.allocate_routing(smem)
            pdl_wait(self.pdl)
            self.route(mL, mBias, mIds, mWts, cand_v, cand_i, chosen, bidx, tidx)


def _check(w, x, logits, bias, ids, weights, counter) -> None:
    M, K = x.shape
    E = w.shape[0]
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"router_topk: 1..{MAX_ROWS} rows, got {M}")
    if w.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or w.shape[1] != K or K % VEC:
        raise ValueError("router_topk: bf16 router weights [E, K] and x [M, K], K a multiple of 8")
    if not (w.is_contiguous() and x.is_contiguous()):
        raise ValueError("router_topk: router weights and x must be contiguous")
    _check_outputs("router_topk", M, E, logits, bias, ids, weights, ("counter", counter, torch.int32, (1,)))


def _check_outputs(who: str, M: int, E: int, logits, bias, ids, weights, *more) -> None:
    """The routing's tensors for M rows of E experts (and `more` (name, tensor, dtype, shape) specs): a top-k the
    warps' candidates fit in, each tensor contiguous with its dtype and shape."""
    k = ids.shape[1] if ids.dim() == 2 else 0
    if not 1 <= k <= 32 or WARPS * k > THREADS or k > E:
        raise ValueError(f"{who}: top-k of 1..32 (at most the {E} experts), got {k}")
    for name, t, dtype, shape in (("logits", logits, torch.float32, (M, E)), ("bias", bias, torch.float32, (E,)),
                                  ("ids", ids, torch.int32, (M, k)), ("weights", weights, torch.float32, (M, k)),
                                  *more):
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{who}: {name} must be a contiguous {dtype} tensor of shape {shape}")


def compile_router_topk(w, x, logits, bias, ids, weights, counter, scaling: float):
    _check(w, x, logits, bias, ids, weights, counter)
    args = (w, x, logits, bias, ids, weights, counter)
    key = ("router_topk", float(scaling), topk_form(), *signature(*args))
    op = RouterTopK(x.shape[0], w.shape[0], x.shape[1], ids.shape[1], scaling)
    return compile_kernel(key, op, *(fake_like(t, align=4 if t is counter else 16) for t in args))


def router_topk(w: torch.Tensor, x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor, counter: torch.Tensor, *, scaling: float):
    """ids [M, k] int32 and weights [M, k] fp32 of the top k of sigmoid(x @ w.T) + bias per row, in descending
    order, the weights being the selected sigmoids renormalised to sum `scaling`; `logits` [M, E] fp32 receives
    x @ w.T. `counter` is one int32 that must be 0 (it is left at 0) and that no other kernel uses at the same time."""
    fn = compile_router_topk(w, x, logits, bias, ids, weights, counter, scaling)
    launch(fn, w, x, logits, bias, ids, weights, counter, align=lambda t: 4 if t is counter else 16)
    return ids, weights


def _check_routing(logits, bias, ids, weights) -> None:
    M, E = logits.shape if logits.dim() == 2 else (0, 0)
    if not 1 <= M <= 65535:
        raise ValueError(f"route_topk: logits [M, E] with 1..65535 rows, got shape {tuple(logits.shape)}")
    _check_outputs("route_topk", M, E, logits, bias, ids, weights)


def compile_route_topk(logits, bias, ids, weights, scaling: float):
    _check_routing(logits, bias, ids, weights)
    args = (logits, bias, ids, weights)
    key = ("route_topk", float(scaling), topk_form(), *signature(*args))
    op = RouteTopK(logits.shape[1], ids.shape[1], scaling)
    return compile_kernel(key, op, *(fake_like(t, align=4) for t in args))


def route_topk(logits: torch.Tensor, bias: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *,
               scaling: float):
    """`router_topk`'s routing alone, from fp32 `logits` [M, E] another kernel wrote: ids [M, k] int32 and weights
    [M, k] fp32, in place, one CTA per row (any number of rows routed in the time of one)."""
    fn = compile_route_topk(logits, bias, ids, weights, scaling)
    launch(fn, logits, bias, ids, weights, align=4)
    return ids, weights
