"""The routing every plugin model class shares: settings checked at construction, one decision per forward call.

Kept apart from `model` so that classes for other architectures (the CPU stand-in) need not import vLLM's K3 code.
"""
from __future__ import annotations

from collections import Counter

import torch

from vllm.forward_context import get_forward_context, is_forward_context_available

from .plan import Decision, plan_step
from .settings import AUTO, DecodeSettings, Deployment, read_settings, resolve


def check_settings(vllm_config, model_reasons=()) -> DecodeSettings:
    """The plugin's settings for this model; raises the one ValueError when they cannot be honoured."""
    settings, problems = read_settings(vllm_config.additional_config)
    if not settings.enabled and not problems:
        return settings
    return resolve(vllm_config.additional_config, lambda: Deployment.from_vllm_config(vllm_config), model_reasons)


class KimiDecodeMixin:
    """Routing shared by our classes (and the CPU stand-in): a decision per forward call, and its counters."""

    kimi_decode: DecodeSettings
    _kimi_decode_executor = None

    def _kimi_decode_init(self, settings: DecodeSettings, require_graph: bool) -> None:
        self.kimi_decode = settings
        self.kimi_decode_require_graph = require_graph
        self.kimi_decode_steps: Counter = Counter()  # "ours" / "stock"
        self.kimi_decode_reasons: Counter = Counter()  # why a step ran stock

    def kimi_decode_plan(self, positions: torch.Tensor, intermediate_tensors=None) -> Decision:
        if not self.kimi_decode.enabled:
            return Decision(False, AUTO)
        if self._kimi_decode_executor is None:
            d = Decision(False, "executor not built (weights not loaded yet)")
        else:
            ctx = get_forward_context() if is_forward_context_available() else None
            mode = getattr(getattr(ctx, "cudagraph_runtime_mode", None), "name", "NONE")
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            d = plan_step(num_tokens=positions.shape[0], attn_metadata=getattr(ctx, "attn_metadata", None),
                          batch_sizes=self.kimi_decode.batch_sizes, runtime_mode=mode, capturing=capturing,
                          require_graph=self.kimi_decode_require_graph,
                          has_intermediate_tensors=intermediate_tensors is not None)
        self.kimi_decode_steps["ours" if d else "stock"] += 1
        if not d:
            self.kimi_decode_reasons[d.reason] += 1
        return d

    def kimi_decode_stats(self) -> dict:
        return {"steps": dict(self.kimi_decode_steps), "reasons": dict(self.kimi_decode_reasons),
                "backend": self.kimi_decode.decode_backend}
