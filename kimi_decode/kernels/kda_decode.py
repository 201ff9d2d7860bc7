"""Fused KDA decode step: one kernel for what the generic path does in three.

For each (head, sequence), one CTA of head_dim threads does:
  1. the causal depthwise conv (width 4) on the q, k, v channels, with the conv-state shift, then SiLU;
  2. q and k L2 normalisation (q scaled by head_dim**-0.5), the bounded decay gate
     exp(lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))) and beta = sigmoid(b);
  3. the delta rule on the fp32 state: thread v owns column v of S (head_dim registers), so
     S = diag(decay) S,  S += beta * k^T (v - k S),  o = q S  need no communication beyond q, k, decay in shared memory;
  4. per-head RMSNorm of o times o_norm and the sigmoid output gate.
The inputs come straight from the fused input projection's output (q, k, v, g, b at their column offsets). With
`f_col` given, the kernel also does the decay gate's low-rank up-projection: `f` is then the weight f_b [heads *
head_dim, rank] and thread v computes f[v] = f_b[v] . y[f_col : f_col + rank] itself (one GEMV kernel fewer). f_b
may come column-major (a [heads * head_dim, rank] view of a contiguous [rank, heads * head_dim] copy, `f_b.t()
.contiguous().t()`): then the 32 lanes of a warp read 64 consecutive bytes per r instead of 32 rows 2 * rank bytes
apart, which is what made the row-major form slower than the separate f_b GEMV (benchmarks/NOTES.md, v7).
Each thread loads its state column first (it was written by the last step, not by the kernel before), so those loads
are in flight during the conv and the gate, and under PDL before the wait for the input projection
(`KIMI_DECODE_KDA_STATE_FIRST=0`: after the conv, as measured before v14).
"""
from __future__ import annotations

import os

import torch

from .cute_common import HAVE_CUTE, compile_kernel, cute, cutlass, fake_like, launch, signature

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
                     f_col: int = -1, f_rank: int = 0, state_first: bool = True):
            self.H, self.D, self.W = heads, head_dim, width
            self.d = heads * head_dim
            self.b_col, self.eps, self.lb = b_col, eps, lower_bound
            self.f_col, self.f_rank = f_col, f_rank  # f_col >= 0: `f` is f_b and the gate input is computed here
            self.state_first = state_first  # the state column's loads first (before the PDL wait), not after the conv

        @cute.jit
        def __call__(self, y: cute.Tensor, f: cute.Tensor, conv_state: cute.Tensor, conv_w: cute.Tensor,
                     A_log: cute.Tensor, dt_bias: cute.Tensor, S: cute.Tensor, o_norm: cute.Tensor,
                     out: cute.Tensor, stream):
            B = y.shape[0]
            self.kernel(y, f, conv_state, conv_w, A_log, dt_bias, S, o_norm, out).launch(
                grid=[self.H, B, 1], block=[self.D, 1, 1], stream=stream, use_pdl=self.pdl_launch)

        @cute.jit
        def _block_sum2(self, a: Float32, b: Float32, red: cute.Tensor):
            """Sums of a and of b over the CTA (red: 2 * warps floats of shared memory)."""
            tidx, _, _ = cute.arch.thread_idx()
            warp = tidx // 32
            a = cute.arch.warp_reduction(a, lambda x, z: x + z)
            b = cute.arch.warp_reduction(b, lambda x, z: x + z)
            if tidx % 32 == 0:
                red[warp] = a
                red[warp + self.D // 32] = b
            cute.arch.barrier()
            sa = Float32(0.0)
            sb = Float32(0.0)
            for w in cutlass.range_constexpr(self.D // 32):
                sa = sa + red[w]
                sb = sb + red[w + self.D // 32]
            cute.arch.barrier()
            return sa, sb

        @cute.kernel
        def kernel(self, y: cute.Tensor, f: cute.Tensor, conv_state: cute.Tensor, conv_w: cute.Tensor,
                   A_log: cute.Tensor, dt_bias: cute.Tensor, S: cute.Tensor, o_norm: cute.Tensor,
                   out: cute.Tensor):
            t, _, _ = cute.arch.thread_idx()
            h, b, _ = cute.arch.block_idx()
            D = self.D
            pdl_launch_dependents(self.pdl)
            col = cute.make_rmem_tensor((D,), Float32)  # thread t's column of the state
            # written by the last step, many kernels back: before the PDL wait unless kernels may run far ahead
            ahead = not self.pdl or pdl_reads_ahead()
            if cutlass.const_expr(not ahead):
                pdl_wait(self.pdl)
            if cutlass.const_expr(self.state_first):
                for kk in cutlass.range_constexpr(D):
                    col[kk] = S[b, h, kk, t]
            if cutlass.const_expr(ahead):
                pdl_wait(self.pdl)
            smem = cutlass.utils.SmemAllocator()
            sQ = smem.allocate_tensor(Float32, cute.make_layout(D), 16)
            sK = smem.allocate_tensor(Float32, cute.make_layout(D), 16)
            sDecay = smem.allocate_tensor(Float32, cute.make_layout(D), 16)
            red = smem.allocate_tensor(Float32, cute.make_layout(2 * (D // 32)), 16)
            ch = h * D + t

            f_v = Float32(0.0)  # the decay gate's input; first, so its loads are in flight during the conv
            if cutlass.const_expr(self.f_col >= 0):
                for r in cutlass.range_constexpr(self.f_rank):
                    f_v = f_v + f[ch, r].to(Float32) * y[b, self.f_col + r].to(Float32)
            else:
                f_v = f[b, ch].to(Float32)

            qkv = cute.make_rmem_tensor((3,), Float32)
            for part in cutlass.range_constexpr(3):
                c = part * self.d + ch
                x_new = y[b, c].to(Float32)
                acc = x_new * conv_w[c, self.W - 1]
                for j in cutlass.range_constexpr(self.W - 1):
                    s_j = conv_state[b, c, j].to(Float32)
                    acc = acc + s_j * conv_w[c, j]
                    if cutlass.const_expr(j > 0):
                        conv_state[b, c, j - 1] = s_j.to(conv_state.element_type)
                conv_state[b, c, self.W - 2] = x_new.to(conv_state.element_type)
                qkv[part] = Float32(acc) * sigmoid(acc)

            q = qkv[0]
            k = qkv[1]
            v = qkv[2]
            sum_q, sum_k = self._block_sum2(q * q, k * k, red)
            sQ[t] = q * _rsqrt(sum_q + Float32(1e-6)) * Float32(D ** -0.5)
            sK[t] = k * _rsqrt(sum_k + Float32(1e-6))
            gate_in = _exp(A_log[h]) * (f_v + dt_bias[ch])
            sDecay[t] = _exp(Float32(self.lb) * sigmoid(gate_in))
            beta = sigmoid(y[b, self.b_col + h].to(Float32))
            cute.arch.barrier()

            k_s = Float32(0.0)
            for kk in cutlass.range_constexpr(D):
                if cutlass.const_expr(self.state_first):
                    s = col[kk] * sDecay[kk]
                else:
                    s = S[b, h, kk, t] * sDecay[kk]
                col[kk] = s
                k_s = k_s + sK[kk] * s
            delta = beta * (v - k_s)
            o = Float32(0.0)
            for kk in cutlass.range_constexpr(D):
                s = col[kk] + sK[kk] * delta
                S[b, h, kk, t] = s
                o = o + sQ[kk] * s

            sum_o, _ = self._block_sum2(o * o, Float32(0.0), red)
            g = y[b, 3 * self.d + ch].to(Float32)
            res = o * _rsqrt(sum_o * Float32(1.0 / D) + Float32(self.eps)) * o_norm[t] * sigmoid(g)
            out[b, ch] = res.to(out.element_type)


def compile_kda_decode(y, f, conv_state, conv_w, A_log, dt_bias, S, o_norm, out, *, b_col, eps, lower_bound,
                       f_col: int = -1):
    B, H, D, _ = S.shape
    state_first = os.environ.get("KIMI_DECODE_KDA_STATE_FIRST", "1") == "1"
    key = ("kda_decode", b_col, eps, lower_bound, f_col, state_first,
           *signature(y, f, conv_state, conv_w, A_log, dt_bias, S, o_norm, out))
    op = KDADecode(H, D, conv_w.shape[1], b_col, eps, lower_bound, f_col, f.shape[1] if f_col >= 0 else 0,
                   state_first)
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
