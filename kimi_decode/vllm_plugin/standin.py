"""A DeepSeek-V3 stand-in that exercises the plugin's switch and routing on vLLM's CPU build.

Kimi K3 itself does not load on vLLM's CPU build, but a tiny random-weight DeepSeek-V3 does (its MLA needs
kv_lora_rank 512 and qk_rope_head_dim 64 there). This class is vLLM's DeepSeek-V3 with our mixins: the same settings
reader, deployment checks and per-step plan as our K3 classes, and the same loading (`loading.ExpertKeepingMixin`):
the routed experts (bf16 ``w13_weight``/``w2_weight`` here) kept at ``load_weights``, the executor built at
``process_weights_after_loading``. vLLM's CPU MoE backend prepacks those experts into new tensors in between, as the
Hopper MXFP4 backends do for K3. Its "executor" holds the kept experts (``experts``, what our K3 executor would
repack) but runs vLLM's stock model (there are no K3 layers to repack), so its outputs equal the stock path's and the
counters show which path each step took. Not registered by the entry point: tests call `register_standin()`.
"""
from __future__ import annotations

from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM

from .loading import ExpertKeepingMixin, find_expert_tensors
from .routing import KimiDecodeMixin, check_settings

ARCHITECTURE = "DeepseekV3ForCausalLM"


class _StandInExecutor:
    def __init__(self, model, experts: dict):
        self.model = model
        self.experts = experts  # name under the language model -> the routed-expert tensor the build was given
        self.steps = 0

    def run(self, input_ids, positions, inputs_embeds=None):
        self.steps += 1
        return self.model(input_ids, positions, None, inputs_embeds)


class DeepseekV3StandIn(KimiDecodeMixin, ExpertKeepingMixin, DeepseekV3ForCausalLM):
    _kimi_decode_moe = "mlp.experts"
    _kimi_decode_expert_names = ("w13_weight", "w2_weight")

    def __init__(self, *, vllm_config, prefix: str = ""):
        settings = check_settings(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._kimi_decode_init(settings, require_graph=False)

    def _kimi_decode_build(self, params) -> None:
        names = find_expert_tensors(params, self._kimi_decode_moe, self._kimi_decode_expert_names)
        self._kimi_decode_executor = _StandInExecutor(self.model, {n: params[n] for n in names})

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        if self.kimi_decode_plan(positions, intermediate_tensors):
            return self._kimi_decode_executor.run(input_ids, positions, inputs_embeds)
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)


def register_standin() -> None:
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, "kimi_decode.vllm_plugin.standin:DeepseekV3StandIn")


def stats(model) -> dict:
    """For ``LLM.apply_model``: the stand-in's class name and routing counters."""
    out = {"class": type(model).__name__}
    if isinstance(model, KimiDecodeMixin):
        out.update(model.kimi_decode_stats())
    return out
