"""A realistic synthetic pair of decode captures (a generic backend and a fused one) for diff and report tests.

Each capture is an eager trace of a few decode steps of one rank: the CPU thread opens ``decode_step`` >
``layer[i]:kind`` > stage ranges and launches every kernel inside its stage; the GPU runs the kernels on a main
stream, with optional side streams that fork from and join the main stream. Durations are in µs and resemble an H200
at TP16, batch 1; they are made up, not measured.

Run from the repository root to write the pair as .kprof files: ``python tests/data/synthetic.py OUT_DIR``.
"""
from __future__ import annotations

import sys

import pandas as pd

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))

from analyzers.trace import Trace  # noqa: E402

MAIN, SIDE, PREFETCH_STREAM, COMM = 7, 8, 9, 10

# (stage, kernel name, µs, stream); a kernel on a side stream forks from the main stream where it is launched;
# "join" waits for every side stream before running.
AUTO_KDA = [
    ("attn_res", "rmsnorm_kernel", 1.6, MAIN), ("attn_res", "attn_res_block_sum", 1.4, MAIN),
    ("qkv_proj", "triton_mxfp8_gemm_qkv", 6.5, MAIN), ("qkv_proj", "kda_short_conv1d", 1.8, MAIN),
    ("qkv_proj", "kda_gate_f_lowrank", 1.5, MAIN),
    ("kda_core", "kda_beta_sigmoid", 1.1, MAIN), ("kda_core", "kda_l2norm_qk", 1.3, MAIN),
    ("kda_core", "kda_recurrent_decode", 4.2, MAIN), ("kda_core", "kda_gated_rmsnorm", 1.4, MAIN),
    ("o_proj", "triton_mxfp8_gemm_o", 4.8, MAIN),
    ("allreduce", "cross_device_reduce_1stage", 6.0, MAIN),
    ("attn_res", "rmsnorm_kernel", 1.6, MAIN), ("attn_res", "attn_res_block_sum", 1.4, MAIN),
    ("router", "router_gemm_fp32", 2.2, MAIN), ("router", "triton_topk_softmax", 1.7, MAIN),
    ("shared_experts", "triton_mxfp8_gemm_gate_up", 4.1, MAIN), ("shared_experts", "silu_and_mul", 1.2, MAIN),
    ("shared_experts", "triton_mxfp8_gemm_down", 3.0, MAIN),
    ("routed_experts", "moe_align_block_size", 1.5, MAIN), ("routed_experts", "mxfp4_grouped_gemm_up", 9.5, MAIN),
    ("routed_experts", "silu_and_mul", 1.2, MAIN), ("routed_experts", "mxfp4_grouped_gemm_down", 7.0, MAIN),
    ("moe_tail", "moe_sum_reduce", 1.4, MAIN),
    ("allreduce", "cross_device_reduce_1stage", 6.0, MAIN),
]
AUTO_MLA = [
    ("attn_res", "rmsnorm_kernel", 1.6, MAIN), ("attn_res", "attn_res_block_sum", 1.4, MAIN),
    ("qkv_proj", "triton_mxfp8_gemm_q_a", 3.5, MAIN), ("qkv_proj", "rmsnorm_kernel", 1.2, MAIN),
    ("qkv_proj", "triton_mxfp8_gemm_q_b", 3.9, MAIN), ("qkv_proj", "triton_mxfp8_gemm_kv_a", 2.8, MAIN),
    ("mla_core", "fp8_latent_cache_write", 1.3, MAIN), ("mla_core", "flashmla_decode_fp8", 12.5, MAIN),
    ("mla_core", "flashmla_combine", 1.5, MAIN), ("mla_core", "mla_gate_mul", 1.1, MAIN),
    ("o_proj", "triton_mxfp8_gemm_o", 4.8, MAIN),
    ("allreduce", "cross_device_reduce_1stage", 6.0, MAIN),
] + AUTO_KDA[11:]
FUSED_KDA = [
    ("qkv_proj", "cute_attnres_rmsnorm_qkv_gemm", 6.8, MAIN),
    ("kda_core", "cute_kda_decode_fused", 4.6, MAIN),
    ("o_proj", "cute_o_proj_gemm", 4.4, MAIN),
    ("allreduce", "one_shot_allreduce_rmsnorm", 3.6, MAIN),
    ("router", "cute_router_topk", 2.0, MAIN),
    ("prefetch", "l2_prefetch_expert_weights", 6.0, PREFETCH_STREAM),
    ("shared_experts", "cute_shared_expert_mlp", 6.2, SIDE),
    ("routed_experts", "cute_moe_permute", 1.0, MAIN),
    ("routed_experts", "cute_mxfp4_moe_up", 7.6, MAIN),
    ("routed_experts", "cute_mxfp4_moe_down", 5.4, MAIN),
    ("moe_tail", "cute_moe_combine", 1.2, "join"),
    ("allreduce", "one_shot_allreduce_rmsnorm", 3.6, COMM),
    ("attn_res", "cute_attnres_block_sum", 1.1, MAIN),
]
FUSED_MLA = [
    ("qkv_proj", "cute_attnres_rmsnorm_q_kv_gemm", 7.2, MAIN),
    ("mla_core", "cute_mla_decode_fp8", 11.0, MAIN),
    ("o_proj", "cute_o_proj_gemm", 4.4, MAIN),
] + FUSED_KDA[3:]

LAYERS = [(0, "kda"), (1, "kda"), (2, "kda"), (3, "mla")]
BACKENDS = {"auto": {"kda": AUTO_KDA, "mla": AUTO_MLA}, "fused": {"kda": FUSED_KDA, "mla": FUSED_MLA}}


def decode_capture(backend: str = "auto", steps: int = 3, prefetch: bool = True, jitter: float = 0.03) -> Trace:
    """A :class:`Trace` of ``steps`` eager decode steps of :data:`LAYERS` with the given backend's kernels.
    ``prefetch=False`` drops the prefetch stage and makes the routed-expert GEMMs slower (no warm L2)."""
    ranges, launches, kernels = [], [], []
    cpu, gpu = 0, 1_000_000  # ns; the GPU runs well behind the CPU, as in a real eager trace
    corr = 0
    for step in range(steps):
        step_start = cpu
        cpu += 500
        cursor = {MAIN: gpu, SIDE: gpu, PREFETCH_STREAM: gpu, COMM: gpu}
        for layer, kind in LAYERS:
            layer_start = cpu
            cpu += 200
            stage_open = None
            for stage, name, us, stream in BACKENDS[backend][kind]:
                if stage == "prefetch" and not prefetch:
                    continue
                if not prefetch and "moe_up" in name or not prefetch and "moe_down" in name:
                    us *= 1.35
                scale = 1.0 + jitter * (((step * 7 + layer * 3 + corr) % 5) - 2) / 2
                dur = int(us * 1000 * scale)
                if stage_open is None or stage_open[0] != stage:
                    if stage_open is not None:
                        ranges.append((stage_open[0], stage_open[1], cpu))
                        cpu += 100
                    stage_open = (stage, cpu)
                    cpu += 100
                corr += 1
                launches.append((corr, cpu, cpu + 2000))
                cpu += 2500
                if stream == "join":
                    start = max(cursor.values())
                    stream = MAIN
                elif stream == MAIN:
                    start = cursor[MAIN]
                else:
                    start = max(cursor[MAIN], cursor[stream])
                kernels.append((corr, stream, start, start + dur, name))
                cursor[stream] = start + dur + (800 if stream == MAIN else 300)
            ranges.append((stage_open[0], stage_open[1], cpu))
            cpu += 200
            ranges.append((f"layer[{layer}]:{kind}", layer_start, cpu))
            cpu += 300
        corr += 1
        launches.append((corr, cpu, cpu + 2000))
        start = max(cursor.values())
        kernels.append((corr, MAIN, start, start + 3000, "sampling_argmax"))
        cpu += 2500
        ranges.append(("decode_step", step_start, cpu))
        cpu += 5000
        gpu = start + 20_000
    meta = {"source": "synthetic", "gpu": "NVIDIA H200", "backend": backend,
            "config": {"tp": 16, "batch": 1, "prefetch": prefetch, "layers": len(LAYERS)},
            "versions": {"torch": "2.11.0", "cuda": "13.0"}}
    return Trace(
        ranges=pd.DataFrame([{"pid": 1, "tid": 1, "start_ns": s, "end_ns": e, "name": n, "domain": "kimi_decode"}
                             for n, s, e in ranges]),
        launches=pd.DataFrame([{"pid": 1, "tid": 1, "start_ns": s, "end_ns": e, "name": "cudaLaunchKernel",
                                "correlation_id": c} for c, s, e in launches]),
        kernels=pd.DataFrame([{"kind": "kernel", "device": 0, "stream": st, "pid": 1, "start_ns": s, "end_ns": e,
                               "name": n, "correlation_id": c} for c, st, s, e, n in kernels]),
        meta=meta,
    )


if __name__ == "__main__":
    out = __import__("pathlib").Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    decode_capture("auto").save(out / "auto_tp16_b1.kprof")
    decode_capture("fused").save(out / "fused_tp16_b1.kprof")
    decode_capture("fused", prefetch=False).save(out / "fused_noprefetch_tp16_b1.kprof")
