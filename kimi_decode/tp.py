"""Tensor-parallel shards cut from one full-width (TP1) layer, and the matching state shards.

`init_layer` draws every rank's weights independently (seeded per rank), which is right for timing but means the
ranks of a TP group do not together form one model. `shard_layer` instead slices a full-width layer, so the sum over
ranks of each row-parallel output equals the full layer's output, and a TP run can be checked against a TP1 run and
against the float64 reference of the full layer. The layout is the one `ShardConfig` describes (see docs/tp.md):

* column-parallel (rows of this rank's heads or channels): KDA q, k, v, g and beta rows of the fused input projection,
  f_b, the conv channels, A_log, dt_bias; MLA q_b, kv_b, g_proj; the gate and up halves of the shared-expert and dense
  gate_up; w1 and w3 rows of every routed expert (w13, w13_scale);
* row-parallel (columns of this rank's slice of K): KDA and MLA o_proj, shared and dense down, the routed experts'
  w2 and w2_scale (K in MXFP4 groups of 32: two codes per byte, one scale per group);
* replicated: the KDA f_a rows and o_norm, MLA qkv_a and its norms, the router and its bias, the latent down and up
  projections, the latent norm, every AttnRes weight.

The fused KDA input projection is re-padded with zero rows to the shard's multiple of 16, and the routed-expert
slices with zero codes (and zero scale bytes) to the shard's stored intermediate width when `pad_experts` holds.
No rescaling happens: the full model's 1/fan-in and residual scalings already apply to the sum over ranks.
"""
from __future__ import annotations

import torch

from .config import ShardConfig
from .state import KDAState, MLACache
from .weights import (AttnResWeights, DenseMLPWeights, KDAWeights, LayerWeights, MLAWeights, MoEWeights,
                      init_layer)


def _full(shard: ShardConfig) -> ShardConfig:
    return shard.replace(tp=1, rank=0)


def _part(t: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    """Rank `rank`'s contiguous 1/tp of `t` along `dim` (a copy)."""
    n = t.shape[dim]
    if n % tp:
        raise ValueError(f"dimension {dim} of size {n} does not divide by tp={tp}")
    step = n // tp
    return t.narrow(dim, rank * step, step).clone()


def _halves(t: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    """For a fused [gate; up] tensor: this rank's slice of each half, concatenated as [gate_r; up_r]."""
    a, b = t.chunk(2, dim=dim)
    return torch.cat([_part(a, dim, rank, tp), _part(b, dim, rank, tp)], dim=dim)


def _check_full(full_dim: int, want: int, what: str) -> None:
    if full_dim != want:
        raise ValueError(f"{what}: the full-width layer has {full_dim}, its model says {want}: "
                         f"shard_layer needs the TP1 layer of the same model")


def _attn_res(w: AttnResWeights) -> AttnResWeights:
    return AttnResWeights(query=w.query.clone(), key_norm=w.key_norm.clone(), input_norm=w.input_norm.clone())


def _kda(w: KDAWeights, s: ShardConfig) -> KDAWeights:
    m, r, tp = s.model, s.rank, s.tp
    full = _full(s)
    _check_full(w.in_proj.shape[0], full.kda_in_proj_rows, "KDA in_proj rows")
    in_proj = torch.zeros(s.kda_in_proj_rows, m.hidden, dtype=w.in_proj.dtype, device=w.in_proj.device)
    for name, (a, b) in s.kda_in_proj_layout.items():
        fa, fb = full.kda_in_proj_layout[name]
        src = w.in_proj[fa:fb]
        in_proj[a:b] = src if name == "f_a" else _part(src, 0, r, tp)
    D = full.kda_dim
    conv = torch.cat([_part(w.conv[i * D:(i + 1) * D], 0, r, tp) for i in range(3)], dim=0)
    return KDAWeights(
        in_proj=in_proj,
        f_b=_part(w.f_b, 0, r, tp),
        conv=conv,
        A_log=_part(w.A_log, 0, r, tp),
        dt_bias=_part(w.dt_bias, 0, r, tp),
        o_norm=w.o_norm.clone(),
        o_proj=_part(w.o_proj, 1, r, tp),
    )


def _mla(w: MLAWeights, s: ShardConfig) -> MLAWeights:
    r, tp = s.rank, s.tp
    _check_full(w.q_b.shape[0], s.model.mla_heads * s.model.qk_head_dim, "MLA q_b rows")
    # rows are head-major (head h owns a contiguous block), so a contiguous slice is this rank's heads
    return MLAWeights(
        qkv_a=w.qkv_a.clone(),
        q_a_norm=w.q_a_norm.clone(),
        kv_a_norm=w.kv_a_norm.clone(),
        q_b=_part(w.q_b, 0, r, tp),
        kv_b=_part(w.kv_b, 0, r, tp),
        g_proj=_part(w.g_proj, 0, r, tp),
        o_proj=_part(w.o_proj, 1, r, tp),
    )


def _pad_dim(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Zero-pad `t` along `dim` to `size`."""
    n = t.shape[dim]
    if n == size:
        return t
    if n > size:
        raise ValueError(f"cannot pad {n} down to {size}")
    shape = list(t.shape)
    shape[dim] = size - n
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _moe(w: MoEWeights, s: ShardConfig) -> MoEWeights:
    m, r, tp = s.model, s.rank, s.tp
    group = m.mxfp4_group
    used = s.expert_inter_used  # this rank's live intermediate rows
    lo = r * used
    stored_full = w.expert_inter  # the full layer's stored (possibly padded) width
    if stored_full < m.expert_inter:
        raise ValueError(f"the full-width layer stores {stored_full} expert rows, fewer than {m.expert_inter}")
    if used % group or lo % group:
        raise ValueError(f"expert slice {used} at tp={tp} is not a multiple of the MXFP4 group {group}")

    def w13_part(t: torch.Tensor) -> torch.Tensor:  # [E, 2 I_full_stored, ...] -> [E, 2 I_shard_stored, ...]
        w1, w3 = t[:, :stored_full], t[:, stored_full:]
        return torch.cat([_pad_dim(x[:, lo:lo + used].clone(), 1, s.expert_inter) for x in (w1, w3)], dim=1)

    # w2 [E, latent, I/2] packed codes and [E, latent, I/group] scales: K slices on group boundaries
    w2 = _pad_dim(w.w2[..., lo // 2:(lo + used) // 2].clone(), 2, s.expert_inter // 2)
    w2_scale = _pad_dim(w.w2_scale[..., lo // group:(lo + used) // group].clone(), 2, s.expert_inter // group)
    return MoEWeights(
        router=w.router.clone(),
        router_bias=w.router_bias.clone(),
        down=w.down.clone(),
        w13=w13_part(w.w13),
        w13_scale=w13_part(w.w13_scale),
        w2=w2,
        w2_scale=w2_scale,
        latent_norm=w.latent_norm.clone(),
        up=w.up.clone(),
        shared_gate_up=_halves(w.shared_gate_up, 0, r, tp),
        shared_down=_part(w.shared_down, 1, r, tp),
    )


def _dense(w: DenseMLPWeights, s: ShardConfig) -> DenseMLPWeights:
    return DenseMLPWeights(gate_up=_halves(w.gate_up, 0, s.rank, s.tp), down=_part(w.down, 1, s.rank, s.tp))


def shard_layer(full: LayerWeights, shard: ShardConfig) -> LayerWeights:
    """Rank `shard.rank`'s shard of the full-width (TP1) layer `full`, in the layout `shard` describes."""
    attn = _kda(full.attn, shard) if isinstance(full.attn, KDAWeights) else _mla(full.attn, shard)
    mlp = _dense(full.mlp, shard) if isinstance(full.mlp, DenseMLPWeights) else _moe(full.mlp, shard)
    return LayerWeights(full.index, full.kind, full.attn_kind, _attn_res(full.attn_res), _attn_res(full.mlp_res),
                        attn, mlp)


def init_layer_tp(shard: ShardConfig, layer: int, seed: int = 0, device="cpu") -> LayerWeights:
    """Rank `shard.rank`'s slice of the full-width layer `init_layer` draws at TP1 for (seed, layer).

    Every rank of a group gets a slice of one and the same model (unlike `init_layer` at tp > 1, whose ranks draw
    independently and scale their row-parallel outputs by 1/sqrt(tp)). The full layer is drawn on `device`, so every
    rank of a group must use the same device type for the draws to agree.
    """
    return shard_layer(init_layer(_full(shard), layer, seed=seed, device=device), shard)


def shard_kda_state(full: KDAState, shard: ShardConfig) -> KDAState:
    """Rank `shard.rank`'s part of a full-width KDA state: its heads of the recurrent state, its q, k, v conv channels."""
    r, tp = shard.rank, shard.tp
    D = _full(shard).kda_dim
    _check_full(full.conv.shape[1], 3 * D, "KDA conv channels")
    conv = torch.cat([_part(full.conv[:, i * D:(i + 1) * D], 1, r, tp) for i in range(3)], dim=1)
    return KDAState(recurrent=_part(full.recurrent, 1, r, tp), conv=conv)


def shard_mla_cache(full: MLACache, shard: ShardConfig) -> MLACache:
    """The latent cache is replicated: every rank holds a copy of the whole of it."""
    return full.clone()


def shard_state(full, shard: ShardConfig):
    """`shard_kda_state` or `shard_mla_cache`, by the state's type."""
    if isinstance(full, KDAState):
        return shard_kda_state(full, shard)
    if isinstance(full, MLACache):
        return shard_mla_cache(full, shard)
    raise TypeError(f"no tensor-parallel layout for {type(full).__name__}")


def gather_kda_state(parts: list[KDAState], shard: ShardConfig) -> KDAState:
    """The inverse of `shard_kda_state`: the full-width state from every rank's part, in rank order."""
    if len(parts) != shard.tp:
        raise ValueError(f"{len(parts)} parts for tp={shard.tp}")
    D = shard.kda_dim  # per-rank width of each of q, k, v
    conv = torch.cat([torch.cat([p.conv[:, i * D:(i + 1) * D] for p in parts], dim=1) for i in range(3)], dim=1)
    return KDAState(recurrent=torch.cat([p.recurrent for p in parts], dim=1), conv=conv)
