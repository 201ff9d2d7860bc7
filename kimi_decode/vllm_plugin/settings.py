"""The plugin's one switch, and the deployments it serves.

The setting lives in its own namespace of vLLM's ``additional_config``, so it never meets vLLM's in-tree
``decode_backend`` key (vLLM 0.33's own Blackwell-only executor)::

    additional_config={"kimi_decode": {"decode_backend": "latency_specialized", "batch_sizes": [1, 2, 4, 8]}}

`read_settings` is the only reader: a missing namespace or key means ``auto``, which is vLLM's own forward, untouched.
`resolve` is called in the model's ``__init__``, before any weight is allocated; when the switch is on it checks the
whole deployment and raises one ValueError naming every reason it cannot serve it (default-deny).

Nothing here imports vLLM: `Deployment.from_vllm_config` reads a ``VllmConfig`` by attribute, so the checks are plain
functions over plain values.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

NAMESPACE = "kimi_decode"
AUTO, SPECIALIZED = "auto", "latency_specialized"
DECODE_BACKENDS = (AUTO, SPECIALIZED)
# Our kernels cover every batch up to 64 (kimi_decode.backends.latency_specialized.FAST_MAX_ROWS); the executor
# prepares the small sizes by default, each one a CUDA-graph capture of its own.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8)
MAX_BATCH = 64  # kimi_decode.slice.MAX_BATCH: our static buffers
KNOWN_KEYS = {"decode_backend", "batch_sizes"}
SUPPORTED_TP = (8, 16)
# sm_90a: the CuTe DSL kernels are compiled for Hopper. Blackwell has vLLM's own latency_specialized executor.
SUPPORTED_CAPABILITIES = ((9, 0),)
AUTO_HINT = f'(decode_backend="{AUTO}" runs vLLM\'s own decode)'


@dataclass(frozen=True)
class DecodeSettings:
    decode_backend: str = AUTO
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES

    @property
    def enabled(self) -> bool:
        return self.decode_backend != AUTO


def _namespace(additional_config) -> Mapping:
    if not isinstance(additional_config, Mapping):
        return {}
    ours = additional_config.get(NAMESPACE, {})
    return ours if isinstance(ours, Mapping) else {"<not a mapping>": ours}


def read_settings(additional_config) -> tuple[DecodeSettings, list[str]]:
    """Our settings from vLLM's ``additional_config`` -> (settings, problems). Missing means ``auto``."""
    ours = _namespace(additional_config)
    problems = []
    for key in sorted(set(ours) - KNOWN_KEYS):
        problems.append(f"unknown setting {NAMESPACE}.{key} (known: {', '.join(sorted(KNOWN_KEYS))})")
    backend = ours.get("decode_backend", AUTO)
    if backend not in DECODE_BACKENDS:
        problems.append(f"{NAMESPACE}.decode_backend={backend!r} is not one of {', '.join(DECODE_BACKENDS)}")
        backend = SPECIALIZED  # still check the deployment, so the error lists everything at once
    sizes = ours.get("batch_sizes", DEFAULT_BATCH_SIZES)
    try:
        sizes = tuple(sorted({int(s) for s in sizes}))
        if not sizes or any(not 1 <= s <= MAX_BATCH for s in sizes):
            raise ValueError
    except (TypeError, ValueError):
        problems.append(f"{NAMESPACE}.batch_sizes={ours.get('batch_sizes')!r} must be a list of integers "
                        f"in 1..{MAX_BATCH}")
        sizes = DEFAULT_BATCH_SIZES
    return DecodeSettings(backend, sizes), problems


def decode_backend(additional_config) -> str:
    """The switch alone: ``auto`` unless set. Raises ValueError for an unknown value."""
    settings, problems = read_settings(additional_config)
    if problems:
        raise ValueError("; ".join(problems))
    return settings.decode_backend


@dataclass(frozen=True)
class Deployment:
    """What the checks need to know about a vLLM deployment, as plain values."""

    platform: str  # "cuda", "cpu", "rocm", ...
    capability: tuple[int, int] | None  # CUDA compute capability of this rank's GPU
    tp: int
    pp: int = 1
    dp: int = 1
    expert_parallel: bool = False
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "float32"
    speculative: bool = False
    lora: bool = False
    enforce_eager: bool = False
    full_decode_graphs: bool = True
    compiled_forward: bool = False  # torch.compile traces the forward
    capture_sizes: tuple[int, ...] = ()
    architecture: str = ""
    quantization: str | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "Deployment":
        from vllm.platforms import current_platform  # only where vLLM runs

        mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
        comp = vllm_config.compilation_config
        platform = "cuda" if current_platform.is_cuda() else ("rocm" if current_platform.is_rocm()
                                                                 else str(current_platform.device_type))
        capability = None
        if platform == "cuda":
            cap = current_platform.get_device_capability()
            capability = (cap.major, cap.minor) if cap is not None else None
        mode = getattr(comp, "cudagraph_mode", None)
        full = bool(mode is not None and mode.decode_mode().name == "FULL")
        level = getattr(comp, "mode", 0)
        return cls(
            platform=platform,
            capability=capability,
            tp=pc.tensor_parallel_size,
            pp=pc.pipeline_parallel_size,
            dp=pc.data_parallel_size,
            expert_parallel=bool(pc.enable_expert_parallel),
            dtype=str(mc.dtype).removeprefix("torch."),
            kv_cache_dtype=str(cc.cache_dtype),
            mamba_cache_dtype=str(getattr(cc, "mamba_cache_dtype", "auto")),
            mamba_ssm_cache_dtype=str(getattr(cc, "mamba_ssm_cache_dtype", "auto")),
            speculative=vllm_config.speculative_config is not None,
            lora=vllm_config.lora_config is not None,
            enforce_eager=bool(mc.enforce_eager),
            full_decode_graphs=full,
            compiled_forward=int(getattr(level, "value", level) or 0) != 0,
            capture_sizes=tuple(sorted(getattr(comp, "cudagraph_capture_sizes", None) or ())),
            architecture=(mc.architectures or [""])[0],
            quantization=mc.quantization,
        )


def deployment_reasons(d: Deployment, settings: DecodeSettings) -> list[str]:
    """Every reason our executor cannot serve `d` (empty: it can). Default-deny: what is not listed as served fails."""
    reasons = []
    if d.platform == "cuda":
        if d.capability not in SUPPORTED_CAPABILITIES:
            got = "unknown" if d.capability is None else f"SM{d.capability[0]}{d.capability[1]}"
            reasons.append(f"GPU architecture {got} is not Hopper SM90 (our kernels are built for sm_90a; on "
                           "Blackwell use vLLM's own decode_backend)")
        if d.tp not in SUPPORTED_TP:
            reasons.append(f"tensor parallel size {d.tp} is not one of {', '.join(map(str, SUPPORTED_TP))}")
        if d.enforce_eager or not d.full_decode_graphs:
            reasons.append("decode steps do not run as full CUDA graphs (enforce_eager or a cudagraph_mode without "
                           "FULL decode graphs)")
        missing = [s for s in settings.batch_sizes if d.capture_sizes and s not in d.capture_sizes]
        if missing:
            reasons.append(f"batch sizes {missing} are not CUDA-graph capture sizes {list(d.capture_sizes)}")
    elif d.platform != "cpu":  # the CPU build runs the executor with our portable torch path (tests, development)
        reasons.append(f"platform {d.platform!r} is not CUDA")
    if d.compiled_forward:
        reasons.append("torch.compile traces the model forward (Kimi K3 runs with compilation mode NONE)")
    if d.pp != 1:
        reasons.append(f"pipeline parallelism ({d.pp} stages)")
    if d.dp != 1:
        reasons.append(f"data parallelism ({d.dp} replicas)")
    if d.expert_parallel:
        reasons.append("expert parallelism (our MoE holds every expert's tensor-parallel slice)")
    if d.dtype != "bfloat16":
        reasons.append(f"model dtype {d.dtype} is not bfloat16")
    if d.mamba_ssm_cache_dtype not in ("float32", "auto"):
        reasons.append(f"KDA recurrent state dtype {d.mamba_ssm_cache_dtype} is not float32")
    if d.mamba_cache_dtype not in ("auto", "bfloat16"):
        reasons.append(f"KDA conv state dtype {d.mamba_cache_dtype} is not bfloat16")
    if d.speculative:
        reasons.append("speculative decoding (our decode verifies one token per sequence)")
    if d.lora:
        reasons.append("LoRA adapters")
    if d.quantization not in (None, "mxfp4", "compressed-tensors"):
        reasons.append(f"quantization {d.quantization!r} (routed experts must be MXFP4, the rest bf16)")
    return reasons


def routed_expert_bytes(model, tp: int) -> int:
    """Device bytes of one rank's routed experts in the checkpoint layout (MXFP4 codes and ue8m0 scales of w13 and
    w2, every MoE layer, the expert slice padded as vLLM and `ShardConfig(pad_experts=True)` pad it)."""
    from kimi_decode.config import DENSE, ShardConfig

    s = ShardConfig(model, tp=tp, pad_experts=True)
    L, I, g = model.moe_latent, s.expert_inter, model.mxfp4_group
    per_expert = 2 * I * (L // 2 + L // g) + L * (I // 2 + I // g)
    moe_layers = sum(1 for layer in range(model.num_layers) if model.mlp_kind(layer) != DENSE)
    return moe_layers * model.num_experts * per_expert


def memory_reasons(model, tp: int, gpu_bytes: int | None) -> list[str]:
    """The reason, if one rank's routed experts alone do not fit the GPU (a lower bound on what the deployment needs).

    They are held once: with our backend on, vLLM's MoE layers run our expert kernels on the checkpoint layout our
    decode kernels read, and vLLM's repack for its own MoE backend (Humming or Marlin on Hopper) is skipped
    (`experts.share_routed_experts`)."""
    if gpu_bytes is None or tp not in SUPPORTED_TP:
        return []
    experts = routed_expert_bytes(model, tp)
    if experts <= gpu_bytes:
        return []
    gib = 2**30
    return [f"the routed experts alone take {experts / gib:.1f} GiB per rank at TP{tp} (one copy, in the checkpoint "
            f"layout that our decode kernels and vLLM's MoE layers share), more than the GPU's {gpu_bytes / gib:.1f} "
            f"GiB"]


def refusal(problems, asked: str = SPECIALIZED) -> str:
    """The one start-up error: every problem on a line, then how to run without us."""
    lines = "\n".join(f"  - {p}" for p in problems)
    return f"kimi_decode cannot run decode_backend={asked!r} here:\n{lines}\n{AUTO_HINT}"


def resolve(additional_config, deployment=None, model_reasons=()) -> DecodeSettings:
    """The settings to run with. Raises one ValueError listing every problem when the switch is on and cannot be
    honoured; ``auto`` never raises on account of the deployment or the model.

    `deployment` is a `Deployment` or a callable returning one (called only when the switch is on); `model_reasons`
    are the model's own mismatches (a callable or a list), checked likewise only when the switch is on.
    """
    settings, problems = read_settings(additional_config)
    if settings.enabled:
        d = deployment() if callable(deployment) else deployment
        if d is not None:
            problems += deployment_reasons(d, settings)
        problems += list(model_reasons() if callable(model_reasons) else model_reasons)
    if problems:
        raise ValueError(refusal(problems, _namespace(additional_config).get("decode_backend", AUTO)))
    return settings
