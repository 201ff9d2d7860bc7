"""Decode state: the AttnRes residual buffer, KDA recurrent and conv state, and the MLA latent KV cache.

All of it is allocated once, in static buffers a CUDA graph can capture, and filled with random history (nothing in
it is zero: zeros would hide unwritten elements and make kernels look faster than on real data).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .config import ShardConfig
from .quant import FP8_DTYPE, fp8_quantize, fp8_scale_for
from .weights import _Draw, _Tensors


@dataclass
class _State(_Tensors):
    def clone(self):
        out = copy.copy(self)
        for name, t in self.tensors():
            setattr(out, name, t.clone())
        return out

    def copy_(self, other) -> None:
        for name, t in self.tensors():
            t.copy_(getattr(other, name))


@dataclass
class ResidualState(_State):
    """AttnRes state per sequence: finished block summaries (block 0 is the embedding) and the open block's sum."""

    blocks: torch.Tensor  # [B, num_blocks, H] fp32
    partial: torch.Tensor  # [B, H] fp32
    partial_empty: bool = False  # true between a block's start and its first sublayer output


@dataclass
class KDAState(_State):
    recurrent: torch.Tensor  # [B, heads, head_dim (key), head_dim (value)] fp32
    conv: torch.Tensor  # [B, 3 d, width - 1] bf16, oldest first


@dataclass
class MLACache(_State):
    kv: torch.Tensor  # [B, capacity, kv_lora + rope] fp8 e4m3
    scale: torch.Tensor  # [] fp32, per tensor, fixed
    lengths: torch.Tensor  # [B] int64, tokens already in the cache

    @property
    def capacity(self) -> int:
        return self.kv.shape[1]


def init_residual(shard: ShardConfig, batch: int, first_layer: int, seed: int = 0, device="cpu") -> ResidualState:
    """Residual state as it stands when `first_layer` starts: its finished blocks and a partial sum of order one."""
    m = shard.model
    d = _Draw(seed, -1, 0, device)  # replicated on every rank
    done = m.completed_blocks(first_layer)
    blocks = d.normal("res.blocks", (batch, m.num_blocks, m.hidden), dtype=torch.float32)
    blocks[:, done:] = float("nan")  # not yet written: any use is an error that shows
    empty = m.starts_block(first_layer)
    partial = d.normal("res.partial", (batch, m.hidden), dtype=torch.float32)
    if empty:
        partial.fill_(float("nan"))
    return ResidualState(blocks=blocks, partial=partial, partial_empty=empty)


def init_kda_state(shard: ShardConfig, batch: int, layer: int, seed: int = 0, device="cpu") -> KDAState:
    m = shard.model
    d = _Draw(seed, layer, shard.rank, device)
    D = m.kda_head_dim
    return KDAState(
        recurrent=d.normal("state.recurrent", (batch, shard.kda_heads, D, D), std=D**-0.5, dtype=torch.float32),
        conv=d.normal("state.conv", (batch, 3 * shard.kda_dim, m.kda_conv_width - 1), dtype=torch.bfloat16),
    )


def init_mla_cache(shard: ShardConfig, batch: int, layer: int, context: int = 8192, extra: int = 64,
                   seed: int = 0, device="cpu") -> MLACache:
    """A latent cache holding `context` random tokens per sequence, with room for `extra` more.

    The per-tensor FP8 scale is fixed from the history (with headroom), as a serving engine's static KV scale is.
    """
    if context < 1:
        raise ValueError("the MLA cache needs a context of at least one token")
    m = shard.model
    d = _Draw(seed, layer, 0, device)  # the latent cache is not split by TP
    history = d.normal("cache.kv", (batch, context + extra, m.kv_cache_dim), dtype=torch.float32)
    scale = fp8_scale_for(history[:, :context])
    kv = fp8_quantize(history, scale)
    assert kv.dtype == FP8_DTYPE
    lengths = torch.full((batch,), context, dtype=torch.int64, device=device)
    return MLACache(kv=kv, scale=scale, lengths=lengths)
