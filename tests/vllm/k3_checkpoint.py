"""Synthetic vLLM K3 parameters for the plugin's tests: our random layers laid out the way vLLM's K3 model stores them
on one rank (`vllm_params`, following vllm/models/kimi_k3/nvidia/{model,kda,mla}.py), and a tiny K3 text config."""
import torch

from kimi_decode.config import KDA, MLA, ModelConfig, ShardConfig
from kimi_decode.weights import DenseMLPWeights, LayerWeights

BF16 = torch.bfloat16
# where FusedMoEFactory's MoE runner holds the routed experts under each MoE layer
EXPERTS = "block_sparse_moe.experts.routed_experts."


def _bf16_norms(lw: LayerWeights) -> LayerWeights:
    """vLLM holds RMSNorm weights in the model dtype: the checkpoint's norms are bf16 values."""
    for part, names in ((lw.attn_res, ("query", "key_norm", "input_norm")),
                        (lw.mlp_res, ("query", "key_norm", "input_norm")),
                        (lw.attn, ("o_norm",) if lw.attn_kind == KDA else ("q_a_norm", "kv_a_norm")),
                        (lw.mlp, () if isinstance(lw.mlp, DenseMLPWeights) else ("latent_norm",))):
        for n in names:
            setattr(part, n, getattr(part, n).to(BF16).float())
    return lw


def vllm_params(lw: LayerWeights, prefix: str, shard: ShardConfig, absorbed_kv_b: bool = False,
                experts: str = EXPERTS) -> dict[str, torch.Tensor]:
    """Our layer as vLLM's K3 model stores it on one rank (names under `prefix`, vLLM's shapes and dtypes; the
    routed experts under `experts`, in the checkpoint layout, as ``load_weights`` leaves them)."""
    p = {}

    def put(name, t):
        p[f"{prefix}.{name}"] = t

    for sub, proj, norm, inorm in ((lw.attn_res, "self_attention_res_proj", "self_attention_res_norm",
                                    "input_layernorm"),
                                   (lw.mlp_res, "mlp_res_proj", "mlp_res_norm", "post_attention_layernorm")):
        put(f"{proj}.weight", sub.query.to(BF16).unsqueeze(0))  # ReplicatedLinear(H, 1): [1, H]
        put(f"{norm}.weight", sub.key_norm.to(BF16))
        put(f"{inorm}.weight", sub.input_norm.to(BF16))
    a = lw.attn
    if lw.attn_kind == KDA:
        put("self_attn.in_proj_qkvgfab.weight", a.in_proj)
        put("self_attn.f_b_proj.weight", a.f_b)
        put("self_attn.conv1d.weight", a.conv.unsqueeze(1))  # ColumnParallelLinear(width, 3d) unsqueezed: [3d, 1, w]
        put("self_attn.A_log", a.A_log)
        put("self_attn.dt_bias", a.dt_bias)
        put("self_attn.o_norm.weight", a.o_norm.to(BF16))
        put("self_attn.o_proj.weight", a.o_proj)
    else:
        m, h = shard.model, shard.mla_heads
        put("self_attn.fused_qkv_a_g_proj.weight", torch.cat([a.qkv_a, a.g_proj]))  # [q_a | kv_a | gate]
        put("self_attn.q_a_layernorm.weight", a.q_a_norm.to(BF16))
        put("self_attn.kv_a_layernorm.weight", a.kv_a_norm.to(BF16))
        put("self_attn.q_b_proj.weight", a.q_b)
        if absorbed_kv_b:  # what MultiHeadLatentAttention.process_weights_after_loading leaves behind
            w = a.kv_b.T.reshape(m.kv_lora_rank, h, m.qk_nope_head_dim + m.v_head_dim)
            w_uk, w_uv = w.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
            put("self_attn.W_UK_T", w_uk.permute(1, 2, 0))
            put("self_attn.W_UV", w_uv.transpose(0, 1))
            put("self_attn.kv_b_proj.weight", torch.empty(0, dtype=BF16))
        else:
            put("self_attn.kv_b_proj.weight", a.kv_b)
        put("self_attn.o_proj.weight", a.o_proj)
    w = lw.mlp
    if isinstance(w, DenseMLPWeights):
        put("mlp.gate_up_proj.weight", w.gate_up)
        put("mlp.down_proj.weight", w.down)
    else:
        b = "block_sparse_moe."
        put(b + "gate.weight", w.router)
        put(b + "gate.e_score_correction_bias", w.router_bias)
        put(b + "routed_expert_down_proj.weight", w.down)
        put(experts + "w13_weight", w.w13)
        put(experts + "w13_weight_scale", w.w13_scale)
        put(experts + "w2_weight", w.w2)
        put(experts + "w2_weight_scale", w.w2_scale)
        put(b + "routed_expert_norm.weight", w.latent_norm.to(BF16))
        put(b + "routed_expert_up_proj.weight", w.up)
        put(b + "shared_experts.gate_up_proj.weight", w.shared_gate_up)
        put(b + "shared_experts.down_proj.weight", w.shared_down)
    return p


def tiny_k3_text_config(num_layers: int = 4):
    """A K3-structured text config of CPU size as vLLM's KimiLinearConfig holds it (`model_config_from_hf` maps it to
    our ModelConfig): layer 0 dense, KDA layers, MLA every fourth layer and last, latent MoE with padded experts."""
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    schedule = ModelConfig(name="schedule", num_layers=num_layers)
    kda = [i + 1 for i in range(num_layers) if schedule.attention_kind(i) == KDA]  # 1-indexed, as in the checkpoint
    mla = [i + 1 for i in range(num_layers) if schedule.attention_kind(i) == MLA]
    return KimiLinearConfig(
        model_type="kimi_linear", vocab_size=1024, hidden_size=256, intermediate_size=256,
        num_hidden_layers=num_layers, num_attention_heads=8, hidden_act="situ", rms_norm_eps=1e-5,
        moe_intermediate_size=96, num_experts=32, num_experts_per_token=4, num_shared_experts=1,
        first_k_dense_replace=1, use_grouped_topk=True, num_expert_group=1, topk_group=1,
        q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        mla_use_nope=True, mla_use_output_gate=True, attn_res_block_size=4, latent_moe_use_norm=True,
        activation_situ_beta=4.0, activation_situ_linear_beta=25.0, routed_expert_hidden_size=128,
        linear_attn_config={"num_heads": 8, "head_dim": 32, "short_conv_kernel_size": 4, "kda_layers": kda,
                            "full_attn_layers": mla, "use_full_rank_gate": True, "gate_lower_bound": -5.0},
    )
