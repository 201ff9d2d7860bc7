"""One K3 decoder layer for a batch of single-token sequences, shared by every backend.

A backend is a table of stage implementations (`AutoBackend` and its subclasses): this module decides which stages
run, in which order, under which instrumentation range, and where the tensor-parallel reductions go.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .config import KDA, ShardConfig
from .instrument import layer_range, rng
from .state import ResidualState
from .weights import DenseMLPWeights, LayerWeights


def _all_reduce(t: torch.Tensor, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        with rng("allreduce"):
            dist.all_reduce(t, group=group)


def decode_layer(backend, lw: LayerWeights, res: ResidualState, attn_state, shard: ShardConfig, group=None,
                 attention=None) -> None:
    """Runs layer `lw.index` in place: `res` (AttnRes state) and `attn_state` (KDA state or MLA cache) are updated.

    `attention`, when given, replaces the attention sublayer: a callable x [B, H] -> output [B, H], already projected
    and reduced over the tensor-parallel group (a serving engine's own MLA module, for example); it runs under the
    `mla_core` stage and `attn_state` is not used.
    """
    m = shard.model
    eps = m.rms_eps
    n_blocks = m.completed_blocks(lw.index)
    commit = m.starts_block(lw.index) and not res.partial_empty
    empty = res.partial_empty or commit
    backend.begin_layer(lw, res.partial.shape[0], reduced=group is not None and dist.get_world_size(group) > 1)
    try:
        with layer_range(lw.index, lw.kind):
            with rng("attn_res"):
                x = backend.attn_res(res, lw.attn_res, n_blocks=n_blocks, commit=commit, delta=None, delta_mode=0,
                                     use_partial=not empty, eps=eps)
            if attention is not None:
                with rng("mla_core"):
                    a = attention(x)
            elif lw.attn_kind == KDA:
                with rng("qkv_proj"):
                    y, f = backend.kda_in_proj(x, lw.attn, shard)
                with rng("kda_core"):
                    o = backend.kda_core(y, f, lw.attn, attn_state, shard)
            else:
                with rng("qkv_proj"):
                    q, entry, gate = backend.mla_in_proj(x, lw.attn, shard)
                with rng("mla_core"):
                    o = backend.mla_core(q, entry, gate, lw.attn, attn_state, shard)
            if attention is None:
                with rng("o_proj"):
                    a = backend.attn_out_proj(o, lw.attn)
                _all_reduce(a, group)

            with rng("attn_res"):
                x = backend.attn_res(res, lw.mlp_res, n_blocks=n_blocks, commit=False, delta=a,
                                     delta_mode=2 if empty else 1, use_partial=True, eps=eps)
            res.partial_empty = False

            if isinstance(lw.mlp, DenseMLPWeights):
                with rng("dense_mlp"):
                    out = backend.glu_mlp(x, lw.mlp.gate_up, lw.mlp.down)
                _all_reduce(out, group)
                with rng("dense_mlp"):
                    res.partial.add_(out)
                return
            # router and shared experts read only x: a backend may run them beside the latent down-projection; the
            # routed experts join the router branch once their latent input is launched, the tail joins the shared one
            with rng("router"), backend.branch("router", x):
                ids, weights = backend.router(x, lw.mlp, shard, lw.index)
            with rng("shared_experts"), backend.branch("shared", x):
                shared = backend.shared_experts(x, lw.mlp)
            with rng("routed_experts"):
                routed = backend.routed_experts(x, ids, weights, lw.mlp, shard)
            backend.join("router", ids, weights)
            backend.join("shared", shared)
            _all_reduce(routed, group)
            _all_reduce(shared, group)
            with rng("moe_tail"):
                backend.moe_tail(routed, shared, lw.mlp, res, shard)
            backend.join("prefetch")  # a backend's L2 prefetches (hints, nothing reads their output)
    finally:
        backend.end_layer()
