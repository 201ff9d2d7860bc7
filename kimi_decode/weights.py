"""Random weights of one rank's shard of a K3 layer, deterministic per (seed, layer, rank, tensor).

Nothing is downloaded: every tensor is drawn from a generator seeded by a stable hash of its name. Scales keep
activations of order one through many layers: projections are N(0, 1/fan_in); the projections that write back into the
residual stream (attention o_proj, the latent up-projection, the shared and dense down-projections) are further scaled
by 1/sqrt(2 * block) so a 12-layer block summary stays of order one. Draws are reproducible for one device type (CPU
and CUDA generators differ).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields

import torch

from .config import DENSE, KDA, ShardConfig
from .quant import UE8M0_BIAS, mxfp4_pack_codes

BF16 = torch.bfloat16
F32 = torch.float32
# mean of e2m1 magnitude^2 over the 16 codes, used to pick the MXFP4 scale for a target standard deviation
_E2M1_MEAN_SQ = (0 + 0.25 + 1 + 2.25 + 4 + 9 + 16 + 36) / 8


class _Draw:
    """Seeded draws for one (seed, layer, rank)."""

    def __init__(self, seed: int, layer: int, rank: int, device: torch.device):
        self.key = f"{seed}/{layer}/{rank}"
        self.device = torch.device(device)

    def gen(self, name: str) -> torch.Generator:
        digest = hashlib.blake2b(f"{self.key}/{name}".encode(), digest_size=8).digest()
        g = torch.Generator(device=self.device)
        g.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
        return g

    def normal(self, name, shape, std=1.0, mean=0.0, dtype=BF16):
        t = torch.empty(shape, dtype=F32, device=self.device)
        t.normal_(mean, std, generator=self.gen(name))
        return t.to(dtype)

    def uniform(self, name, shape, lo, hi, dtype=F32):
        t = torch.empty(shape, dtype=F32, device=self.device)
        return t.uniform_(lo, hi, generator=self.gen(name)).to(dtype)

    def linear(self, name, out_features, in_features, scale=1.0):
        return self.normal(name, (out_features, in_features), std=scale / math.sqrt(in_features))

    def mxfp4(self, name, shape, std, group=32, used_rows=None, used_k=None):
        """Random MXFP4 weights [*shape] (packed [..., K/2], scales [..., K/group]) of about `std`.

        Rows at or past `used_rows` (dim -2) and columns at or past `used_k` are zero: the expert padding.
        """
        *lead, n, k = shape
        g = self.gen(name)
        codes = torch.randint(0, 16, (*lead, n, k), dtype=torch.uint8, device=self.device, generator=g)
        if used_rows is not None and used_rows < n:
            codes[..., used_rows:, :] = 0
        if used_k is not None and used_k < k:
            codes[..., :, used_k:] = 0
        exp0 = round(math.log2(std / math.sqrt(_E2M1_MEAN_SQ)))
        jitter = torch.randint(-1, 2, (*lead, n, k // group), device=self.device, generator=g)
        scales = (jitter + exp0 + UE8M0_BIAS).to(torch.uint8)
        return mxfp4_pack_codes(codes), scales


@dataclass
class _Tensors:
    """Dataclass of tensors: device moves and byte counts."""

    def tensors(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                yield f.name, v

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors())

    def to(self, device):
        return type(self)(**{f.name: (v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
                             for f in fields(self)})


@dataclass
class AttnResWeights(_Tensors):
    """Pseudo-query and key norm of one sublayer's AttnRes mix, plus that sublayer's input RMSNorm."""

    query: torch.Tensor  # [H] fp32
    key_norm: torch.Tensor  # [H] fp32
    input_norm: torch.Tensor  # [H] fp32


@dataclass
class KDAWeights(_Tensors):
    in_proj: torch.Tensor  # [rows padded to 16, H]: q, k, v, g, f_a, b
    f_b: torch.Tensor  # [d, f_rank]
    conv: torch.Tensor  # [3d, width] fp32, channels q|k|v
    A_log: torch.Tensor  # [heads] fp32
    dt_bias: torch.Tensor  # [d] fp32
    o_norm: torch.Tensor  # [head_dim] fp32
    o_proj: torch.Tensor  # [H, d]


@dataclass
class MLAWeights(_Tensors):
    qkv_a: torch.Tensor  # [q_lora + kv_lora + rope, H] replicated
    q_a_norm: torch.Tensor  # [q_lora] fp32
    kv_a_norm: torch.Tensor  # [kv_lora] fp32
    q_b: torch.Tensor  # [heads * (nope + rope), q_lora]
    kv_b: torch.Tensor  # [heads * (nope + v), kv_lora]; per head W_UK rows then W_UV rows
    g_proj: torch.Tensor  # [heads * v, H]
    o_proj: torch.Tensor  # [H, heads * v]


@dataclass
class MoEWeights(_Tensors):
    router: torch.Tensor  # [E, H]
    router_bias: torch.Tensor  # [E] fp32, score correction (selection only)
    down: torch.Tensor  # [latent, H] replicated
    w13: torch.Tensor  # [E, 2I, latent/2] uint8 MXFP4 (w1 rows then w3 rows)
    w13_scale: torch.Tensor  # [E, 2I, latent/32] uint8 ue8m0
    w2: torch.Tensor  # [E, latent, I/2] uint8
    w2_scale: torch.Tensor  # [E, latent, I/32] uint8
    latent_norm: torch.Tensor  # [latent] fp32
    up: torch.Tensor  # [H, latent] replicated
    shared_gate_up: torch.Tensor  # [2 Is, H]
    shared_down: torch.Tensor  # [H, Is]

    @property
    def expert_inter(self) -> int:
        return self.w13.shape[1] // 2


@dataclass
class DenseMLPWeights(_Tensors):
    gate_up: torch.Tensor  # [2 Id, H]
    down: torch.Tensor  # [H, Id]


@dataclass
class LayerWeights:
    index: int
    kind: str  # instrumentation name: kda, mla or dense
    attn_kind: str
    attn_res: AttnResWeights
    mlp_res: AttnResWeights
    attn: KDAWeights | MLAWeights
    mlp: MoEWeights | DenseMLPWeights

    def parts(self):
        return (self.attn_res, self.mlp_res, self.attn, self.mlp)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts())

    def to(self, device):
        return LayerWeights(self.index, self.kind, self.attn_kind, *(p.to(device) for p in self.parts()))


def _attn_res(d: _Draw, prefix: str, hidden: int) -> AttnResWeights:
    return AttnResWeights(
        query=d.normal(f"{prefix}.query", (hidden,), std=1.0 / math.sqrt(hidden), dtype=F32),
        key_norm=d.normal(f"{prefix}.key_norm", (hidden,), std=0.1, mean=1.0, dtype=F32),
        input_norm=d.normal(f"{prefix}.input_norm", (hidden,), std=0.1, mean=1.0, dtype=F32),
    )


def _kda(d: _Draw, s: ShardConfig, out_scale: float) -> KDAWeights:
    m, H, dd = s.model, s.model.hidden, s.kda_dim
    layout = s.kda_in_proj_layout
    in_proj = torch.zeros(s.kda_in_proj_rows, H, dtype=BF16, device=d.device)
    for name, (a, b) in layout.items():
        in_proj[a:b] = d.linear(f"kda.in_proj.{name}", b - a, H)
    return KDAWeights(
        in_proj=in_proj,
        f_b=d.linear("kda.f_b", dd, m.kda_f_rank),
        conv=d.normal("kda.conv", (3 * dd, m.kda_conv_width), std=0.5, dtype=F32),
        A_log=torch.log(d.uniform("kda.A_log", (s.kda_heads,), 1.0, 16.0)),
        dt_bias=d.normal("kda.dt_bias", (dd,), std=0.5, dtype=F32),
        o_norm=d.normal("kda.o_norm", (m.kda_head_dim,), std=0.1, mean=1.0, dtype=F32),
        # row-parallel: this rank's K slice of a [H, 96*128] projection
        o_proj=d.linear("kda.o_proj", H, dd, scale=out_scale / math.sqrt(s.tp)),
    )


def _mla(d: _Draw, s: ShardConfig, out_scale: float) -> MLAWeights:
    m, H, h = s.model, s.model.hidden, s.mla_heads
    return MLAWeights(
        qkv_a=d.linear("mla.qkv_a", m.q_lora_rank + m.kv_cache_dim, H),
        q_a_norm=d.normal("mla.q_a_norm", (m.q_lora_rank,), std=0.1, mean=1.0, dtype=F32),
        kv_a_norm=d.normal("mla.kv_a_norm", (m.kv_lora_rank,), std=0.1, mean=1.0, dtype=F32),
        q_b=d.linear("mla.q_b", h * m.qk_head_dim, m.q_lora_rank),
        kv_b=d.linear("mla.kv_b", h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        g_proj=d.linear("mla.g_proj", h * m.v_head_dim, H),
        o_proj=d.linear("mla.o_proj", H, h * m.v_head_dim, scale=out_scale / math.sqrt(s.tp)),
    )


def _moe(d: _Draw, s: ShardConfig, out_scale: float) -> MoEWeights:
    m, H, L, E = s.model, s.model.hidden, s.model.moe_latent, s.model.num_experts
    inter, used = s.expert_inter, s.expert_inter_used
    w1 = d.mxfp4("moe.w1", (E, inter, L), std=1.0 / math.sqrt(L), used_rows=used)
    w3 = d.mxfp4("moe.w3", (E, inter, L), std=1.0 / math.sqrt(L), used_rows=used)
    # the routed sum is renormalised by RMSNorm(latent), so w2 needs no residual scaling
    w2, w2_scale = d.mxfp4("moe.w2", (E, L, inter), std=1.0 / math.sqrt(m.expert_inter), used_k=used)
    return MoEWeights(
        router=d.linear("moe.router", E, H),
        router_bias=d.normal("moe.router_bias", (E,), std=0.1, dtype=F32),
        down=d.linear("moe.down", L, H),
        w13=torch.cat([w1[0], w3[0]], dim=1),
        w13_scale=torch.cat([w1[1], w3[1]], dim=1),
        w2=w2,
        w2_scale=w2_scale,
        latent_norm=d.normal("moe.latent_norm", (L,), std=0.1, mean=1.0, dtype=F32),
        up=d.linear("moe.up", H, L, scale=out_scale),
        shared_gate_up=d.linear("moe.shared_gate_up", 2 * s.shared_inter, H),
        shared_down=d.linear("moe.shared_down", H, s.shared_inter, scale=out_scale / math.sqrt(s.tp)),
    )


def _dense(d: _Draw, s: ShardConfig, out_scale: float) -> DenseMLPWeights:
    H = s.model.hidden
    return DenseMLPWeights(
        gate_up=d.linear("dense.gate_up", 2 * s.dense_inter, H),
        down=d.linear("dense.down", H, s.dense_inter, scale=out_scale / math.sqrt(s.tp)),
    )


def init_layer(shard: ShardConfig, layer: int, seed: int = 0, device="cpu") -> LayerWeights:
    """The weights rank `shard.rank` holds for `layer`."""
    m = shard.model
    d = _Draw(seed, layer, shard.rank, device)
    out_scale = 1.0 / math.sqrt(2 * m.attn_res_block)
    attn_kind = m.attention_kind(layer)
    attn = _kda(d, shard, out_scale) if attn_kind == KDA else _mla(d, shard, out_scale)
    mlp = _dense(d, shard, out_scale) if m.mlp_kind(layer) == DENSE else _moe(d, shard, out_scale)
    return LayerWeights(
        index=layer,
        kind=m.layer_kind(layer),
        attn_kind=attn_kind,
        attn_res=_attn_res(d, "attn_res", m.hidden),
        mlp_res=_attn_res(d, "mlp_res", m.hidden),
        attn=attn,
        mlp=mlp,
    )

