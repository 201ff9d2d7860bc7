"""Fused KDA decode step: one kernel for what the generic path does in three.

For each (head, sequence), one CTA of head_dim * split threads (`KIMI_DECODE_KDA_SPLIT`, by default 4 groups of
head_dim threads, 2 from 17 sequences on: `kda_split`) does:
  1. the causal depthwise conv (width 4) on the q, k, v channels, with the conv-state shift, then SiLU (group p does
     parts p, p + split, ...: q, k and v at once at the default);
  2. q and k L2 normalisation (q scaled by head_dim**-0.5), the bounded decay gate
     exp(lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))) and beta = sigmoid(b);
  3. the delta rule on the fp32 state: thread (v, p) owns rows p * head_dim / split .. of column v of S, so
     S = diag(decay) S,  S += beta * k^T (v - k S),  o = q S  need, beyond q, k, decay in shared memory, one sum of
     the groups' partial k S and one of their partial q S;
  4. per-head RMSNorm of o times o_norm and the sigmoid output gate.
With split 1 (one thread per column) each thread runs the two 128-long recurrences and the gate's 128-long dot
product alone, with its whole column in registers; splitting shortens those serial chains by the split and leaves
registers to load the gate weights early.
The inputs come straight from the fused input projection's output (q, k, v, g, b at their column offsets). With
`f_col` given, the kernel also does the decay gate's low-rank up-projection: `f` is then the weight f_b [heads *
head_dim, rank] and thread (v, p) computes its part of f[v] = f_b[v] . y[f_col : f_col + rank] (one GEMV kernel
fewer). f_b may come column-major (a [heads * head_dim, rank] view of a contiguous [rank, heads * head_dim] copy,
`f_b.t().contiguous().t()`): then the 32 lanes of a warp read 64 consecutive bytes per r instead of 32 rows 2 * rank
bytes apart, which is what made the row-major form slower than the separate f_b GEMV (benchmarks/NOTES.md, v7).
Each thread loads its state rows, its conv state and weights, and its f_b words at split 4 and up, first: the state was
written by the last step, not by the kernel before, so those loads are in flight during the conv and the gate, and
under PDL before the wait for the input projection (`KIMI_DECODE_KDA_STATE_FIRST=0`: the state after the conv, as
measured before v14). Under PDL with the "wait" trigger, `KIMI_DECODE_KDA_TRIGGER=late` lets the next kernel (the
output projection, which loads its weights before its own wait) launch only once every thread has read its inputs
(after the first barrier), so that the next kernel's weight stream does not queue in front of them.
"""
from __future__ import annotations

import os

import torch

from .cute_common import (HAVE_CUTE, compile_kernel, cute, cutlass, env_choice, env_flag, env_int, fake_like, launch,
                          signature)

if HAVE_CUTE:
    from .cute_common import pdl_launch_dependents, pdl_reads_ahead, pdl_wait, sigmoid

if HAVE_CUTE:
    from cutlass import Float32

    # math on explicit Float32 values: cutlass-dsl 4.3.5 hands back raw MLIR values from mixed Python-float arithmetic
    def _exp(x):
        return cute.math.exp(Float32(x))

    def _rsqrt(x):
        return cute.math.rsqrt(Float32(x))


    class KDADecode:
        def __init__(self, heads: int, head_dim: int, width: int, b_col: int, eps: float, lower_bound: float,
                     f_col: int = -1, f_rank: int = 0, state_first: bool = True, split: int = 1,
                     trigger_late: bool = False, inputs_first: bool = False):
            self.H, self.D, self.W = heads, head_dim, width
            self.inputs_first = inputs_first  # the input projection's values loaded right after the wait
            self.d = heads * head_dim
            self.b_col, self.eps, self.lb = b_col, eps, lower_bound
            self.f_col, self.f_rank = f_col, f_rank  # f_col >= 0: `f` is f_b and the gate input is computed here
            self.state_first = state_first  # the state column's loads first (before the PDL wait), not after the conv
            self.P = split  # thread groups per head: group p owns rows p*D/P .. of every state column
            self.trigger_late = trigger_late  # KIMI_DECODE_KDA_TRIGGER=late

        @cute.jit
        def __call__(self, y: cute.Tensor, f: cute.Tensor, conv_state: cute.Tensor, conv_w: cute.Tensor,
                     A_log: cute.Tensor, dt_bias: cute.Tensor, S: cute.Tensor, o_norm: cute.Tensor,
                     out: cute.Tensor, stream):
            B = y.shape[0]
            self.kernel(y, f, conv_state, conv_w, A_log, dt_bias, S, o_norm, out).launch(
                grid=[self.H, B, 1], block=[self.D * self.P, 1, 1], stream=stream, use_pdl=self.pdl_launch)

        def _sum_groups(self, v, part: cute.Tensor, p, t):
            """v summed over the thread groups of column t, through `part` (split * head_dim floats of shared
            memory); inlined where it is called (a plain function: straight-line code only)."""
            if self.P == 1:
                return v
            part[p * self.D + t] = v
            cute.arch.barrier()
            total = Float32(0.0)
            for pp in range(self.P):
                total = total + part[pp * self.D + t]
            return total

        def _gate_part(self, y: cute.Tensor, f: cute.Tensor, fw: cute.Tensor, early_f: bool, b, ch, p, RR: int):
            """Thread (ch, p)'s part of the gate input: f_b[ch, p RR .. (p + 1) RR] . y[b, f_col + p RR ..], f_b's
            words from `fw` where they were loaded early. A plain function: inlined where it is called."""
            fp = Float32(0.0)
            for i in range(RR):
                w_i = fw[i] if early_f else f[ch, p * RR + i].to(Float32)
                fp = fp + w_i * y[b, self.f_col + p * RR + i].to(Float32)
            return fp

        @cute.kernel
        def kernel(self, y: cute.Tensor, f: cute.Tensor, conv_state: cute.Tensor, conv_w: cute.Tensor,
                   A_log: cute.Tensor, dt_bias: cute.Tensor, S: cute.Tensor, o_norm: cute.Tensor,
                   out: cute.Tensor):
            tid, _, _ = cute.arch.thread_idx()
            h, b, _ = cute.arch.block_idx()
            D, P, W = self.D, self.P, self.W
            R = D // P  # state rows per thread
            NP = (3 + P - 1) // P  # conv parts (q, k, v) per group: group p does parts p, p + P, ...
            RR = self.f_rank // P if self.f_col >= 0 else 0  # f_b columns per thread
            WD = D // 32  # warps per group
            t = tid % D  # the column / channel
            p = tid // D  # the group (warp-uniform)
            ch = h * D + t
            pdl_launch_dependents(self.pdl)
            late = self.pdl and self.trigger_late and pdl_reads_ahead()  # the trigger after the inputs are read
            # the state, the conv state (both written by the last step, many kernels back) and the weights: loaded
            # before the PDL wait unless kernels may run far ahead
            ahead = not self.pdl or pdl_reads_ahead()
            if cutlass.const_expr(not ahead):
                pdl_wait(self.pdl)
            col = cute.make_rmem_tensor((R,), Float32)
            if cutlass.const_expr(self.state_first):
                for i in cutlass.range_constexpr(R):
                    col[i] = S[b, h, p * R + i, t]
            cw = cute.make_rmem_tensor((NP * W,), Float32)
            cs = cute.make_rmem_tensor((NP * (W - 1),), Float32)
            for j in cutlass.range_constexpr(NP):
                c = cutlass.min(p + j * P, 2) * self.d + ch  # parts past v (groups with nothing to do) read v's
                for jj in cutlass.range_constexpr(W):
                    cw[j * W + jj] = conv_w[c, jj]
                for jj in cutlass.range_constexpr(W - 1):
                    cs[j * (W - 1) + jj] = conv_state[b, c, jj].to(Float32)
            # f_b's words before the wait too, where they fit in registers beside the state (not at one group)
            early_f = RR <= 32
            fw = cute.make_rmem_tensor((max(RR, 1) if early_f else 1,), Float32)
            if cutlass.const_expr(early_f):
                for i in cutlass.range_constexpr(RR):
                    fw[i] = f[ch, p * RR + i].to(Float32)
            a_h = _exp(A_log[h])
            dt = dt_bias[ch]
            on = o_norm[t]
            if cutlass.const_expr(ahead):
                pdl_wait(self.pdl, trigger=not late)

            smem = cutlass.utils.SmemAllocator()
            sX = smem.allocate_tensor(Float32, cute.make_layout(3 * D), 16)  # q, k, v after the conv and SiLU
            sQ = smem.allocate_tensor(Float32, cute.make_layout(D), 16)
            sK = smem.allocate_tensor(Float32, cute.make_layout(D), 16)
            sDecay = smem.allocate_tensor(Float32, cute.make_layout(D), 16)
            sF = smem.allocate_tensor(Float32, cute.make_layout(P * D), 16)  # the groups' partial f_b dots
            sKS = smem.allocate_tensor(Float32, cute.make_layout(P * D), 16)  # partial k S
            sO = smem.allocate_tensor(Float32, cute.make_layout(P * D), 16)  # partial q S
            red = smem.allocate_tensor(Float32, cute.make_layout(2 * WD), 16)

            g = y[b, 3 * self.d + ch].to(Float32)
            beta = sigmoid(y[b, self.b_col + h].to(Float32))
            first = self.inputs_first  # a trace-time constant (`inputs_first()`)
            xin = cute.make_rmem_tensor((NP,), Float32)  # "first": every conv part's input, before any store
            if cutlass.const_expr(first):
                for j in cutlass.range_constexpr(NP):
                    xin[j] = y[b, cutlass.min(p + j * P, 2) * self.d + ch].to(Float32)
            fp = Float32(0.0)  # the thread's part of the decay gate's input, f_b[ch] . y[f_col ..] (f_col >= 0)
            if cutlass.const_expr(RR > 0 and first):
                fp = self._gate_part(y, f, fw, early_f, b, ch, p, RR)
            fg = Float32(0.0)  # "first", without f_col: the gate input f, for group 0
            if cutlass.const_expr(RR == 0 and first):
                fg = f[b, ch].to(Float32)
            for j in cutlass.range_constexpr(NP):
                part = p + j * P
                c = cutlass.min(part, 2) * self.d + ch
                if cutlass.const_expr(first):
                    x_new = xin[j]
                else:
                    x_new = y[b, c].to(Float32)
                acc = x_new * cw[j * W + W - 1]
                for jj in cutlass.range_constexpr(W - 1):
                    acc = acc + cs[j * (W - 1) + jj] * cw[j * W + jj]
                act = Float32(acc) * sigmoid(acc)
                if part < 3:
                    for jj in cutlass.range_constexpr(1, W - 1):
                        conv_state[b, c, jj - 1] = cs[j * (W - 1) + jj].to(conv_state.element_type)
                    conv_state[b, c, W - 2] = x_new.to(conv_state.element_type)
                    sX[part * D + t] = act
                    sq = cute.arch.warp_reduction(act * act, lambda x, z: x + z)
                    if part < 2 and t % 32 == 0:
                        red[part * WD + t // 32] = sq  # q and k sums of squares, per warp
            if cutlass.const_expr(RR > 0):
                if cutlass.const_expr(not first):
                    fp = self._gate_part(y, f, fw, early_f, b, ch, p, RR)
                sF[p * D + t] = fp
            cute.arch.barrier()
            if cutlass.const_expr(late):
                cute.arch.griddepcontrol_launch_dependents()

            if p == 0:  # q and k L2-normalised, the decay gate, for channel t
                sum_q = Float32(0.0)
                sum_k = Float32(0.0)
                for w in cutlass.range_constexpr(WD):
                    sum_q = sum_q + red[w]
                    sum_k = sum_k + red[WD + w]
                sQ[t] = sX[t] * _rsqrt(sum_q + Float32(1e-6)) * Float32(D ** -0.5)
                sK[t] = sX[D + t] * _rsqrt(sum_k + Float32(1e-6))
                f_v = Float32(0.0)
                if cutlass.const_expr(RR > 0):
                    for pp in cutlass.range_constexpr(P):
                        f_v = f_v + sF[pp * D + t]
                elif cutlass.const_expr(first):
                    f_v = fg
                else:
                    f_v = f[b, ch].to(Float32)
                sDecay[t] = _exp(Float32(self.lb) * sigmoid(a_h * (f_v + dt)))
            cute.arch.barrier()

            k_s = Float32(0.0)
            for i in cutlass.range_constexpr(R):
                r = p * R + i
                if cutlass.const_expr(self.state_first):
                    s = col[i] * sDecay[r]
                else:
                    s = S[b, h, r, t] * sDecay[r]
                col[i] = s
                k_s = k_s + sK[r] * s
            k_s = self._sum_groups(k_s, sKS, p, t)
            delta = beta * (sX[2 * D + t] - k_s)
            o = Float32(0.0)
            for i in cutlass.range_constexpr(R):
                r = p * R + i
                s = col[i] + sK[r] * delta
                S[b, h, r, t] = s
                o = o + sQ[r] * s
            o = self._sum_groups(o, sO, p, t)

            so = cute.arch.warp_reduction(o * o, lambda x, z: x + z)  # RMSNorm of the head's o: group 0's warps
            if p == 0 and t % 32 == 0:
                red[t // 32] = so
            cute.arch.barrier()
            if p == 0:
                sum_o = Float32(0.0)
                for w in cutlass.range_constexpr(WD):
                    sum_o = sum_o + red[w]
                res = o * _rsqrt(sum_o * Float32(1.0 / D) + Float32(self.eps)) * on * sigmoid(g)
                out[b, ch] = res.to(out.element_type)


SPLIT = 4  # thread groups per head by default (KIMI_DECODE_KDA_SPLIT)
# from this many sequences on, SPLIT_WIDE groups instead: at 32 and 64 rows on the H200 2 groups streamed the state
# faster than 4 (benchmarks/NOTES.md items 65, 66), where 4 had been the faster at 1 and 8 (v15)
SPLIT_WIDE, SPLIT_WIDE_FROM = 2, 17


def kda_split(head_dim: int, rank: int = 0, rows: int = 1) -> int:
    """Thread groups per head (`KIMI_DECODE_KDA_SPLIT`: "auto", the default, SPLIT below SPLIT_WIDE_FROM sequences
    (`rows`) and SPLIT_WIDE from there, or a count; 1 is one thread per state column): each owns head_dim / split
    rows of every column and rank / split of the gate's f_b columns."""
    raw = os.environ.get("KIMI_DECODE_KDA_SPLIT", "auto")
    if raw == "auto":
        split = SPLIT_WIDE if rows >= SPLIT_WIDE_FROM else SPLIT
    else:
        split = env_int("KIMI_DECODE_KDA_SPLIT", SPLIT, 1, 1024, "a number of thread groups")
    if head_dim % split or rank % split or head_dim * split > 1024:
        raise ValueError(f"KIMI_DECODE_KDA_SPLIT={split}: the thread groups per head must divide head_dim "
                         f"({head_dim}) and the gate rank ({rank}), with head_dim * groups <= 1024 threads")
    return split


def inputs_first() -> bool:
    """KIMI_DECODE_KDA_INPUTS_FIRST: where each thread loads what it reads of the input projection's output (written
    by the kernel before): "1" all of it right after the PDL wait, before the conv-state stores, so that the L2 round
    trips overlap: every conv part's input, and the decay gate's f_a words (with f_b applied here, `f_col`, then
    its part of f_b . f_a formed at once) or the gate input f; "0", the default, each where it is used: the second
    conv part's input (2 thread groups: from 17 sequences on) after the first part's conv-state stores, the f_a
    words or f after all of them. A load after a store that may alias it (as far as the compiler knows) waits for
    it, so in "0" those are L2 round trips one after another. On the H200 the two were even (within 0.3 us per KDA
    layer at batches 1, 8 and 64, both shards, benchmarks/NOTES.md item 86), so those round trips are not what
    the layer waits for, and "0" stays, the form measured longer."""
    return env_flag("KIMI_DECODE_KDA_INPUTS_FIRST", "0")


def compile_kda_decode(y, f, conv_state, conv_w, A_log, dt_bias, S, o_norm, out, *, b_col, eps, lower_bound,
                       f_col: int = -1):
    B, H, D, _ = S.shape
    state_first = env_flag("KIMI_DECODE_KDA_STATE_FIRST", "1")
    rank = f.shape[1] if f_col >= 0 else 0
    split = kda_split(D, rank, y.shape[0])
    late = env_choice("KIMI_DECODE_KDA_TRIGGER", "wait", ("wait", "late")) == "late"
    first = inputs_first()
    key = ("kda_decode", b_col, eps, lower_bound, f_col, state_first, split, late, first,
           *signature(y, f, conv_state, conv_w, A_log, dt_bias, S, o_norm, out))
    op = KDADecode(H, D, conv_w.shape[1], b_col, eps, lower_bound, f_col, rank, state_first, split, late, first)
    return compile_kernel(key, op, *(fake_like(t, align=4) for t in (y, f, conv_state, conv_w, A_log, dt_bias, S,
                                                                      o_norm, out)))


def kda_decode(y, f, conv_state, conv_w, A_log, dt_bias, S, o_norm, out, *, b_col: int, eps: float,
               lower_bound: float, f_col: int | None = None) -> torch.Tensor:
    """In place: conv_state and S advance one token; out [B, heads * head_dim] receives the gated, normed o.

    `f` is the decay gate's input [B, heads * head_dim], or with `f_col` the weight f_b [heads * head_dim, rank]
    applied here to y's columns f_col .. f_col + rank."""
    B, H, D, _ = S.shape
    if D % 32 or D > 1024 or not S.is_contiguous() or S.dtype != torch.float32:
        raise ValueError("KDA decode needs a contiguous fp32 state with head_dim a multiple of 32")
    if f_col is not None and (f.shape[0] != H * D or f_col < 0 or f_col + f.shape[1] > y.shape[1]
                              or not (f.is_contiguous() or f.t().is_contiguous())):
        raise ValueError(f"KDA decode: f_b must be [{H * D}, rank], row- or column-major, with y's columns "
                         f"f_col .. f_col + rank inside y")
    if (y.stride(1) != 1 or out.stride(1) != 1 or not conv_state.is_contiguous()
            or (f_col is None and f.stride(1) != 1)):
        raise ValueError("KDA decode needs row-contiguous inputs")
    fn = compile_kda_decode(y, f, conv_state, conv_w, A_log, dt_bias, S, o_norm, out, b_col=b_col, eps=eps,
                            lower_bound=lower_bound, f_col=-1 if f_col is None else f_col)
    launch(fn, y, f, conv_state, conv_w, A_log, dt_bias, S, o_norm, out, align=4)
    return out
