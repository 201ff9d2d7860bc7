"""vLLM plugin: our Kimi K3 decode layers inside vLLM, switched on per deployment.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes; ours is `register`. It registers our
model classes for the Kimi K3 architectures under their own names, lazily (``"module:Class"``), so vLLM's defaults for
those names still apply and nothing imports CUDA code before vLLM forks. The classes behave exactly like vLLM's unless
``additional_config={"kimi_decode": {"decode_backend": "latency_specialized"}}`` is set (see `settings`). Nothing in
this package imports vLLM at import time; `model`, `standin` and `experts` do, and only vLLM (or the model classes)
loads them.
"""
from __future__ import annotations

ARCHITECTURES = {
    "KimiK3ForConditionalGeneration": "kimi_decode.vllm_plugin.model:KimiK3ForConditionalGeneration",
    "KimiLinearForCausalLM": "kimi_decode.vllm_plugin.model:KimiLinearForCausalLM",
}


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group. Re-entrant: registering again changes nothing."""
    from vllm import ModelRegistry

    for arch, target in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, target)
