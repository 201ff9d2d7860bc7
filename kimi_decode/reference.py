"""Float64 reference of one decode step: the numerics oracle every backend is checked against.

Plain torch, written to be read next to ../shared/k3_spec.md, on any device. Weights and states arrive in their stored
formats (bf16, MXFP4, FP8) and are dequantised exactly; all arithmetic is float64. Nothing here mutates its inputs:
each function returns the new state.

Residual stream (AttnRes): before each sublayer the input is a softmax mix over the finished block summaries (block 0
is the embedding) and, once the open block has a sublayer output, its partial sum. When a layer starts a new 12-layer
block, the open partial sum becomes a finished summary.
"""
from __future__ import annotations

import torch

from .config import KDA, ShardConfig
from .quant import fp8_dequantize, fp8_quantize, mxfp4_dequantize
from .state import KDAState, MLACache, ResidualState
from .weights import AttnResWeights, DenseMLPWeights, KDAWeights, LayerWeights, MLAWeights, MoEWeights

F64 = torch.float64


def _f(t: torch.Tensor) -> torch.Tensor:
    return t.to(F64)


def rms_norm(x, weight, eps):
    x = _f(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * _f(weight)


def situ_glu(gate, up):
    """SiTU-GLU: 4 tanh(gate/4) sigmoid(gate) * 25 tanh(up/25)."""
    return 4 * torch.tanh(gate / 4) * torch.sigmoid(gate) * (25 * torch.tanh(up / 25))


def linear(x, w):
    return _f(x) @ _f(w).T


def attn_res_mix(candidates: torch.Tensor, w: AttnResWeights, eps: float) -> torch.Tensor:
    """candidates [B, S, H] -> softmax-weighted mix [B, H] of the raw candidates."""
    v = _f(candidates)
    keys = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * _f(w.key_norm)
    scores = keys @ _f(w.query)  # [B, S]
    return (torch.softmax(scores, dim=-1).unsqueeze(-1) * v).sum(1)


def _candidates(res: ResidualState, n_blocks: int) -> torch.Tensor:
    cands = _f(res.blocks[:, :n_blocks])
    if not res.partial_empty:
        cands = torch.cat([cands, _f(res.partial).unsqueeze(1)], dim=1)
    return cands


def _l2norm(x):
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def kda_core(y, f, w: KDAWeights, state: KDAState, shard: ShardConfig):
    """From the fused input projection's output y [B, rows] and the decay-gate projection f [B, d]: short conv, gate,
    beta, L2 norms, delta rule, gated RMSNorm. -> (o [B, d], new KDAState in float64)."""
    m, h, D = shard.model, shard.kda_heads, shard.model.kda_head_dim
    y, f = _f(y), _f(f)
    B = y.shape[0]
    part = {name: y[:, a:b] for name, (a, b) in shard.kda_in_proj_layout.items()}

    qkv = torch.cat([part["q"], part["k"], part["v"]], dim=-1)
    window = torch.cat([_f(state.conv), qkv.unsqueeze(-1)], dim=-1)  # [B, 3d, width]
    conv = torch.nn.functional.silu((window * _f(w.conv)).sum(-1))
    q, k, v = (t.reshape(B, h, D) for t in conv.split(shard.kda_dim, dim=-1))
    q = _l2norm(q) * D**-0.5
    k = _l2norm(k)

    decay = m.kda_gate_lower_bound * torch.sigmoid(
        torch.exp(_f(w.A_log)).view(1, h, 1) * (f + _f(w.dt_bias)).view(B, h, D))
    beta = torch.sigmoid(part["b"]).view(B, h, 1, 1)

    S = _f(state.recurrent) * torch.exp(decay).unsqueeze(-1)  # decay along the key dimension
    kS = torch.einsum("bhk,bhkv->bhv", k, S)
    S = S + beta * torch.einsum("bhk,bhv->bhkv", k, v - kS)
    o = torch.einsum("bhk,bhkv->bhv", q, S)

    o = rms_norm(o, w.o_norm, m.rms_eps) * torch.sigmoid(part["g"].reshape(B, h, D))
    return o.reshape(B, h * D), KDAState(recurrent=S, conv=window[..., 1:])


def kda_step(x, w: KDAWeights, state: KDAState, shard: ShardConfig):
    """x [B, H] (already normalised) -> (out [B, H], new KDAState in float64)."""
    y = linear(x, w.in_proj)
    a, b = shard.kda_in_proj_layout["f_a"]
    o, state = kda_core(y, linear(y[:, a:b], w.f_b), w, state, shard)
    return linear(o, w.o_proj), state


def mla_write_positions(cache: MLACache) -> torch.Tensor:
    """Where this step's token goes: the end of each sequence, the last slot once the cache is full."""
    return cache.lengths.clamp(max=cache.capacity - 1)


def mla_step(x, w: MLAWeights, cache: MLACache, shard: ShardConfig):
    """x [B, H] -> (out [B, H], new MLACache). NoPE: the rope slot is used as is, without rotation."""
    m, h = shard.model, shard.mla_heads
    B = x.shape[0]
    nope, rope, vd, C = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank

    qkv = linear(x, w.qkv_a)
    q_lat, kv_lat, k_pe = qkv.split([m.q_lora_rank, C, rope], dim=-1)
    q_lat = rms_norm(q_lat, w.q_a_norm, m.latent_eps)
    entry = torch.cat([rms_norm(kv_lat, w.kv_a_norm, m.latent_eps), k_pe], dim=-1)

    kv = cache.kv.clone()
    pos = mla_write_positions(cache)
    kv[torch.arange(B, device=kv.device), pos] = fp8_quantize(entry, cache.scale)
    lengths = torch.minimum(cache.lengths + 1, torch.full_like(cache.lengths, cache.capacity))

    q = linear(q_lat, w.q_b).view(B, h, nope + rope)
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    kv_b = _f(w.kv_b).view(h, nope + vd, C)
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]

    lat = fp8_dequantize(kv, cache.scale, F64)  # [B, T, C + rope]
    c_kv, pe = lat[..., :C], lat[..., C:]
    q_abs = torch.einsum("bhn,hnc->bhc", q_nope, w_uk)
    scores = (torch.einsum("bhc,btc->bht", q_abs, c_kv) + torch.einsum("bhr,btr->bht", q_pe, pe)) * m.qk_head_dim**-0.5
    valid = torch.arange(kv.shape[1], device=kv.device).view(1, 1, -1) < lengths.view(B, 1, 1)
    p = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
    o = torch.einsum("bhc,hvc->bhv", torch.einsum("bht,btc->bhc", p, c_kv), w_uv)

    o = o * torch.sigmoid(linear(x, w.g_proj)).view(B, h, vd)
    out = linear(o.reshape(B, h * vd), w.o_proj)
    return out, MLACache(kv=kv, scale=cache.scale, lengths=lengths)


def route_scores(x, w: MoEWeights):
    """-> (sigmoid scores, selection scores = scores + correction bias), both [B, E]."""
    scores = torch.sigmoid(linear(x, w.router))
    return scores, scores + _f(w.router_bias)


def route(x, w: MoEWeights, shard: ShardConfig, ids=None):
    """Router: sigmoid scores, top-k chosen on score + correction bias, weights renormalised. -> (ids, weights).

    `ids` replaces the selection (the weights still come from this function's own scores): a backend working in bf16
    may break a near-tie between the k-th and (k+1)-th expert the other way, and its result is then checked against
    the reference evaluated on its own choice.
    """
    m = shard.model
    scores, selection = route_scores(x, w)
    if ids is None:
        ids = torch.topk(selection, m.top_k, dim=-1).indices
    weights = scores.gather(-1, ids)
    return ids, weights / weights.sum(-1, keepdim=True) * m.routed_scaling


def routed_experts(latent, ids, weights, w: MoEWeights, shard: ShardConfig):
    """Weighted sum of the selected experts in the latent width (this rank's intermediate slice), before the reduce."""
    I, group = w.expert_inter, shard.model.mxfp4_group
    out = torch.zeros_like(latent)
    for e in ids.unique().tolist():
        w13 = mxfp4_dequantize(w.w13[e], w.w13_scale[e], F64, group)
        w2 = mxfp4_dequantize(w.w2[e], w.w2_scale[e], F64, group)
        rows, slots = (ids == e).nonzero(as_tuple=True)
        hid = latent[rows] @ w13.T
        act = situ_glu(hid[:, :I], hid[:, I:])
        out.index_add_(0, rows, weights[rows, slots].unsqueeze(-1) * (act @ w2.T))
    return out


def glu_mlp(x, gate_up, down):
    h = linear(x, gate_up)
    n = h.shape[-1] // 2
    return linear(situ_glu(h[:, :n], h[:, n:]), down)


def moe(x, w: MoEWeights, shard: ShardConfig, ids=None):
    m = shard.model
    ids, weights = route(x, w, shard, ids)
    latent = linear(x, w.down)
    routed = rms_norm(routed_experts(latent, ids, weights, w, shard), w.latent_norm, m.rms_eps)
    return linear(routed, w.up) + glu_mlp(x, w.shared_gate_up, w.shared_down)


def mlp(x, w: MoEWeights | DenseMLPWeights, shard: ShardConfig, ids=None):
    if isinstance(w, DenseMLPWeights):
        return glu_mlp(x, w.gate_up, w.down)
    return moe(x, w, shard, ids)


def decode_layer(lw: LayerWeights, res: ResidualState, attn_state, shard: ShardConfig, route_ids=None,
                 record: dict | None = None):
    """One layer for one new token per sequence. -> (new ResidualState, new attention state), all float64.

    `route_ids` optionally fixes the experts chosen (see `route`); `record`, when given, receives the MLP input
    under "mlp_input" so a caller can judge the routing.
    """
    m = shard.model
    blocks, partial, empty = _f(res.blocks), _f(res.partial), res.partial_empty
    n_blocks = m.completed_blocks(lw.index)
    if m.starts_block(lw.index) and not empty:
        blocks[:, n_blocks - 1] = partial
        empty = True

    def sublayer_input(aw: AttnResWeights):
        mix = attn_res_mix(_candidates(ResidualState(blocks, partial, empty), n_blocks), aw, m.rms_eps)
        return rms_norm(mix, aw.input_norm, m.rms_eps)

    x = sublayer_input(lw.attn_res)
    if lw.attn_kind == KDA:
        a, attn_state = kda_step(x, lw.attn, attn_state, shard)
    else:
        a, attn_state = mla_step(x, lw.attn, attn_state, shard)
    partial = a if empty else partial + a
    empty = False
    x = sublayer_input(lw.mlp_res)
    if record is not None:
        record["mlp_input"] = x
    partial = partial + mlp(x, lw.mlp, shard, route_ids)
    return ResidualState(blocks=blocks, partial=partial, partial_empty=False), attn_state
