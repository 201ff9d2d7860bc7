"""Our decode executor inside vLLM: vLLM's loaded K3 weights repacked once, run by `kimi_decode`'s layer code.

Built at the model's ``process_weights_after_loading``, the last step of vLLM's loading, from vLLM's post-processed
parameters; the routed experts are vLLM's own parameters, left in the checkpoint layout because our quant method runs
vLLM's MoE on it (`experts`), and checked against what ``load_weights`` loaded (`loading`). A decode step runs:
- the embedding through vLLM's own module;
- every KDA layer through `kimi_decode.model.decode_layer` with our backend (``latency_specialized`` on CUDA, whose
  stages fall back to ``auto`` by construction; ``auto`` on the CPU build), on the KDA states gathered from vLLM's
  state cache by the step's state indices and written back afterwards;
- every MLA layer through the same stages except the attention itself, which is vLLM's own MLA module (its paged FP8
  latent cache and its kernels: our MLA attention is not specialized, and vLLM's cache is paged where ours is not);
- the final AttnRes mix, returned as the pre-norm hidden states vLLM's ``compute_logits`` expects.

vLLM cache layouts assumed (``kimi_k3/nvidia/kda.py``): a KDA layer's ``self_attn.kv_cache`` is (conv_state
[slots, 3d, width - 1] in the "DS" layout or its transpose, recurrent_state [slots, heads, key, value] fp32), and the
step's rows index it through ``attn_metadata[layer].non_spec_state_indices_tensor``.
"""
from __future__ import annotations

import logging

import torch

from ..backends import get_backend
from ..config import KDA, MLA, ModelConfig, ShardConfig
from ..instrument import DECODE_STEP, rng
from ..model import decode_layer
from ..state import KDAState, ResidualState
from ..weights import LayerWeights
from .loading import ExpertKeepingMixin
from .repack import EXPERT_TENSORS, RepackReport, params_and_buffers, repack_layer

SITU = (4.0, 25.0)
log = logging.getLogger(__name__)


def _get(cfg, name, default=None):
    return getattr(cfg, name, default)


def model_config_from_hf(hf) -> tuple[ModelConfig | None, list[str]]:
    """Our `ModelConfig` for a vLLM Kimi K3 text config, and every way the config differs from what our layers
    compute (empty: it matches)."""
    reasons = []
    lin = _get(hf, "linear_attn_config") or {}
    if not lin.get("use_full_rank_gate", False):
        reasons.append("the model's KDA layers are not Kimi K3's (no full-rank gate)")
    if not _get(hf, "q_lora_rank") or not _get(hf, "mla_use_output_gate") or not _get(hf, "mla_use_nope", False):
        reasons.append("the model's MLA layers are not Kimi K3's (q-LoRA, output gate, NoPE)")
    if _get(hf, "routed_expert_hidden_size") is None or not _get(hf, "latent_moe_use_norm", False):
        reasons.append("the model's MoE is not the latent MoE with a latent RMSNorm")
    if _get(hf, "hidden_act") != "situ" or (_get(hf, "activation_situ_beta"),
                                            _get(hf, "activation_situ_linear_beta")) != SITU:
        reasons.append(f"activation is not SiTU-GLU with betas {SITU}")
    if _get(hf, "moe_router_activation_func") != "sigmoid" or not _get(hf, "moe_renormalize", True):
        reasons.append("router is not sigmoid scores renormalised over the top-k")
    if _get(hf, "use_grouped_topk") and (_get(hf, "num_expert_group", 1), _get(hf, "topk_group", 1)) != (1, 1):
        reasons.append("grouped top-k with more than one group")
    if _get(hf, "first_k_dense_replace", 1) != 1 or _get(hf, "moe_layer_freq", 1) != 1:
        reasons.append("layer 0 alone is dense in our model")
    if _get(hf, "attn_res_block_size") is None:
        reasons.append("the model has no attention residuals (AttnRes)")
    if reasons:
        return None, reasons
    n = hf.num_hidden_layers
    m = ModelConfig(
        name=_get(hf, "model_type", "kimi"),
        hidden=hf.hidden_size, num_layers=n, vocab=hf.vocab_size, rms_eps=hf.rms_norm_eps,
        kda_heads=lin["num_heads"], kda_head_dim=lin["head_dim"], kda_conv_width=lin["short_conv_kernel_size"],
        kda_f_rank=lin["head_dim"], kda_gate_lower_bound=lin.get("gate_lower_bound", -5.0),
        mla_heads=hf.num_attention_heads, q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
        latent_eps=hf.rms_norm_eps,  # vLLM's q_a/kv_a norms use the model eps: match its stock forward
        num_experts=hf.num_experts, top_k=hf.num_experts_per_token, moe_latent=hf.routed_expert_hidden_size,
        expert_inter=hf.moe_intermediate_size,
        shared_inter=hf.moe_intermediate_size * (_get(hf, "num_shared_experts") or 0),
        dense_inter=hf.intermediate_size, routed_scaling=_get(hf, "routed_scaling_factor", 1.0) or 1.0,
        attn_res_block=hf.attn_res_block_size,
    )
    kda_layers = set(lin.get("kda_layers", ()))  # 1-indexed in the checkpoint config
    for i in range(n):
        theirs = KDA if (i + 1) in kda_layers else MLA
        if m.attention_kind(i) != theirs:
            reasons.append(f"layer {i} is {theirs} in the checkpoint but {m.attention_kind(i)} in our schedule")
            break
    return (None if reasons else m), reasons


def shard_for(m: ModelConfig, tp: int, rank: int) -> tuple[ShardConfig | None, list[str]]:
    try:
        return ShardConfig(model=m, tp=tp, rank=rank, pad_experts=True), []
    except ValueError as e:
        return None, [str(e)]


def _kda_metadata(attn_metadata, prefix: str):
    if isinstance(attn_metadata, list):
        attn_metadata = attn_metadata[0]
    return attn_metadata[prefix]


class K3DecodeExecutor:
    """Repacked layers of one rank plus the references to vLLM modules a decode step still uses."""

    def __init__(self, language_model: torch.nn.Module, shard: ShardConfig, backend: str, group=None,
                 params: dict[str, torch.Tensor] | None = None):
        """`params`: the tensors to repack, named under `language_model` (default: its parameters and buffers as
        they are now; the plugin passes them with the kept checkpoint-layout experts in place of vLLM's)."""
        self.model = language_model  # vLLM's KimiLinearModel
        self.shard, self.group = shard, group
        self.report = RepackReport()
        if params is None:
            params = params_and_buffers(language_model)
        self.layers: list[LayerWeights] = [repack_layer(params, f"layers.{i}", i, shard, self.report)
                                           for i in range(shard.model.num_layers)]
        self.backend = get_backend(backend)
        self.attn_modules = [layer.self_attn for layer in language_model.layers]
        out = language_model.output_attn_res_proj.weight
        self.out_query = out.detach().reshape(-1).float()
        self.out_key_norm = language_model.output_attn_res_norm.weight.detach().float()

    # ---- KDA state binding -------------------------------------------------------------------------------------------
    def _kda_views(self, i: int, batch: int):
        from vllm.forward_context import get_forward_context
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        attn = self.attn_modules[i]
        conv, recurrent = attn.kv_cache[:2]
        if not is_conv_state_dim_first():
            conv = conv.transpose(-1, -2)
        meta = _kda_metadata(get_forward_context().attn_metadata, attn.prefix)
        # padded rows carry PAD_SLOT_ID (-1): they read and write slot 0, vLLM's null block
        idx = meta.non_spec_state_indices_tensor[:batch].long().clamp_min(0)
        return conv, recurrent, idx

    def _run_kda(self, lw: LayerWeights, res: ResidualState, batch: int) -> None:
        conv, recurrent, idx = self._kda_views(lw.index, batch)
        state = KDAState(recurrent=recurrent.index_select(0, idx), conv=conv.index_select(0, idx).contiguous())
        decode_layer(self.backend, lw, res, state, self.shard, self.group)
        recurrent.index_copy_(0, idx, state.recurrent)
        conv.index_copy_(0, idx, state.conv)

    # ---- MLA: vLLM's attention inside our layer ----------------------------------------------------------------------
    def _run_mla(self, lw: LayerWeights, res: ResidualState, positions: torch.Tensor) -> None:
        attention = self.attn_modules[lw.index]
        decode_layer(self.backend, lw, res, None, self.shard, self.group,
                     attention=lambda x: attention(hidden_states=x, positions=positions))

    def run(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
            inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """One pure-decode step for ``positions.shape[0]`` rows -> pre-norm hidden states [rows, H]. Named
        ``decode_step`` with our layer and stage ranges inside, as in a `DecodeSlice` capture."""
        with rng(DECODE_STEP):
            return self._run(input_ids, positions, inputs_embeds)

    def _run(self, input_ids, positions, inputs_embeds):
        m = self.shard.model
        x = inputs_embeds if inputs_embeds is not None else self.model.embed_input_ids(input_ids)
        B = x.shape[0]
        blocks = x.new_zeros(B, m.num_blocks, m.hidden, dtype=torch.float32)
        blocks[:, 0] = x.float()
        res = ResidualState(blocks=blocks, partial=torch.zeros_like(blocks[:, 0]), partial_empty=True)
        for lw in self.layers:
            if lw.attn_kind == KDA:
                self._run_kda(lw, res, B)
            else:
                self._run_mla(lw, res, positions)
        n = m.completed_blocks(m.num_layers - 1)
        cands = torch.cat([res.blocks[:, :n], res.partial.unsqueeze(1)], dim=1)
        keys = cands * torch.rsqrt(cands.pow(2).mean(-1, keepdim=True) + m.rms_eps)
        probs = torch.softmax(keys @ (self.out_key_norm * self.out_query), dim=-1)
        return (probs.unsqueeze(-1) * cands).sum(1).to(x.dtype)


# ---- building it inside vLLM ------------------------------------------------------------------------------------
def _tp_rank() -> tuple[int, int]:
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank())


def _tp_group(tp: int):
    if tp == 1:
        return None
    from vllm.distributed import get_tp_group

    return get_tp_group().device_group


class K3ExecutorMixin(ExpertKeepingMixin):
    """How our K3 language-model class loads: `_kimi_decode_share_experts` (called by the class's ``__init__`` once
    vLLM's has built the layers) gives every routed-experts layer our quant method, so vLLM loads the experts into the
    checkpoint layout and leaves them there; vLLM's own loading then runs, the routed experts are referenced as loaded
    and checked to be vLLM's parameters still (one copy), and the executor is built last from ``self.model`` (vLLM's
    KimiLinearModel) and ``self.config`` (its text config)."""

    _kimi_decode_moe = "block_sparse_moe.experts"
    _kimi_decode_expert_names = EXPERT_TENSORS
    _kimi_decode_experts_shared = True
    kimi_decode_shared_layers: list[str] = []

    def _kimi_decode_share_experts(self) -> list[str]:
        """With our backend on, `experts.share_routed_experts` over the language model (raises listing every layer it
        cannot serve); with ``auto``, nothing: vLLM's quant methods stay as they are."""
        if self.kimi_decode.enabled:
            from .experts import share_routed_experts  # imports vLLM's MoE layers

            self.kimi_decode_shared_layers = share_routed_experts(self._kimi_decode_language_model())
        return self.kimi_decode_shared_layers

    def _kimi_decode_build(self, params: dict[str, torch.Tensor]) -> None:
        tp, rank = _tp_rank()
        m, _ = model_config_from_hf(self.config)
        shard, _ = shard_for(m, tp, rank)
        backend = "latency_specialized" if torch.cuda.is_available() else "auto"
        self._kimi_decode_executor = K3DecodeExecutor(self.model, shard, backend, _tp_group(tp), params=params)
        r = self._kimi_decode_executor.report
        log.info("kimi_decode: repacked %d layers (%d tensors shared with vLLM or kept from load_weights, %d copied, "
                 "%.1f MiB)", len(self._kimi_decode_executor.layers), len(r.shared), len(r.copied),
                 r.copied_bytes / 2**20)
