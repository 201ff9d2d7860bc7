"""Checks of a backend against the float64 reference, shared by the tests and the benchmarks."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import reference as R
from .model import decode_layer
from .config import KDA, ShardConfig
from .quant import fp8_dequantize
from .state import MLACache, ResidualState, init_kda_state, init_mla_cache, init_residual
from .weights import LayerWeights, MoEWeights, init_layer

# bf16 operands: errors land between 1e-3 and 1e-2; the bound for a whole layer is 1e-2
BF16_TOL = 1e-2
# a backend may pick the (k+1)-th expert instead of the k-th when their selection scores are this close
ROUTING_TIE = 2e-2


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def check_routing(selection: torch.Tensor, ids: torch.Tensor, tie: float = ROUTING_TIE) -> None:
    """Every expert a backend chose must be within `tie` of the reference's k-th selection score."""
    k = ids.shape[-1]
    kth = torch.topk(selection, k, dim=-1).values[:, -1:]
    chosen = selection.gather(-1, ids.to(selection.device))
    if ids.unique(dim=-1).shape[-1] != k or (chosen < kth - tie).any():
        raise AssertionError(f"routing differs beyond near-ties: chosen scores {chosen.min().item():.4f} "
                             f"below the k-th {kth.min().item():.4f}")


@dataclass
class LayerCheck:
    errors: dict[str, float] = field(default_factory=dict)

    def worst(self) -> float:
        return max(self.errors.values())

    def assert_within(self, tol: float = BF16_TOL) -> None:
        bad = {k: v for k, v in self.errors.items() if not v <= tol}
        if bad:
            raise AssertionError(f"relative errors above {tol}: {bad}")


def _state_tensors(state):
    if isinstance(state, MLACache):
        return {"kv_cache": fp8_dequantize(state.kv, state.scale, torch.float64),
                "lengths": state.lengths.double()}
    return dict(state.tensors())


def check_layer(backend, lw: LayerWeights, res: ResidualState, state, shard) -> LayerCheck:
    """Runs one layer with `backend` on copies of (res, state) and compares every output with the reference."""
    res_b, state_b = res.clone(), state.clone()
    decode_layer(backend, lw, res_b, state_b, shard)
    ids = backend.last_routes.get(lw.index) if isinstance(lw.mlp, MoEWeights) else None
    record: dict = {}
    res_r, state_r = R.decode_layer(lw, res, state, shard, route_ids=ids, record=record)
    if ids is not None:
        check_routing(R.route_scores(record["mlp_input"], lw.mlp)[1], ids)
    out = LayerCheck()
    out.errors["partial"] = rel_err(res_b.partial, res_r.partial)
    n = shard.model.completed_blocks(lw.index)
    out.errors["blocks"] = rel_err(res_b.blocks[:, :n], res_r.blocks[:, :n])
    want = _state_tensors(state_r)
    for name, got in _state_tensors(state_b).items():
        out.errors[name] = rel_err(got, want[name])
    return out


def layer_case(shard: ShardConfig, layer: int, batch: int, seed: int, device="cpu", context: int = 2048):
    """Fresh random weights, residual state and attention state (KDA state or MLA cache) for one layer check."""
    lw = init_layer(shard, layer, seed=seed, device=device)
    state = (init_kda_state(shard, batch, layer, seed=seed, device=device) if lw.attn_kind == KDA
             else init_mla_cache(shard, batch, layer, context=context, seed=seed, device=device))
    return lw, init_residual(shard, batch, layer, seed=seed, device=device), state


def projection_shapes(shard: ShardConfig) -> list[tuple[int, int]]:
    """(N, K) of every bf16 projection of a KDA layer and the MoE block on one rank."""
    m = shard.model
    return [(shard.kda_in_proj_rows, m.hidden), (shard.kda_dim, m.kda_f_rank), (m.hidden, shard.kda_dim),
            (m.num_experts, m.hidden), (m.moe_latent, m.hidden), (m.hidden, m.moe_latent),
            (2 * shard.shared_inter, m.hidden), (m.hidden, shard.shared_inter)]
