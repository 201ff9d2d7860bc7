"""Tensor parallelism over the GPUs of one node: `python -m kimi_decode.dist_bench --world 2 --batch 1 8 64`.

One process per GPU (rank r on cuda:r), an NCCL group, and each rank running its TP=world shard of the decode slice
with the three all-reduces per layer inside the CUDA graphs. Per (backend, batch) it prints rank 0's per-layer table
of `kimi_decode.bench` (every rank replays the same graphs in lockstep; a layer's time includes waiting for the
slowest rank) and the all-reduce latency of the payloads one layer reduces. With `--trace-dir`, each rank also
records a torch.profiler (Kineto) trace of graph replays at batch 1 for every backend, kept as JSON for
HolisticTraceAnalysis and converted to a `.kprof` per rank (`BACKEND_tpN_b1.rankR.kprof`).

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1). A rank
that fails or hangs makes the others fail within `--timeout` seconds: the parent stops every rank as soon as one
exits with an error, and NCCL's watchdog ends a collective that waits longer than the group's timeout.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world: int, port: int, timeout_s: float, device_type: str = "cuda"):
    """The process group of this rank: NCCL on cuda:rank with multicast off, or gloo for ``device_type`` "cpu".
    -> the group."""
    import torch
    import torch.distributed as dist

    init = dict(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                timeout=timedelta(seconds=timeout_s))
    if device_type == "cpu":
        dist.init_process_group("gloo", **init)
        return dist.group.WORLD
    os.environ.update(NO_MULTICAST)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank), **init)
    return dist.group.WORLD


def allreduce_latency(group, batch: int, hidden: int, latent: int, replays: int = 200) -> dict:
    """Median µs of one all-reduce of each payload a layer reduces, replayed from a CUDA graph."""
    import torch
    import torch.distributed as dist

    out = {}
    for name, shape, dtype in (("attn_out bf16", (batch, hidden), torch.bfloat16),
                               ("routed fp32", (batch, latent), torch.float32),
                               ("shared bf16", (batch, hidden), torch.bfloat16)):
        t = torch.ones(shape, dtype=dtype, device="cuda")
        dist.all_reduce(t, group=group)  # warm the communicator outside the graph
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            dist.all_reduce(t, group=group)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
        for a, b in events:
            a.record()
            g.replay()
            b.record()
        torch.cuda.synchronize()
        out[name] = round(statistics.median(a.elapsed_time(b) * 1e3 for a, b in events), 2)
    return out


def trace_rank(backend: str, world: int, rank: int, group, args, trace_dir: Path) -> dict:
    """torch.profiler trace of `args.trace_steps` graph replays at batch 1 -> JSON (for HTA) and .kprof."""
    import torch

    from kimi_decode import DecodeSlice
    from profiler.readers import read_kineto_json
    from profiler.recorders import CAPTURE_RANGE, trim_to_capture
    from profiler.recorders.torch_profiler import map_graph_replays, profile
    from profiler.workload import capture_range

    sl = DecodeSlice(backend=backend, tp=world, rank=rank, batch=1, first_layer=args.first_layer,
                     num_layers=args.layers, context=args.context, seed=args.seed, device="cuda", group=group)
    sl.capture(warmup=2)
    torch.cuda.synchronize()
    prof = profile()
    prof.__enter__()
    with capture_range(CAPTURE_RANGE):
        sl.capture(warmup=0)
    torch.cuda.synchronize()
    for _ in range(args.trace_steps):
        sl.replay()
        prof.step()  # ProfilerStep#N ranges: HolisticTraceAnalysis's iterations
    torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    stem = trace_dir / f"{backend}_tp{world}_b1"
    json_path = Path(f"{stem}.rank{rank}.json")
    prof.export_chrome_trace(str(json_path))
    trace = read_kineto_json(json_path)
    trace.meta = {**trace.meta, "backend": backend, "tp": world, "world": world, "rank": rank, "batch": 1,
                  "layers": args.layers, "context": args.context, "gpu": torch.cuda.get_device_name(),
                  "torch": torch.__version__, "source": "kineto_json"}
    trace = trim_to_capture(map_graph_replays(trace))
    kprof = Path(f"{stem}.rank{rank}.kprof")
    trace.save(kprof)
    return {"json": str(json_path), "kprof": str(kprof), "graph_mapping": trace.meta.get("graph_mapping")}


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    try:
        group = init_rank(rank, world, port, args.timeout)
        import torch

        from kimi_decode.bench import bench_config
        from kimi_decode.config import shard as make_shard

        m = make_shard("k3", tp=world, rank=rank).model
        result = {"rank": rank, "world": world, "gpu": torch.cuda.get_device_name(), "configs": [],
                  "allreduce_us": {}, "traces": []}
        for batch in args.batch:
            result["allreduce_us"][batch] = allreduce_latency(group, batch, m.hidden, m.moe_latent)
            for backend in args.backend:
                result["configs"].append(bench_config(backend, world, batch, args, group=group, rank=rank))
        if args.trace_dir:
            trace_dir = Path(args.trace_dir)
            trace_dir.mkdir(parents=True, exist_ok=True)
            for backend in args.backend:
                result["traces"].append(trace_rank(backend, world, rank, group, args, trace_dir))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        torch.distributed.destroy_process_group()
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_ranks(target, world: int, extra: tuple, out_dir: str, deadline_s: float) -> list[int]:
    """Start `world` ranks of `target(rank, world, port, *extra, out_dir)`; stop them all as soon as one fails.
    -> exit codes (None for a rank stopped by the parent)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *extra, out_dir)) for r in range(world)]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    failed = False
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() - t0 > deadline_s:
            failed = True
            break
        time.sleep(0.05)
    if failed:
        for p in procs:
            if p.is_alive():
                p.kill()
    for p in procs:
        p.join()
    return [p.exitcode for p in procs]


def main(argv=None) -> int:
    from kimi_decode.bench import _print_table, add_run_args, check_args, write_json

    p = argparse.ArgumentParser(prog="python -m kimi_decode.dist_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="GPUs = ranks = tensor-parallel size")
    add_run_args(p, ["auto", "latency_specialized"], copies=2, replays=100, warmup=5)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait for a peer")
    p.add_argument("--deadline", type=float, default=540.0, help="seconds for the whole run")
    p.add_argument("--trace-dir", help="also record per-rank Kineto traces and .kprof captures here")
    p.add_argument("--trace-steps", type=int, default=20, help="decode steps in each trace")
    p.add_argument("--json", help="write every rank's results to this JSON file")
    args = p.parse_args(argv)
    try:
        check_args(args, [args.world])
    except ValueError as exc:
        print(f"kimi_decode.dist_bench: error: {exc}", file=sys.stderr)
        return 2
    import torch

    if torch.cuda.device_count() < args.world:
        print(f"kimi_decode.dist_bench: error: --world {args.world} needs {args.world} GPUs, "
              f"{torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kimi-dist-") as out_dir:
        codes = run_ranks(worker, args.world, (args,), out_dir, args.deadline)
        errors = sorted(Path(out_dir).glob("rank*.err"))
        if errors or any(c != 0 for c in codes):
            detail = errors[0].read_text().strip().splitlines()[-1] if errors else f"exit codes {codes}"
            print(f"kimi_decode.dist_bench: error: {errors[0].stem if errors else 'a rank'} failed: {detail}",
                  file=sys.stderr)
            return 1
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(args.world)]
    _print_table(ranks[0]["configs"])
    print("\nall-reduce latency, µs (median of graph replays, rank 0 / slowest rank)")
    for batch, lat in ranks[0]["allreduce_us"].items():
        worst = {k: max(r["allreduce_us"][batch][k] for r in ranks) for k in lat}
        print(f"  batch {batch}: " + ", ".join(f"{k} {v:.1f} / {worst[k]:.1f}" for k, v in lat.items()))
    for r in ranks:
        for t in r["traces"]:
            print(f"rank {r['rank']}: {t['kprof']} ({t['graph_mapping']})")
    if args.json:
        return write_json(args.json, {"args": vars(args), "ranks": ranks}, "kimi_decode.dist_bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
