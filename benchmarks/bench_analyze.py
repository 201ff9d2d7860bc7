"""Speed and memory of `kprof import` + `kprof analyze` on a synthetic torch.profiler trace, next to
HolisticTraceAnalysis's kernel breakdown.

    python benchmarks/bench_analyze.py                       # 1,000,000 kernels; HTA on 100,000
    python benchmarks/bench_analyze.py --kernels 200000 --hta-kernels 20000

The synthetic trace looks like a Kineto export of decode steps: per step 40 layers of 5 stages of 5 kernels on two
streams, each kernel with its cudaLaunchKernel runtime event, its ac2g flow pair and Kineto's usual kernel args,
plus the record_function ranges (CPU `user_annotation` and GPU `gpu_user_annotation`). Every measured stage runs in
a fresh process, so its peak RSS (getrusage ru_maxrss) is its own.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS, STAGES, KERNELS_PER_STAGE = 40, ("attn_res", "qkv_proj", "kda_core", "o_proj", "routed_experts"), 5
KERNEL_NAMES = [
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>(Params)",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>(int, T, T)",
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0",
    "void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, cutlass::bfloat16_t>>",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
]


def generate(path: Path, n_kernels: int) -> None:
    """Write a synthetic Kineto trace with ``n_kernels`` kernels."""
    per_step = LAYERS * len(STAGES) * KERNELS_PER_STAGE
    steps = max(1, n_kernels // per_step)
    pid, tid, base = 4242, 4242, 5105233697250.768
    with open(path, "w") as out:
        out.write('{\n  "schemaVersion": 1,\n  "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}],\n'
                  '  "distributedInfo": {"rank": 0},\n  "traceEvents": [\n')
        correlation, cpu, first = 0, base, True
        written = 0
        for step in range(steps):
            lines = []

            def annotation(name: str, start: float, end: float) -> None:
                lines.append(f'  {{"ph": "X", "cat": "user_annotation", "name": "{name}", "pid": {pid}, "tid": {tid},'
                             f' "ts": {start:.3f}, "dur": {end - start:.3f}, "args": {{"External id": {correlation}}}}}')
                lines.append(f'  {{"ph": "X", "cat": "gpu_user_annotation", "name": "{name}", "pid": 0, "tid": 7,'
                             f' "ts": {start + 5:.3f}, "dur": {end - start:.3f}, "args": {{"External id": {correlation}}}}}')

            step_start = cpu
            gpu = cpu + 20.0
            for layer in range(LAYERS):
                layer_start = cpu
                for stage in STAGES:
                    stage_start = cpu
                    for k in range(KERNELS_PER_STAGE):
                        if written >= n_kernels:
                            break
                        correlation += 1
                        written += 1
                        stream = 7 if k % 3 else 8
                        dur = 2.0 + (correlation % 7) * 0.731
                        lines.append(f'  {{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": {pid},'
                                     f' "tid": {tid}, "ts": {cpu + 0.1:.3f}, "dur": 2.912, "args": {{"External id":'
                                     f' {correlation}, "cbid": 211, "correlation": {correlation}}}}}')
                        lines.append(f'  {{"ph": "s", "id": {correlation}, "pid": {pid}, "tid": {tid}, "ts":'
                                     f' {cpu + 0.1:.3f}, "cat": "ac2g", "name": "ac2g"}}')
                        lines.append(f'  {{"ph": "X", "cat": "kernel", "name": "{KERNEL_NAMES[k]}", "pid": 0,'
                                     f' "tid": {stream}, "ts": {gpu:.3f}, "dur": {dur:.3f}, "args": {{"External id":'
                                     f' {correlation}, "queued": 0, "device": 0, "context": 1, "stream": {stream},'
                                     f' "correlation": {correlation}, "registers per thread": 128, "shared memory":'
                                     f' 49152, "blocks per SM": 0.97, "warps per SM": 3.88, "grid": [132, 1, 1],'
                                     f' "block": [128, 1, 1], "est. achieved occupancy %": 6}}}}')
                        lines.append(f'  {{"ph": "f", "id": {correlation}, "pid": 0, "tid": {stream}, "ts":'
                                     f' {gpu:.3f}, "cat": "ac2g", "name": "ac2g", "bp": "e"}}')
                        cpu += 3.5
                        gpu += dur * (0.6 if stream == 8 else 1.0)
                    annotation(stage, stage_start, cpu + 0.5)
                    cpu += 1.0
                annotation(f"layer[{layer}]:{'mla' if layer % 4 == 3 else 'kda'}", layer_start, cpu + 0.5)
                cpu += 1.0
            annotation("decode_step", step_start, cpu + 0.5)
            cpu = max(cpu, gpu) + 50.0
            out.write(("" if first else ",\n") + ",\n".join(lines))
            first = False
        out.write('\n  ],\n  "traceName": "synthetic"\n}\n')


def _stage(stage: str, trace: Path, work: Path) -> dict:
    """Run one measured stage in this process and return its figures."""
    sys.path.insert(0, str(ROOT))
    start = time.perf_counter()
    if stage == "import":
        from profiler.readers import read_trace

        read_trace(trace).save(work / "run.kprof")
        extra = {"kprof_mb": round((work / "run.kprof").stat().st_size / 2**20, 1)}
    elif stage == "analyze":
        from analyzers.layers import analyze
        from analyzers.trace import Trace

        result = analyze(Trace.load(work / "run.kprof"))
        extra = {"layers": len(result["layers"]), "steps": result["steps"]}
    elif stage == "analyze-json":
        from analyzers.layers import analyze
        from profiler.readers import read_trace

        result = analyze(read_trace(trace))
        extra = {"layers": len(result["layers"]), "unattributed": result["unattributed_kernels"]}
    elif stage == "kprof-breakdown":
        from profiler.readers import read_trace

        kernels = read_trace(trace).kernels
        (kernels["end_ns"] - kernels["start_ns"]).groupby(kernels["name"], observed=True).agg(["sum", "count"])
        extra = {}
    elif stage == "hta-breakdown":
        import logging

        from hta.trace_analysis import TraceAnalysis

        logging.disable(logging.WARNING)
        analysis = TraceAnalysis(trace_dir=str(trace.parent))
        analysis.get_gpu_kernel_breakdown(visualize=False, duration_ratio=1.0, num_kernels=1000)
        extra = {}
    else:
        raise SystemExit(f"unknown stage {stage}")
    seconds = time.perf_counter() - start
    return {"stage": stage, "seconds": round(seconds, 2),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 0), **extra}


def _measure(stage: str, trace: Path, work: Path, timeout: int) -> dict:
    command = [sys.executable, __file__, "--stage", stage, "--trace", str(trace), "--work", str(work)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"stage": stage, "seconds": f">{timeout}", "peak_rss_mb": "?", "note": "timed out"}
    if done.returncode:
        return {"stage": stage, "seconds": "-", "peak_rss_mb": "-", "note": done.stderr.strip().splitlines()[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=1_000_000)
    parser.add_argument("--hta-kernels", type=int, default=100_000, help="HTA runs on a smaller trace (0: skip)")
    parser.add_argument("--hta-timeout", type=int, default=600)
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--trace", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage:
        print(json.dumps(_stage(args.stage, args.trace, args.work)))
        return

    rows = []
    with tempfile.TemporaryDirectory(prefix="kprof-bench-") as tmp:
        tmp = Path(tmp)
        sizes = [(args.kernels, ("import", "analyze", "analyze-json"))]
        if args.hta_kernels:
            sizes.append((args.hta_kernels, ("kprof-breakdown", "hta-breakdown", "import", "analyze")))
        for n, stages in sizes:
            work = tmp / f"n{n}"
            (work / "trace").mkdir(parents=True)
            trace = work / "trace" / "rank0.trace.json"
            start = time.perf_counter()
            generate(trace, n)
            mb = trace.stat().st_size / 2**20
            print(f"generated {n:,} kernels, {mb:,.0f} MiB in {time.perf_counter() - start:.0f} s", file=sys.stderr)
            for stage in stages:
                row = _measure(stage, trace, work, args.hta_timeout if stage.startswith("hta") else 600)
                rows.append({"kernels": n, "trace_mib": round(mb), **row})
                print(json.dumps(rows[-1]), file=sys.stderr)
            os.unlink(trace)

    print("| kernels | trace MiB | stage | seconds | peak RSS MiB | notes |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        notes = ", ".join(f"{k}={v}" for k, v in row.items()
                          if k not in ("kernels", "trace_mib", "stage", "seconds", "peak_rss_mb"))
        print(f"| {row['kernels']:,} | {row['trace_mib']} | {row['stage']} | {row['seconds']} | {row['peak_rss_mb']} | {notes} |")


if __name__ == "__main__":
    main()
