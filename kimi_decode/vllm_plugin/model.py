"""Our model classes for vLLM's Kimi K3 architectures: vLLM's own classes plus the decode switch.

With ``decode_backend`` at ``auto`` (the default) they are vLLM's classes, unchanged. With ``latency_specialized``:
- ``__init__`` checks the settings, the deployment and the checkpoint config before any weight is allocated, and raises
  one ValueError listing every reason it cannot run (`settings.resolve`);
- ``process_weights_after_loading`` lets vLLM finish, then builds `K3DecodeExecutor` from the loaded parameters;
- ``forward`` asks `plan.plan_step` which path the step takes: ours for pure-decode steps of a prepared size under a
  full CUDA-graph capture, vLLM's stock forward for everything else.

Counters (``kimi_decode_steps``, ``kimi_decode_reasons``) count decisions; under CUDA graphs forward runs only at
capture, so they count captured graphs, not replays. This module imports vLLM and is only loaded by vLLM itself.
"""
from __future__ import annotations

import logging

import torch

from vllm.models.kimi_k3 import KimiK3ForConditionalGeneration as _StockK3
from vllm.models.kimi_k3 import KimiLinearForCausalLM as _StockKimiLinear

from .executor import K3DecodeExecutor, model_config_from_hf, shard_for
from .routing import KimiDecodeMixin, check_settings
from .settings import read_settings

log = logging.getLogger(__name__)


def _tp_group(tp: int):
    if tp == 1:
        return None
    from vllm.distributed import get_tp_group

    return get_tp_group().device_group


class KimiLinearForCausalLM(KimiDecodeMixin, _StockKimiLinear):
    """vLLM's Kimi K3 language model with our decode executor behind ``kimi_decode.decode_backend``."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        hf = vllm_config.model_config.hf_config
        settings = check_settings(vllm_config, lambda: model_config_from_hf(hf)[1])
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._kimi_decode_init(settings, require_graph=torch.cuda.is_available())

    def process_weights_after_loading(self) -> None:
        super().process_weights_after_loading()
        if not self.kimi_decode.enabled:
            return
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        m, _ = model_config_from_hf(self.config)
        shard, _ = shard_for(m, tp, rank)
        backend = "latency_specialized" if torch.cuda.is_available() else "auto"
        self._kimi_decode_executor = K3DecodeExecutor(self.model, shard, backend, _tp_group(tp))
        r = self._kimi_decode_executor.report
        log.info("kimi_decode: repacked %d layers (%d tensors shared with vLLM, %d copied, %.1f MiB)",
                 len(self._kimi_decode_executor.layers), len(r.shared), len(r.copied), r.copied_bytes / 2**20)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        if self.kimi_decode_plan(positions, intermediate_tensors):
            return self._kimi_decode_executor.run(input_ids, positions, inputs_embeds)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)


class KimiK3ForConditionalGeneration(_StockK3):
    """vLLM's Kimi K3 (vision + text). Its ``language_model`` is built through the registry as
    ``KimiLinearForCausalLM``, which the plugin maps to our class above: the switch, the checks and the routing live
    there. This class only makes sure of that."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if read_settings(vllm_config.additional_config)[0].enabled and not isinstance(
                self.language_model, KimiDecodeMixin):
            raise ValueError("kimi_decode: the language model is not the plugin's KimiLinearForCausalLM (was "
                             "KimiLinearForCausalLM registered by another plugin?) (decode_backend=\"auto\" runs "
                             "vLLM's own decode)")
