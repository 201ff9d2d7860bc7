"""Triton kernels of the generic (`auto`) path, where vLLM's generic forward uses Triton too.

One operation per kernel: the fused AttnRes mix, the KDA short-convolution update, the KDA recurrent step, the gated
RMSNorm, the SiTU-GLU activation and the MXFP4 routed-expert GEMV. Host wrappers take torch tensors and launch on
the current stream, so they are captured by CUDA graphs.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter (used by the CPU tests) multiplies bf16 tiles wrongly (numpy has no bf16): there the
# expert and MLA kernels widen their bf16 tiles to fp32 before tl.dot; on a GPU bf16 tiles go to the tensor cores.
_DOT_FP32 = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _situ(gate, up):
    # 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25), with tanh(x) = 2 sigmoid(2x) - 1
    tg = 2.0 * tl.sigmoid(gate * 0.5) - 1.0
    tu = 2.0 * tl.sigmoid(up * (2.0 / 25.0)) - 1.0
    return 4.0 * tg * tl.sigmoid(gate) * 25.0 * tu


# ---------------------------------------------------------------------------------------------------------------------
# AttnRes: optional residual update, optional block commit, softmax mix over candidates (online), input RMSNorm


@triton.jit
def _attn_res_kernel(blocks, partial, delta, query, key_norm, input_norm, out,
                     H, s_bb, s_bs, s_pb, s_db, s_ob, eps,
                     N_BLOCKS: tl.constexpr, COMMIT: tl.constexpr, DELTA: tl.constexpr, USE_PARTIAL: tl.constexpr,
                     BLOCK: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    qk = tl.load(query + offs, mask=mask, other=0.0) * tl.load(key_norm + offs, mask=mask, other=0.0)
    if COMMIT:
        p_old = tl.load(partial + b * s_pb + offs, mask=mask, other=0.0)
        tl.store(blocks + b * s_bb + (N_BLOCKS - 1) * s_bs + offs, p_old, mask=mask)
    p = tl.zeros([BLOCK], dtype=tl.float32)
    if USE_PARTIAL:
        if DELTA == 1:  # add the previous sublayer's output
            p = tl.load(partial + b * s_pb + offs, mask=mask, other=0.0)
            p += tl.load(delta + b * s_db + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(partial + b * s_pb + offs, p, mask=mask)
        elif DELTA == 2:  # the open block's first output
            p = tl.load(delta + b * s_db + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(partial + b * s_pb + offs, p, mask=mask)
        else:
            p = tl.load(partial + b * s_pb + offs, mask=mask, other=0.0)

    # online softmax over the candidates: one read of each
    m_run = tl.sum(p * 0.0, axis=0)
    l_run = m_run
    acc = p * 0.0
    for s in tl.static_range(N_BLOCKS + USE_PARTIAL):
        if s < N_BLOCKS:
            v = tl.load(blocks + b * s_bb + s * s_bs + offs, mask=mask, other=0.0)
        else:
            v = p
        score = tl.sum(v * qk, axis=0) / tl.sqrt(tl.sum(v * v, axis=0) / H + eps)
        if s == 0:
            m_run = score
            l_run = m_run * 0.0 + 1.0
            acc = v
        else:
            m_new = tl.maximum(m_run, score)
            alpha = tl.exp(m_run - m_new)
            w = tl.exp(score - m_new)
            acc = acc * alpha + w * v
            l_run = l_run * alpha + w
            m_run = m_new
    mix = acc / l_run
    rstd = 1.0 / tl.sqrt(tl.sum(mix * mix, axis=0) / H + eps)
    y = mix * rstd * tl.load(input_norm + offs, mask=mask, other=0.0)
    tl.store(out + b * s_ob + offs, y.to(out.dtype.element_ty), mask=mask)


def attn_res(blocks, partial, delta, query, key_norm, input_norm, out, *, n_blocks, commit, delta_mode, use_partial,
             eps):
    B, H = partial.shape
    _attn_res_kernel[(B,)](
        blocks, partial, delta if delta is not None else partial, query, key_norm, input_norm, out,
        H, blocks.stride(0), blocks.stride(1), partial.stride(0),
        delta.stride(0) if delta is not None else 0, out.stride(0), eps,
        N_BLOCKS=n_blocks, COMMIT=commit, DELTA=delta_mode, USE_PARTIAL=int(use_partial),
        BLOCK=triton.next_power_of_2(H), num_warps=16 if H > 2048 else 4)


# ---------------------------------------------------------------------------------------------------------------------
# KDA: causal depthwise conv update (width 4) + SiLU


@triton.jit
def _conv_update_kernel(x, state, weight, out, C, s_xb, s_sb, s_sc, s_ob,
                        WIDTH: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = c < C
    xv = tl.load(x + b * s_xb + c, mask=mask, other=0.0).to(tl.float32)
    acc = xv * tl.load(weight + c * WIDTH + (WIDTH - 1), mask=mask, other=0.0)
    for j in tl.static_range(WIDTH - 1):
        sj = tl.load(state + b * s_sb + c * s_sc + j, mask=mask, other=0.0).to(tl.float32)
        acc += sj * tl.load(weight + c * WIDTH + j, mask=mask, other=0.0)
        if j > 0:
            tl.store(state + b * s_sb + c * s_sc + (j - 1), sj.to(state.dtype.element_ty), mask=mask)
    tl.store(state + b * s_sb + c * s_sc + (WIDTH - 2), xv.to(state.dtype.element_ty), mask=mask)
    y = acc * tl.sigmoid(acc)
    tl.store(out + b * s_ob + c, y.to(out.dtype.element_ty), mask=mask)


def conv_update(x, state, weight, out):
    """x [B, C] (strided view allowed), state [B, C, W-1] updated in place, weight [C, W] fp32 -> out [B, C]."""
    B, C = x.shape
    assert x.stride(1) == 1 and state.stride(2) == 1 and weight.is_contiguous()
    BLOCK_C = 256
    _conv_update_kernel[(B, triton.cdiv(C, BLOCK_C))](
        x, state, weight, out, C, x.stride(0), state.stride(0), state.stride(1), out.stride(0),
        WIDTH=weight.shape[1], BLOCK_C=BLOCK_C, num_warps=4)


# ---------------------------------------------------------------------------------------------------------------------
# KDA recurrent step: q/k L2 norm, bounded decay gate, beta, delta rule on the fp32 state (value dim split in blocks)


@triton.jit
def _kda_recurrent_kernel(qkv, f, beta_src, A_log, dt_bias, S, o,
                          H, s_qb, s_fb, s_bb, s_Sb, s_Sh, s_ob, lower_bound, scale,
                          D: tl.constexpr, BV: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    dk = tl.arange(0, D)
    dv = vb * BV + tl.arange(0, BV)
    q = tl.load(qkv + b * s_qb + h * D + dk).to(tl.float32)
    k = tl.load(qkv + b * s_qb + H * D + h * D + dk).to(tl.float32)
    v = tl.load(qkv + b * s_qb + 2 * H * D + h * D + dv).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    fv = tl.load(f + b * s_fb + h * D + dk).to(tl.float32) + tl.load(dt_bias + h * D + dk)
    a = tl.exp(tl.load(A_log + h))
    decay = tl.exp(lower_bound * tl.sigmoid(a * fv))
    beta = tl.sigmoid(tl.load(beta_src + b * s_bb + h).to(tl.float32))

    s_ptr = S + b * s_Sb + h * s_Sh + dk[:, None] * D + dv[None, :]
    st = tl.load(s_ptr) * decay[:, None]
    ks = tl.sum(k[:, None] * st, axis=0)
    st += beta * k[:, None] * (v - ks)[None, :]
    tl.store(s_ptr, st)
    out = tl.sum(q[:, None] * st, axis=0)
    tl.store(o + b * s_ob + h * D + dv, out.to(o.dtype.element_ty))


def kda_recurrent(qkv, f, beta_src, A_log, dt_bias, S, o, *, lower_bound):
    """qkv [B, 3 h D] after conv, f [B, h D], beta_src [B, h] (pre-sigmoid), S [B, h, D, D] in place -> o [B, h D]."""
    B, h, D, _ = S.shape
    assert S.is_contiguous() and qkv.stride(1) == 1 and f.stride(1) == 1
    BV = 32
    _kda_recurrent_kernel[(B, h, D // BV)](
        qkv, f, beta_src, A_log, dt_bias, S, o, h, qkv.stride(0), f.stride(0), beta_src.stride(0),
        S.stride(0), S.stride(1), o.stride(0), lower_bound, D**-0.5, D=D, BV=BV, num_warps=4)


# ---------------------------------------------------------------------------------------------------------------------
# Gated RMSNorm over each head: RMSNorm(o) * w * sigmoid(g)


@triton.jit
def _gated_rmsnorm_kernel(o, g, w, out, s_ob, s_gb, s_outb, eps, D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    x = tl.load(o + b * s_ob + h * D + d).to(tl.float32)
    gate = tl.load(g + b * s_gb + h * D + d).to(tl.float32)
    y = x / tl.sqrt(tl.sum(x * x, axis=0) / D + eps) * tl.load(w + d) * tl.sigmoid(gate)
    tl.store(out + b * s_outb + h * D + d, y.to(out.dtype.element_ty))


def gated_rmsnorm(o, g, w, out, *, heads, eps):
    B = o.shape[0]
    D = w.shape[0]
    _gated_rmsnorm_kernel[(B, heads)](o, g, w, out, o.stride(0), g.stride(0), out.stride(0), eps, D=D, num_warps=4)


# ---------------------------------------------------------------------------------------------------------------------
# SiTU-GLU activation: [rows, 2n] (gate | up) -> [rows, n]


@triton.jit
def _situ_glu_kernel(x, out, N, s_xb, s_ob, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    gate = tl.load(x + r * s_xb + n, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x + r * s_xb + N + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + r * s_ob + n, _situ(gate, up).to(out.dtype.element_ty), mask=mask)


def situ_glu(x, out):
    rows, two_n = x.shape
    N = two_n // 2
    BLOCK = min(1024, triton.next_power_of_2(N))
    _situ_glu_kernel[(rows, triton.cdiv(N, BLOCK))](x, out, N, x.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4)


# ---------------------------------------------------------------------------------------------------------------------
# Routing: sigmoid scores, top-k on score + correction bias, renormalised weights (one program per token)


@triton.jit
def _route_topk_kernel(logits, bias, ids, weights, E, s_lb, scaling,
                       TOPK: tl.constexpr, BLOCK_E: tl.constexpr):
    b = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    mask = e < E
    scores = tl.sigmoid(tl.load(logits + b * s_lb + e, mask=mask, other=0.0))
    sel = tl.where(mask, scores + tl.load(bias + e, mask=mask, other=0.0), float("-inf"))
    k = tl.arange(0, TOPK)
    picked = tl.zeros([TOPK], dtype=tl.int32)
    w = tl.zeros([TOPK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        best = tl.argmax(sel, axis=0)
        picked = tl.where(k == j, best, picked)
        w = tl.where(k == j, tl.sum(tl.where(e == best, scores, 0.0), axis=0), w)
        sel = tl.where(e == best, float("-inf"), sel)
    tl.store(ids + b * TOPK + k, picked)
    tl.store(weights + b * TOPK + k, w / tl.sum(w, axis=0) * scaling)


def route_topk(logits, bias, ids, weights, *, scaling):
    """logits [B, E] fp32 -> ids [B, k] int32 and weights [B, k] fp32 (written in place)."""
    B, E = logits.shape
    _route_topk_kernel[(B,)](logits, bias, ids, weights, E, logits.stride(0), scaling,
                             TOPK=ids.shape[1], BLOCK_E=triton.next_power_of_2(E), num_warps=4)


# ---------------------------------------------------------------------------------------------------------------------
# Expert alignment: group the (token, slot) pairs by expert, so each expert's weights are read once per step


@triton.jit
def _moe_align_kernel(ids, order, seg_start, seg_len, seg_expert, P, BLOCK_P: tl.constexpr, PAD: tl.constexpr):
    p = tl.arange(0, BLOCK_P)
    mask = p < P
    e = tl.load(ids + p, mask=mask, other=PAD)  # padding lanes: an expert id past every real one, sorted last
    key = e * BLOCK_P + p  # sort by expert, then by pair: a stable order (int32: PAD * BLOCK_P + p < 2**31)
    key = tl.sort(key)
    e_sorted = key // BLOCK_P
    tl.store(order + p, key % BLOCK_P, mask=mask)
    tl.store(seg_expert + p, e_sorted, mask=mask)  # scratch: read back shifted by one below
    tl.debug_barrier()
    prev = tl.load(seg_expert + p - 1, mask=mask & (p > 0), other=-1)
    starts = mask & (e_sorted != prev)
    seg = tl.cumsum(starts.to(tl.int32), axis=0) - 1  # segment of each sorted pair
    n_seg = tl.max(tl.where(mask, seg, -1), axis=0) + 1
    tl.debug_barrier()
    # segment s starts at the s-th start; its length runs to the next start
    tl.store(seg_start + seg, p, mask=starts)
    tl.store(seg_expert + seg, e_sorted, mask=starts)
    tl.debug_barrier()
    nxt = tl.load(seg_start + p + 1, mask=p + 1 < n_seg, other=P)
    first = tl.load(seg_start + p, mask=p < n_seg, other=0)
    tl.store(seg_len + p, tl.where(p < n_seg, nxt - first, 0), mask=mask)


def moe_align(ids, order, seg_start, seg_len, seg_expert):
    """ids [P] -> order [P] (pairs sorted by expert), and per segment (one per distinct expert, the rest with
    length 0): start in `order`, length, expert. All [P] int32, written in place."""
    P = ids.numel()
    block = max(16, triton.next_power_of_2(P))
    pad = (2**31 - 1) // block - 1  # the largest id whose keys stay in int32
    if pad < 2**10:  # ids up to 1023 must sort before the padding (K3 has 896 experts)
        raise ValueError(f"moe_align sorts at most {2**21} pairs in one call, got {P}")
    _moe_align_kernel[(1,)](ids, order, seg_start, seg_len, seg_expert, P, BLOCK_P=block, PAD=pad, num_warps=4)


# ---------------------------------------------------------------------------------------------------------------------
# Routed experts, MXFP4 weights dequantised in registers, one program per (expert segment, block of N):
#   out[pair, n] = row_scale[pair] * sum_k W[e, n, k] * x[row(pair), k]
# The expert's weight tile is dequantised once and used for all of its tokens (tensor cores, M padded to 16).


@triton.jit
def _mxfp4_to_bf16(code, scale_byte):
    """e2m1 code (4 bits) times 2**(scale_byte - 127), built directly as bf16 bits: integer work only.

    Exact for scale bytes in [2, 252] (every MXFP4 weight of magnitude between 2**-125 and 2**125).
    """
    c = code.to(tl.int32)
    e = (c >> 1) & 3
    m = c & 1
    field = tl.where(e > 0, e - 1 + scale_byte, tl.where(m > 0, scale_byte - 1, 0))
    bits = ((c >> 3) << 15) | (field << 7) | tl.where(e > 0, m << 6, 0)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _moe_mxfp4_kernel(x, w, w_scale, order, seg_start, seg_len, seg_expert, row_scale, out,
                      N, K, TOPK, s_xr, s_we, s_wn, s_se, s_sn, s_op,
                      X_PER_PAIR: tl.constexpr, HAS_SCALE: tl.constexpr, DOT_FP32: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    dot_dtype = tl.float32 if DOT_FP32 else tl.bfloat16
    seg = tl.program_id(0)
    length = tl.load(seg_len + seg)
    if length == 0:
        return
    start = tl.load(seg_start + seg)
    e = tl.load(seg_expert + seg).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    j = tl.arange(0, BLOCK_K // 2)  # byte index inside the K tile
    g = tl.arange(0, BLOCK_K // GROUP)  # scale index inside the K tile
    mm = tl.arange(0, BLOCK_M)
    w_row = w + e * s_we + n[:, None] * s_wn
    s_row = w_scale + e * s_se + n[:, None] * s_sn
    for m0 in range(0, length, BLOCK_M):
        m_mask = m0 + mm < length
        pair = tl.load(order + start + m0 + mm, mask=m_mask, other=0)
        row = pair if X_PER_PAIR else pair // TOPK
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            packed = tl.load(w_row + k0 // 2 + j[None, :], mask=n_mask[:, None], other=0)
            sc = tl.load(s_row + k0 // GROUP + g[None, :], mask=n_mask[:, None], other=127).to(tl.int32)
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, BLOCK_K // GROUP, GROUP // 2)),
                            (BLOCK_N, BLOCK_K // 2))
            lo = _mxfp4_to_bf16(packed & 0xF, sc).to(dot_dtype)
            hi = _mxfp4_to_bf16(packed >> 4, sc).to(dot_dtype)
            x_even = tl.load(x + row[:, None] * s_xr + k0 + 2 * j[None, :], mask=m_mask[:, None], other=0.0)
            x_odd = tl.load(x + row[:, None] * s_xr + k0 + 2 * j[None, :] + 1, mask=m_mask[:, None], other=0.0)
            acc = tl.dot(x_even.to(dot_dtype), tl.trans(lo), acc)
            acc = tl.dot(x_odd.to(dot_dtype), tl.trans(hi), acc)
        if HAS_SCALE:
            acc = acc * tl.load(row_scale + pair, mask=m_mask, other=0.0)[:, None]
        tl.store(out + pair[:, None] * s_op + n[None, :], acc.to(out.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


def moe_mxfp4(x, w, w_scale, align, out, *, x_per_pair, row_scale=None, group=32):
    """x [rows, K] bf16; w [E, N, K/2] uint8; w_scale [E, N, K/group]; `align` = (order, seg_start, seg_len,
    seg_expert) from `moe_align`; out [P, N]. With `x_per_pair` row p of x feeds pair p, else row p // top_k."""
    order, seg_start, seg_len, seg_expert = align
    P = order.numel()
    _, N, K2 = w.shape
    K = 2 * K2
    topk = 1 if x_per_pair else P // x.shape[0]
    BLOCK_K = next(b for b in (512, 256, 128, 64, 32) if K % b == 0)
    BLOCK_N = 32 if N <= 1024 else 64
    assert K % BLOCK_K == 0 and x.stride(1) == 1 and w.is_contiguous() and w_scale.is_contiguous()
    _moe_mxfp4_kernel[(P, triton.cdiv(N, BLOCK_N))](
        x, w, w_scale, order, seg_start, seg_len, seg_expert, row_scale if row_scale is not None else x, out,
        N, K, topk, x.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1), out.stride(0),
        X_PER_PAIR=x_per_pair, HAS_SCALE=row_scale is not None, DOT_FP32=_DOT_FP32, BLOCK_M=16, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        GROUP=group, num_warps=4)


# ---------------------------------------------------------------------------------------------------------------------
# MLA decode over the FP8 latent cache (absorbed, NoPE): split-KV flash decoding, then a combine over the splits.
#   scores[h, t] = q[h, :] . kv[t, :] * kv_scale * sm_scale;  o[h, :] = softmax(scores)[h, :] @ kv[:, :C] * kv_scale


@triton.jit
def _mla_split_kernel(q, kv, kv_scale, lengths, m_out, l_out, acc_out,
                      H, T_cap, chunk, s_qb, s_qh, s_kb, s_kt, sm_scale,
                      C: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                      DOT_FP32: tl.constexpr):
    dot_dtype = tl.float32 if DOT_FP32 else tl.bfloat16
    b = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    n_sp = tl.num_programs(2)
    hh = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = hh < H
    c = tl.arange(0, C)
    r = tl.arange(0, R)
    q_c = tl.load(q + b * s_qb + hh[:, None] * s_qh + c[None, :], mask=h_mask[:, None], other=0.0).to(dot_dtype)
    q_r = tl.load(q + b * s_qb + hh[:, None] * s_qh + C + r[None, :], mask=h_mask[:, None], other=0.0).to(dot_dtype)
    length = tl.load(lengths + b)
    scale = tl.load(kv_scale) * sm_scale
    t0 = sp * chunk
    t1 = tl.minimum(t0 + chunk, length)
    m_i = tl.full([BLOCK_H], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, C], dtype=tl.float32)
    for ts in range(t0, t1, BLOCK_T):
        t = ts + tl.arange(0, BLOCK_T)
        t_mask = t < t1
        base = kv + b * s_kb + t[:, None] * s_kt
        k_c = tl.load(base + c[None, :], mask=t_mask[:, None], other=0.0).to(tl.bfloat16).to(dot_dtype)
        k_r = tl.load(base + C + r[None, :], mask=t_mask[:, None], other=0.0).to(tl.bfloat16).to(dot_dtype)
        s = tl.dot(q_c, tl.trans(k_c)) + tl.dot(q_r, tl.trans(k_r))
        s = tl.where(t_mask[None, :], s * scale, -1e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16).to(dot_dtype), k_c)
        m_i = m_new
    row = (b * H + hh) * n_sp + sp
    tl.store(m_out + row, m_i, mask=h_mask)
    tl.store(l_out + row, l_i, mask=h_mask)
    tl.store(acc_out + row[:, None] * C + c[None, :], acc, mask=h_mask[:, None])


@triton.jit
def _mla_combine_kernel(m_in, l_in, acc_in, kv_scale, out, H, s_ob, s_oh,
                        C: tl.constexpr, SPLITS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    row = (b * H + h) * SPLITS + sp
    m = tl.load(m_in + row)
    l = tl.load(l_in + row)
    m_all = tl.max(m, axis=0)
    w = tl.exp(m - m_all)
    c = tl.arange(0, C)
    acc = tl.load(acc_in + row[:, None] * C + c[None, :])
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0) * tl.load(kv_scale)
    tl.store(out + b * s_ob + h * s_oh + c, o.to(out.dtype.element_ty))


def mla_decode(q, kv, kv_scale, lengths, out, *, sm_scale, kv_lora):
    """q [B, h, C + R] bf16 (absorbed nope part, then the rope slot), kv [B, T, C + R] FP8, lengths [B] (tokens to
    attend, the new one included) -> out [B, h, C]."""
    B, H, D = q.shape
    T_cap = kv.shape[1]
    BLOCK_H, BLOCK_T = 16, 64
    hb = triton.cdiv(H, BLOCK_H)
    # enough programs to cover the GPU's multiprocessors about twice, in whole BLOCK_T chunks
    splits = triton.next_power_of_2(max(1, min(64, triton.cdiv(264, B * hb), triton.cdiv(T_cap, BLOCK_T))))
    chunk = triton.cdiv(triton.cdiv(T_cap, splits), BLOCK_T) * BLOCK_T
    m = q.new_empty((B * H * splits,), dtype=torch.float32)
    l = torch.empty_like(m)
    acc = q.new_empty((B * H * splits, kv_lora), dtype=torch.float32)
    _mla_split_kernel[(B, hb, splits)](
        q, kv, kv_scale, lengths, m, l, acc, H, T_cap, chunk, q.stride(0), q.stride(1), kv.stride(0), kv.stride(1),
        sm_scale, C=kv_lora, R=D - kv_lora, BLOCK_H=BLOCK_H, BLOCK_T=BLOCK_T, DOT_FP32=_DOT_FP32,
        num_warps=8, num_stages=2)
    _mla_combine_kernel[(B, H)](m, l, acc, kv_scale, out, H, out.stride(0), out.stride(1), C=kv_lora,
                                SPLITS=splits, num_warps=4)
