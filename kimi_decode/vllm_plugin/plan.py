"""Which path one forward call takes: our decode executor or vLLM's stock forward.

Under CUDA graphs, Python ``forward`` runs only while a graph is captured, so the decision is made once per captured
batch size and baked into that graph. It reads only values every tensor-parallel rank shares (the scheduler's batch
shape, the graph mode, the prepared sizes), never a rank's own data, so every rank bakes in the same path.

Our path takes a step only when all of these hold; anything else is vLLM's stock forward:
- no pipeline-parallel intermediate tensors;
- real attention metadata (not a profile or dummy run), and every layer's metadata shows a pure decode: no prefill
  or chunked-prefill rows, no speculative verifies, one token per request;
- the step's token count (padded rows included) is one of the prepared batch sizes;
- on CUDA: a FULL CUDA graph is being captured (piecewise graphs and eager steps run stock). The CPU build has no
  graphs, so there an eager pure-decode step counts (tests and development only).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    ours: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ours


def _layer_metadata(attn_metadata) -> list:
    if attn_metadata is None:
        return []
    if isinstance(attn_metadata, Mapping):
        return list(attn_metadata.values())
    if isinstance(attn_metadata, Iterable):  # micro-batched: a list of dicts
        return [m for part in attn_metadata for m in _layer_metadata(part)]
    return [attn_metadata]


def plan_step(*, num_tokens: int, attn_metadata, batch_sizes: Iterable[int], runtime_mode: str = "NONE",
              capturing: bool = False, require_graph: bool = True,
              has_intermediate_tensors: bool = False) -> Decision:
    """`runtime_mode` is the name of the forward context's ``cudagraph_runtime_mode`` (NONE, PIECEWISE, FULL)."""
    if has_intermediate_tensors:
        return Decision(False, "pipeline-parallel intermediate tensors")
    metas = _layer_metadata(attn_metadata)
    if not metas:
        return Decision(False, "no attention metadata (profile or dummy run)")
    for m in metas:
        prefills = getattr(m, "num_prefills", None)
        decodes = getattr(m, "num_decodes", None)
        if prefills is None or decodes is None:
            return Decision(False, f"attention metadata {type(m).__name__} does not say the batch shape")
        if prefills:
            return Decision(False, "prefill or mixed batch")
        if getattr(m, "num_spec_decodes", 0):
            return Decision(False, "speculative verify")
        decode_tokens = getattr(m, "num_decode_tokens", decodes)
        if decode_tokens != decodes:
            return Decision(False, "decode rows with more than one token")
    if num_tokens not in set(batch_sizes):
        return Decision(False, f"{num_tokens} tokens is not a prepared batch size")
    if require_graph:
        if runtime_mode == "PIECEWISE":
            return Decision(False, "piecewise CUDA graph")
        if runtime_mode != "FULL" or not capturing:
            return Decision(False, "not a full CUDA-graph capture")
    return Decision(True, "pure decode")
