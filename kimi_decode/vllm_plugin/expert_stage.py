"""The routed-expert stage vLLM's MoE layers run with our backend on (`experts.CheckpointLayoutExperts.apply`): our
``auto`` backend's MXFP4 expert path on the checkpoint layout, for any number of tokens. Imports no vLLM.

vLLM's K3 MoE hands its quant method the latent already down-projected, so the stage here is
`kimi_decode.backends.auto.AutoBackend.experts_on_latent`, the part of the ``auto`` routed-expert stage after that
projection: Triton ``moe_align`` + ``moe_mxfp4`` + SiTU-GLU on CUDA, the torch twin over ``mxfp4_dequantize`` on the
CPU.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from ..backends.auto import AutoBackend
from ..weights import MoEWeights

MXFP4_GROUP = 32  # OCP MX block: one ue8m0 scale per 32 e2m1 values
# Pairs (token, selected expert) per call of the expert stage; longer inputs (prefill) run in row chunks. On CUDA,
# ``moe_align`` sorts a call's pairs inside one Triton program, compiled per power of two: on an H200 the 8192-pair
# variant compiles in about 20 s (once per process, then from Triton's cache; vLLM's profiling run at start-up reaches
# it), 16384 in about 45 s, 32768 in minutes, while a K3 TP16 layer at 8192 tokens took 107 ms in chunks of 4096 pairs,
# 70 ms in chunks of 8192 and 64 ms in chunks of 16384. On the CPU path each pair gathers one dequantized fp32 expert.
MAX_PAIRS_CUDA = 8192
MAX_PAIRS_CPU = 256


_BACKEND = AutoBackend()  # its experts_on_latent: vLLM's K3 MoE has down-projected the latent already
_SHARD = SimpleNamespace(model=SimpleNamespace(mxfp4_group=MXFP4_GROUP))  # all the expert stage reads of a shard


def routed_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                   w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                   max_pairs: int | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for every row t -> [T, w2.shape[1]] in x's dtype.

    `x` [T, H] is the expert input (K3: the latent), the experts are MXFP4 in the checkpoint layout, an expert is
    SiTU-GLU(x W1^T, x W3^T) W2^T. Rows run in `row_chunks` of at most `max_pairs` pairs (default: `MAX_PAIRS_CUDA` on
    CUDA, `MAX_PAIRS_CPU` elsewhere); the chunking depends on shapes only, so a CUDA graph can capture it."""
    T, k = topk_ids.shape
    out = torch.empty(T, w2.shape[1], dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    w = MoEWeights(router=None, router_bias=None, down=None, w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale,
                   latent_norm=None, up=None, shared_gate_up=None, shared_down=None)
    xb = x.to(torch.bfloat16).contiguous()
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    if max_pairs is None:
        max_pairs = MAX_PAIRS_CUDA if x.is_cuda else MAX_PAIRS_CPU
    for s, e in row_chunks(T, k, max_pairs):
        out[s:e] = _BACKEND.experts_on_latent(xb[s:e], ids[s:e], weights[s:e], w, _SHARD)
    return out


def row_chunks(rows: int, top_k: int, max_pairs: int) -> list[tuple[int, int]]:
    """Row ranges covering `rows`, one call of the expert stage each, of at most `max_pairs` pairs (at least one row)."""
    n = max(1, max_pairs // top_k)
    return [(s, min(rows, s + n)) for s in range(0, rows, n)]
