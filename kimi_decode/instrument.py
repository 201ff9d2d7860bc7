"""Instrumentation: the range names analyzers rely on.

Contract (NVTX domain ``kimi_decode``; the same names as torch.profiler ``record_function`` ranges while a torch
profiler is active)::

    decode_step
      layer[{i}]:{kind}          kind: kda | mla | dense
        {stage}                  attn_res, qkv_proj, kda_core | mla_core, o_proj, allreduce,
                                 router, shared_experts, routed_experts, moe_tail, dense_mlp, prefetch

A stage name may open several times inside one layer (``attn_res`` runs before attention and before the MLP).
NVTX attributes are registered once per name, so a range costs one push and one pop when nothing profiles.
"""
from __future__ import annotations

import nvtx
import torch

DOMAIN = "kimi_decode"
DECODE_STEP = "decode_step"
STAGES = ("attn_res", "qkv_proj", "kda_core", "mla_core", "o_proj", "allreduce", "router", "shared_experts",
          "routed_experts", "moe_tail", "dense_mlp", "prefetch")

_domain = nvtx.get_domain(DOMAIN)
_attributes: dict[str, object] = {}
_open_record_functions: list = []


def layer_range_name(index: int, kind: str) -> str:
    return f"layer[{index}]:{kind}"


_layer_ranges: dict[tuple[int, str], "Range"] = {}


def layer_range(index: int, kind: str) -> "Range":
    """The `layer[{i}]:{kind}` range, built once per layer (no string formatting on later calls)."""
    r = _layer_ranges.get((index, kind))
    if r is None:
        r = _layer_ranges[(index, kind)] = rng(layer_range_name(index, kind))
    return r


_torch_profiling = torch._C._autograd._profiler_enabled


class Range:
    """A reusable context manager for one range name."""

    __slots__ = ("name", "_attr")

    def __init__(self, name: str):
        self.name = name
        attr = _attributes.get(name)
        if attr is None:
            attr = _attributes[name] = _domain.get_event_attributes(message=name)
        self._attr = attr

    def __enter__(self):
        _domain.push_range(self._attr)
        if _torch_profiling():
            rf = torch.profiler.record_function(self.name)
            rf.__enter__()
            _open_record_functions.append(rf)
        else:
            _open_record_functions.append(None)
        return self

    def __exit__(self, *exc):
        rf = _open_record_functions.pop()
        if rf is not None:
            rf.__exit__(*exc)
        _domain.pop_range()
        return False


_ranges: dict[str, Range] = {}


def rng(name: str) -> Range:
    """The range for `name`, created and registered on first use."""
    r = _ranges.get(name)
    if r is None:
        r = _ranges[name] = Range(name)
    return r


for _name in (DECODE_STEP, *STAGES):
    rng(_name)
