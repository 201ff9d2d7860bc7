"""Kimi K3 model configuration and the per-rank tensor-parallel shard of it.

`ModelConfig` holds the checkpoint's dimensions (``K3`` is the released model, ``TINY`` a CPU-sized model of the same
structure). `ShardConfig` derives the local dimensions one rank holds under tensor parallelism.

Two documented choices about padding, both as vLLM's generic path does them:

* The fused KDA input projection (q, k, v, g for the local heads, the replicated f_a rows, the local beta rows) is
  padded to a multiple of 16 rows: 6288 at TP8, 3216 at TP16.
* Routed-expert intermediate slices smaller than 256 per rank are padded with zero weights to 256
  (``min_moe_intermediate_per_partition``); at TP16 3072/16 = 192 becomes 256, so the generic path reads a third more
  expert bytes there. ``ShardConfig(pad_experts=False)`` gives the unpadded slice; zero rows change no result.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

KDA, MLA, DENSE = "kda", "mla", "dense"


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden: int = 7168
    num_layers: int = 93
    vocab: int = 163840
    rms_eps: float = 1e-5
    # KDA (linear attention)
    kda_heads: int = 96
    kda_head_dim: int = 128
    kda_conv_width: int = 4
    kda_f_rank: int = 128  # low-rank decay gate: f_a [f_rank, hidden], f_b [heads*head_dim, f_rank]
    kda_gate_lower_bound: float = -5.0
    # MLA (full attention, NoPE, gated)
    mla_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    latent_eps: float = 1e-6  # the q_a and kv_a latent RMSNorms
    # Latent MoE
    num_experts: int = 896
    top_k: int = 16
    moe_latent: int = 3584
    expert_inter: int = 3072
    shared_inter: int = 6144  # two shared experts merged into one MLP
    dense_inter: int = 33792  # layer 0
    routed_scaling: float = 1.0
    mxfp4_group: int = 32
    # AttnRes
    attn_res_block: int = 12  # layers per block
    # MLA layers, 0-indexed: every fourth layer (3, 7, ..., 91) plus the last one
    mla_period: int = 4

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_blocks(self) -> int:
        """AttnRes block summaries: the embedding plus every completed block, at most."""
        return -(-self.num_layers // self.attn_res_block)

    def attention_kind(self, layer: int) -> str:
        self._check_layer(layer)
        if layer % self.mla_period == self.mla_period - 1 or layer == self.num_layers - 1:
            return MLA
        return KDA

    def mlp_kind(self, layer: int) -> str:
        self._check_layer(layer)
        return DENSE if layer == 0 else "moe"

    def layer_kind(self, layer: int) -> str:
        """The name used in instrumentation: ``dense`` for layer 0 (KDA attention, dense MLP), else the attention kind."""
        return DENSE if self.mlp_kind(layer) == DENSE else self.attention_kind(layer)

    def completed_blocks(self, layer: int) -> int:
        """AttnRes candidates that are finished block summaries when `layer` starts (the embedding counts as one)."""
        return 1 + layer // self.attn_res_block

    def starts_block(self, layer: int) -> bool:
        return layer % self.attn_res_block == 0

    def ends_block(self, layer: int) -> bool:
        return (layer + 1) % self.attn_res_block == 0 or layer == self.num_layers - 1

    def schedule(self) -> list[str]:
        return [self.attention_kind(i) for i in range(self.num_layers)]

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside 0..{self.num_layers - 1}")


K3 = ModelConfig(name="k3")

TINY = ModelConfig(
    name="tiny",
    hidden=256,
    num_layers=13,
    vocab=1024,
    kda_heads=8,
    kda_head_dim=32,
    kda_f_rank=16,
    mla_heads=8,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    num_experts=32,
    top_k=4,
    moe_latent=128,
    expert_inter=96,
    shared_inter=128,
    dense_inter=256,
    attn_res_block=4,
)

# The tiny model with an expert slice that splits into MXFP4 groups over 2 and 4 ranks (tensor-parallel runs on the
# CPU: tests, `kprof capture --gpus` with gloo).
TINY_TP = dataclasses.replace(TINY, name="tiny-tp", expert_inter=128)

MODELS = {"k3": K3, "tiny": TINY, "tiny-tp": TINY_TP}
SUPPORTED_TP = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class ShardConfig:
    """The dimensions one tensor-parallel rank holds."""

    model: ModelConfig
    tp: int = 1
    rank: int = 0
    pad_experts: bool = True
    kda_in_proj_align: int = 16
    min_expert_inter: int = 256

    def __post_init__(self) -> None:
        m = self.model
        if self.tp < 1 or not 0 <= self.rank < self.tp:
            raise ValueError(f"rank {self.rank} is not in a tensor-parallel group of {self.tp}")
        for what, n in (("KDA heads", m.kda_heads), ("MLA heads", m.mla_heads),
                        ("expert intermediate", m.expert_inter), ("shared intermediate", m.shared_inter),
                        ("dense intermediate", m.dense_inter)):
            if n % self.tp:
                raise ValueError(f"{m.name}: {what} ({n}) do not divide by tp={self.tp}")
        if (m.expert_inter // self.tp) % m.mxfp4_group:
            raise ValueError(f"{m.name}: expert slice {m.expert_inter // self.tp} at tp={self.tp} is not a multiple "
                             f"of the MXFP4 group {m.mxfp4_group}")

    @property
    def kda_heads(self) -> int:
        return self.model.kda_heads // self.tp

    @property
    def kda_dim(self) -> int:
        """Local width of each of q, k, v, g."""
        return self.kda_heads * self.model.kda_head_dim

    @cached_property
    def kda_in_proj_layout(self) -> dict[str, tuple[int, int]]:
        """Row ranges (start, stop) of the fused KDA input projection: q, k, v, g, f_a (replicated), b."""
        d, h = self.kda_dim, self.kda_heads
        sizes = {"q": d, "k": d, "v": d, "g": d, "f_a": self.model.kda_f_rank, "b": h}
        layout, start = {}, 0
        for name, n in sizes.items():
            layout[name] = (start, start + n)
            start += n
        return layout

    @property
    def kda_in_proj_rows(self) -> int:
        used = self.kda_in_proj_layout["b"][1]
        return _round_up(used, self.kda_in_proj_align)

    @property
    def mla_heads(self) -> int:
        return self.model.mla_heads // self.tp

    @property
    def expert_inter(self) -> int:
        """The routed-expert intermediate slice as stored (padded with zeros when `pad_experts`)."""
        n = self.model.expert_inter // self.tp
        return max(n, self.min_expert_inter) if self.pad_experts else n

    @property
    def expert_inter_used(self) -> int:
        return self.model.expert_inter // self.tp

    @property
    def shared_inter(self) -> int:
        return self.model.shared_inter // self.tp

    @property
    def dense_inter(self) -> int:
        return self.model.dense_inter // self.tp

    def replace(self, **changes) -> "ShardConfig":
        return dataclasses.replace(self, **changes)


def shard(model: str | ModelConfig = "k3", tp: int = 1, rank: int = 0, **kw) -> ShardConfig:
    m = MODELS[model] if isinstance(model, str) else model
    return ShardConfig(model=m, tp=tp, rank=rank, **kw)
