"""The plugin's Kimi K3 class built by vLLM's own K3 model code on vLLM's CPU build (for test_vllm_experts.py).

Run as a script (``python k3_tiny_vllm.py``) in a process of its own: importing vLLM's K3 model code into the test
process breaks the CPU engines the other test modules start there. It prints one JSON line of measurements; the test
asserts on them.

What it builds: the plugin's ``KimiLinearForCausalLM`` for a tiny K3-structured text config (`k3_checkpoint`), on
vLLM's real K3 layers (``models/kimi_k3/nvidia``: ``KimiMoE``, its ``LatentMoERunner``, router and ``RoutedExperts``),
with the routed experts quantized by vLLM's real ``Mxfp4MoEMethod`` as it is set up on Hopper with Humming (its size
rounding and ``create_weights``, hence the checkpoint layout and the MXFP4 scale loader). Two things differ from a
Hopper GPU: ``Mxfp4MoEMethod.__init__`` would pick a CPU kernel there is none of for SiTU, so the backend is set to
Humming directly; and its ``process_weights_after_loading`` would run Humming's CUDA repack, so it does what Humming
does to the parameters instead (every ``w13_*``/``w2_*`` parameter deleted, int32 ones of other shapes registered)
and counts its calls. torch's CPU build cannot create CUDA streams and events, which vLLM's K3 layers create (unused
on the CPU): stand-ins are installed for them.

The checkpoint is our random tiny K3 (`kimi_decode.weights.init_layer`): the routed experts go through vLLM's K3
``load_weights`` (per-expert ``w1``/``w2``/``w3`` ``weight_packed`` and ``weight_scale`` tensors, as the released
checkpoint names them), everything else is copied into vLLM's parameters directly, as vLLM's dummy loader fills them.
Then vLLM's ``process_weights_after_loading`` runs: every quant method's, then the model's hook (the attention layers'
step is left out: vLLM's MLA absorption fails on the CPU build, and our repack reads ``kv_b_proj`` as loaded; and the
CPU build's linear prepack keeps the weights, as the CUDA linears do).
"""
import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")  # the default GEMM + all-reduce path imports cutlass
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402


class _Event:  # torch.cuda.Event: vLLM's K3 MoE creates two per layer, only used with an aux CUDA stream
    def record(self, *args):
        pass

    def wait(self, *args):
        pass


class _Stream:  # torch.cuda.Stream: KimiLinearModel creates one for its aux stream
    def __init__(self, *args, **kwargs):
        pass


torch.cuda.Event = _Event
torch.cuda.Stream = _Stream

from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase  # noqa: E402
from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend  # noqa: E402
from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4Config, Mxfp4MoEMethod  # noqa: E402
from vllm.model_executor.model_loader import utils as loader_utils  # noqa: E402

from kimi_decode import reference as R  # noqa: E402
from kimi_decode.config import shard  # noqa: E402
from kimi_decode.testing import rel_err  # noqa: E402
from kimi_decode.vllm_plugin.executor import model_config_from_hf  # noqa: E402
from kimi_decode.vllm_plugin.repack import EXPERT_TENSORS  # noqa: E402
from kimi_decode.weights import MoEWeights, init_layer  # noqa: E402

from k3_checkpoint import EXPERTS, _bf16_norms, tiny_k3_text_config, vllm_params  # noqa: E402

TOKENS = (1, 7, 64, 300)  # decode-sized, odd, a full expert tile, prefill-sized (several expert-stage chunks)
ON = {"kimi_decode": {"decode_backend": "latency_specialized"}}
OURS = {"w13_weight": "w13", "w13_weight_scale": "w13_scale", "w2_weight": "w2", "w2_weight_scale": "w2_scale"}


class HopperMxfp4(Mxfp4MoEMethod):
    """vLLM's Mxfp4MoEMethod as set up on Hopper with Humming (see the module docstring)."""

    post_processed = 0

    def __init__(self, moe):
        FusedMoEMethodBase.__init__(self, moe)
        self.weight_dtype, self.activation_key = "mxfp4", None
        self.is_k3_situ_aiter = self.is_k3_situ_int4_gfx942 = False
        self.mxfp4_backend, self.experts_cls = Mxfp4MoeBackend.HUMMING, None
        self.max_capture_size = moe.max_capture_size
        self._cache_permute_indices = {}
        self.w13_precision_config = self.w2_precision_config = None

    def process_weights_after_loading(self, layer):
        type(self).post_processed += 1
        for name in EXPERT_TENSORS:
            packed = getattr(layer, name).detach().reshape(layer.local_num_experts, -1).view(torch.int32).clone()
            delattr(layer, name)
            layer.register_parameter(name, torch.nn.Parameter(packed, requires_grad=False))


class HopperMxfp4Config(Mxfp4Config):
    def _make_moe_method(self, moe):
        return HopperMxfp4(moe)


def _hf_config():
    hf = tiny_k3_text_config(num_layers=4)
    # 256 per rank, as vLLM pads K3's slice at TP16 and as our ShardConfig pads it, so vLLM's expert parameters and
    # our executor's have one shape
    hf.moe_intermediate_size = 256
    return hf


def _vllm_config(tmp: str, additional_config):
    hf = _hf_config()
    d = os.path.join(tmp, "on" if additional_config else "off")
    os.makedirs(d, exist_ok=True)
    cfg = hf.to_dict()
    cfg.update(architectures=["KimiLinearForCausalLM"], torch_dtype="bfloat16")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    mc = ModelConfig(model=d, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True)
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(enable_prefix_caching=False),
                    additional_config=additional_config)
    vc.quant_config = HopperMxfp4Config()
    return vc


def _build(vc):
    from kimi_decode.vllm_plugin.model import KimiLinearForCausalLM

    with set_current_vllm_config(vc):
        return KimiLinearForCausalLM(vllm_config=vc, prefix="")


def _routed(model):
    return {n: mod for n, mod in model.named_modules() if n.endswith("block_sparse_moe.experts.routed_experts")}


def _checkpoint(m, s):
    layers = [_bf16_norms(init_layer(s, i, seed=23)) for i in range(m.num_layers)]
    direct, experts = {}, []
    for lw in layers:
        p = vllm_params(lw, f"model.layers.{lw.index}", s)
        for k, t in p.items():
            if f".{EXPERTS}" not in k:
                direct[k] = t
        w = lw.mlp
        if isinstance(w, MoEWeights):
            I = w.expert_inter
            for e in range(m.num_experts):
                x = f"model.layers.{lw.index}.block_sparse_moe.experts.{e}."
                for shard_id, rows in (("w1", slice(0, I)), ("w3", slice(I, 2 * I))):
                    experts += [(x + f"{shard_id}.weight_packed", w.w13[e, rows].clone()),
                                (x + f"{shard_id}.weight_scale", w.w13_scale[e, rows].clone())]
                experts += [(x + "w2.weight_packed", w.w2[e].clone()), (x + "w2.weight_scale", w.w2_scale[e].clone())]
    return layers, direct, experts


def _fill(model, direct):
    """Every parameter the checkpoint does not carry through load_weights: ours where we have it, else random."""
    g = torch.Generator().manual_seed(5)
    params = dict(model.named_parameters())
    missing = []
    with torch.no_grad():
        for name, p in params.items():
            if ".routed_experts." in name:
                continue
            if name in direct:
                p.copy_(direct[name].reshape(p.shape))
            elif p.is_floating_point():
                missing.append(name)
                p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if name.endswith("norm.weight") else 0.0))
    return missing


def _moe_weights(mod_moe, routed, dtype=torch.float64):
    """Our MoEWeights over vLLM's parameters of one KimiMoE (the reference reads them in float64)."""
    f = (lambda t: t.detach().to(dtype))
    return MoEWeights(router=f(mod_moe.gate.weight), router_bias=f(mod_moe.gate.e_score_correction_bias),
                      down=f(mod_moe.routed_expert_down_proj.weight), w13=routed.w13_weight.detach(),
                      w13_scale=routed.w13_weight_scale.detach(), w2=routed.w2_weight.detach(),
                      w2_scale=routed.w2_weight_scale.detach(), latent_norm=f(mod_moe.routed_expert_norm.weight),
                      up=f(mod_moe.routed_expert_up_proj.weight),
                      shared_gate_up=f(mod_moe.shared_experts.gate_up_proj.weight),
                      shared_down=f(mod_moe.shared_experts.down_proj.weight))


def _compute(model, vc, s, layer: int) -> dict:
    """Relative errors against the float64 reference: the quant method's apply on a given selection, and vLLM's whole
    K3 MoE block (router, latent down-projection, runner, experts, tail) on the experts vLLM's router selected."""
    moe = model.model.layers[layer].block_sparse_moe
    routed = moe.experts.routed_experts
    method = routed.quant_method
    w64 = _moe_weights(moe, routed)
    g = torch.Generator().manual_seed(100 + layer)
    E, k, L = s.model.num_experts, s.model.top_k, s.model.moe_latent
    apply_err, block_err, seen = {}, {}, []
    spy = method.apply

    def recording_apply(*args, **kwargs):
        seen.append((kwargs["topk_ids"].clone(), kwargs["topk_weights"].clone(), kwargs["x"].clone()))
        return spy(*args, **kwargs)

    for T in TOKENS:
        x = torch.randn(T, L, generator=g).to(torch.bfloat16)
        ids = torch.rand(T, E, generator=g).argsort(dim=-1)[:, :k].to(torch.int32)  # distinct experts per row
        weights = torch.rand(T, k, generator=g) + 0.1
        got = method.apply(layer=routed, x=x, topk_weights=weights, topk_ids=ids, shared_experts=None,
                           shared_experts_input=None)
        want = R.routed_experts(x.double(), ids.long(), weights.double(), w64, s)
        apply_err[T] = {"err": rel_err(got, want), "dtype": str(got.dtype), "shape": list(got.shape)}

        hidden = (torch.randn(T, s.model.hidden, generator=g)).to(torch.bfloat16)
        seen.clear()
        method.apply = recording_apply
        try:
            with set_current_vllm_config(vc), set_forward_context(None, vc), torch.no_grad():
                out = moe(hidden)
        finally:
            del method.apply
        ids_v, weights_v, x_v = seen[0]
        want = R.moe(hidden.double(), w64, s, ids=ids_v.long())
        latent = R.linear(hidden.double(), w64.down)
        block_err[T] = {"err": rel_err(out, want), "calls": len(seen), "dtype": str(out.dtype),
                        "expert_input_err": rel_err(x_v, latent), "expert_input_shape": list(x_v.shape),
                        "weights_err": rel_err(weights_v, R.route(hidden.double(), w64, s, ids=ids_v.long())[1])}
    return {"apply": apply_err, "block": block_err}


def main():
    import atexit
    import shutil
    import tempfile

    # vLLM's MLA post-processing (absorbing kv_b_proj into W_UK_T/W_UV) fails on the CPU build ("kv_b_proj weight (0,)"
    # in split_kv_b_proj); it is not what is tested here, and our repack reads kv_b_proj as loaded. The rest of vLLM's
    # process_weights_after_loading (every quant method, then the model's hook) runs as it is.
    loader_utils.is_deferred_attention_layer = lambda module: False
    # vLLM's CPU build prepacks every dense linear for its CPU GEMM and drops the weight (remove_weight=True); on CUDA
    # the linears keep their weights, which our executor reads. Keep them here too.
    import vllm.model_executor.layers.utils as layer_utils

    prepack = layer_utils.dispatch_cpu_unquantized_gemm
    layer_utils.dispatch_cpu_unquantized_gemm = lambda layer, remove_weight: prepack(layer, remove_weight=False)

    tmp = tempfile.mkdtemp()
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # vLLM's configs and the process group's rendezvous file
    on_vc, off_vc = _vllm_config(tmp, ON), _vllm_config(tmp, {})
    with set_current_vllm_config(on_vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"file://{os.path.join(tmp, 'dist_init')}",
                                     backend="gloo")
        initialize_model_parallel(1)
    torch.set_default_dtype(torch.bfloat16)  # vLLM's loader sets the model dtype as default while it builds
    on, off = _build(on_vc), _build(off_vc)
    torch.set_default_dtype(torch.float32)
    m, _ = model_config_from_hf(_hf_config())
    s = shard(m, tp=1)
    layers, direct, experts = _checkpoint(m, s)
    out = {"quant_methods": {}}
    for label, model, vc in (("on", on, on_vc), ("off", off, off_vc)):
        routed = _routed(model)
        created = {f"{n}.{t}": getattr(r, t).data_ptr() for n, r in routed.items() for t in EXPERT_TENSORS}
        out["quant_methods"][label] = {n: type(r.quant_method).__name__ for n, r in routed.items()}
        out[f"{label}_stock_inside"] = {n: type(getattr(r.quant_method, "stock", None)).__name__
                                        for n, r in routed.items()}
        out[f"{label}_shared_layers"] = list(getattr(model, "kimi_decode_shared_layers", []))
        out[f"{label}_random"] = _fill(model, direct)  # parameters our checkpoint has none of (embedding, head)
        loaded = model.load_weights(iter(experts))
        HopperMxfp4.post_processed = 0
        with set_current_vllm_config(vc):
            loader_utils.process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
        out[f"{label}_stock_post_processed"] = HopperMxfp4.post_processed
        now = {f"{n}.{t}": getattr(r, t) for n, r in routed.items() for t in EXPERT_TENSORS}
        want = {f"model.layers.{lw.index}.block_sparse_moe.experts.routed_experts.{t}": getattr(lw.mlp, a)
                for lw in layers if isinstance(lw.mlp, MoEWeights) for t, a in OURS.items()}
        out[f"{label}_experts"] = {
            n: {"same_storage": t.data_ptr() == created[n], "dtype": str(t.dtype), "shape": list(t.shape),
                "checkpoint_bytes": t.dtype == want[n].dtype and t.shape == want[n].shape and torch.equal(t, want[n]),
                "loaded": n.removeprefix("model.") in {x.removeprefix("model.") for x in loaded}}
            for n, t in now.items()}
        if label == "on":
            report = model.kimi_decode_keep_report
            out["keep_report"] = {"loaded": report.loaded, "kept": report.kept, "kept_bytes": report.kept_bytes,
                                  "shared": sorted(report.shared)}
            ex = model._kimi_decode_executor
            out["executor_shares"] = {
                f"layers.{lw.index}.{t}": getattr(lw.mlp, a).data_ptr() == now[
                    f"model.layers.{lw.index}.block_sparse_moe.experts.routed_experts.{t}"].data_ptr()
                for lw in ex.layers if isinstance(lw.mlp, MoEWeights) for t, a in OURS.items()}
            out["compute"] = {layer: _compute(model, vc, s, layer) for layer in (1, 3)}  # a KDA and an MLA MoE layer
        else:
            out["off_executor"] = model._kimi_decode_executor is not None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
