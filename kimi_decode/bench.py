"""Per-layer decode benchmark: `python -m kimi_decode.bench --backend auto --tp 16 8 --batch 1 8 64`.

For every (backend, tp, batch) it builds `--copies` slices with different weights (so consecutive replays of a layer
read weights L2 no longer holds) and times CUDA-graph replays with CUDA events, rotating the copies. It prints, per
layer: median GPU microseconds, kernels launched (counted in a profiled replay), the bytes the layer must move
(weights actually read, recurrent/conv state read and written, KV cache read), and the share of the HBM floor,
bytes / 4.3 TB/s, that the measured time reaches. Every backend runs in the same process.

Each layer is timed two ways:
- `us`: the layer recorded as a CUDA graph of its own and replayed alone. Its first kernel starts only after the
  graph before it has ended, and the graph's launch is inside the time.
- `in-step us`: what the layer adds to the whole step's graph, where it runs in production: the median time of a
  graph of the step's input copy and its first n layers, minus that of the first n - 1 (the input copy alone for
  the first layer). Inside one graph a layer's first kernel may start while the layer before it ends (programmatic
  dependent launch), and no graph launch falls between layers; the in-step times and the input copy add up to the
  whole step.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys

import torch

from .model import decode_layer
from .backends import BACKENDS, backend_class
from .config import shard as make_shard
from .slice import MAX_BATCH, DecodeSlice, check_slice
from .state import KDAState, MLACache
from .weights import DenseMLPWeights, LayerWeights, MoEWeights

HBM_BYTES_PER_S = 4.3e12


def expert_stage_bytes(w: MoEWeights, used_inter: int, group: int = 32) -> tuple[int, int]:
    """MXFP4 bytes (codes and scales) of one expert's slice that each stage's math needs, (w1 and w3, w2): padding
    rows excluded."""
    latent = w.w2.shape[1]
    per_row = latent // 2 + latent // group  # a w1/w3 row over the latent width
    return 2 * used_inter * per_row, latent * (used_inter // 2 + used_inter // group)


def expert_bytes(w: MoEWeights, used_inter: int, group: int = 32) -> int:
    """MXFP4 bytes (codes and scales) of one expert's slice that the math needs: padding rows excluded."""
    return sum(expert_stage_bytes(w, used_inter, group))


def layer_bytes(lw: LayerWeights, state, routes: torch.Tensor | None, batch: int, used_inter: int,
                n_blocks: int) -> dict[str, int]:
    """The fewest bytes one decode step of this layer moves through HBM."""
    hidden = lw.attn_res.query.numel()
    weights = lw.attn_res.nbytes() + lw.mlp_res.nbytes() + lw.attn.nbytes()
    if isinstance(lw.mlp, DenseMLPWeights):
        weights += lw.mlp.nbytes()
    else:
        w = lw.mlp
        dense = sum(t.numel() * t.element_size() for name, t in w.tensors() if not name.startswith("w"))
        distinct = int(routes.unique().numel()) if routes is not None else 0
        weights += dense + distinct * expert_bytes(w, used_inter)
    # residual candidates, read by both AttnRes mixes
    state_bytes = 2 * batch * (n_blocks + 1) * hidden * 4
    if isinstance(state, KDAState):
        state_bytes += 2 * state.nbytes()  # read and written
    elif isinstance(state, MLACache):
        tokens = int(state.lengths.sum().item())
        state_bytes += tokens * state.kv.shape[2] * state.kv.element_size()
    return {"weight_bytes": weights, "state_bytes": state_bytes}


def _count_kernels(graph: torch.cuda.CUDAGraph) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(1 for n in names if not n.startswith(("Memcpy", "Memset")))


def step_layer_us(prefix_us: list[float]) -> list[float]:
    """Each layer's in-step microseconds from the median times of the step's prefix graphs: prefix_us[n] is the
    input copy followed by the first n layers (n = 0 .. L, the last the whole step); layer n's time is what its
    prefix adds to the one before."""
    if len(prefix_us) < 2:
        raise ValueError("in-step layer times need the input copy's time and at least one layer's prefix")
    return [b - a for a, b in zip(prefix_us, prefix_us[1:])]


class _Captured:
    """One slice with one CUDA graph per layer, and one per prefix of its step: the input copy followed by the
    first n layers, n = 0 .. L (the last one the whole step)."""

    def __init__(self, sl: DecodeSlice):
        self.sl = sl
        sl.capture()  # warm-up and the whole-step graph
        self.step_graph = sl.graph
        self.prefix_graphs = []
        for n in range(len(sl.layers)):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                sl.step(layers=n)
            self.prefix_graphs.append(g)
        self.prefix_graphs.append(self.step_graph)
        self.layer_graphs = []
        sl.res.partial_empty = sl.input.partial_empty
        for lw, st in zip(sl.layers, sl.states):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                decode_layer(sl.backend, lw, sl.res, st, sl.shard, sl.group)
            self.layer_graphs.append(g)


def _median_us(rounds: list[list[torch.cuda.CUDAGraph]]) -> list[float]:
    """Each round's graphs replayed back to back, a CUDA event before each and after the last; per position in the
    round, the median over rounds of the microseconds between its events."""
    marks = [[torch.cuda.Event(enable_timing=True) for _ in range(len(graphs) + 1)] for graphs in rounds]
    for graphs, ev in zip(rounds, marks):
        for e, g in zip(ev, graphs):
            e.record()
            g.replay()
        ev[-1].record()
    torch.cuda.synchronize()
    return [statistics.median(ev[i].elapsed_time(ev[i + 1]) * 1e3 for ev in marks) for i in range(len(rounds[0]))]


def bench_config(backend: str, tp: int, batch: int, args, group=None, rank: int = 0) -> dict:
    """Time one (backend, tp, batch); with a torch.distributed `group`, this process is rank `rank` of a
    tensor-parallel run and every rank must call this with the same arguments (graphs hold collectives)."""
    copies = [
        _Captured(DecodeSlice(backend=backend, tp=tp, rank=rank, batch=batch, first_layer=args.first_layer,
                              num_layers=args.layers, context=args.context, seed=args.seed + c, device="cuda",
                              group=group))
        for c in range(args.copies)
    ]
    n_layers = len(copies[0].layer_graphs)
    for _ in range(args.warmup):
        for cap in copies:
            for g in cap.layer_graphs + cap.prefix_graphs:
                g.replay()
    layer_us = _median_us([copies[r % len(copies)].layer_graphs for r in range(args.replays)])
    # the step's prefixes, shortest first in every round; each replay takes the next copy, so that no graph finds
    # the weights of the one before it in L2
    k = n_layers + 1
    prefix_us = _median_us([[copies[(r * k + n) % len(copies)].prefix_graphs[n] for n in range(k)]
                            for r in range(args.replays)])
    in_step_us = step_layer_us(prefix_us)
    step_us = prefix_us[-1]

    cap = copies[0]
    sl = cap.sl
    rows = []
    for i, (lw, st, g) in enumerate(zip(sl.layers, sl.states, cap.layer_graphs)):
        routes = sl.backend.last_routes.get(lw.index)
        nbytes = layer_bytes(lw, st, routes, batch, sl.shard.expert_inter_used,
                             sl.shard.model.completed_blocks(lw.index))
        total = nbytes["weight_bytes"] + nbytes["state_bytes"]
        floor_us = total / HBM_BYTES_PER_S * 1e6
        rows.append({
            "backend": backend, "tp": tp, "batch": batch, "layer": lw.index, "kind": lw.kind,
            "us": round(layer_us[i], 2), "kernels": _count_kernels(g), **nbytes,
            "floor_us": round(floor_us, 2), "pct_floor": round(100 * floor_us / layer_us[i], 1),
            "in_step_us": round(in_step_us[i], 2), "pct_floor_in_step": round(100 * floor_us / in_step_us[i], 1),
        })
    del copies
    gc.collect()  # whatever a backend holds in reference cycles goes before the next configuration's slices
    torch.cuda.empty_cache()
    return {"rows": rows, "step_us": round(step_us, 2), "copy_us": round(prefix_us[0], 2)}


def _print_table(results: list[dict]) -> None:
    head = (f"{'backend':<20}{'tp':>4}{'batch':>6}{'layer':>7}{'kind':>6}{'us':>10}{'in-step us':>12}{'kernels':>9}"
            f"{'weights MB':>12}{'state MB':>10}{'floor us':>10}{'% floor':>9}{'in-step':>9}")
    print(head)
    print("-" * len(head))
    for res in results:
        for r in res["rows"]:
            print(f"{r['backend']:<20}{r['tp']:>4}{r['batch']:>6}{r['layer']:>7}{r['kind']:>6}{r['us']:>10.1f}"
                  f"{r['in_step_us']:>12.1f}{r['kernels']:>9}{r['weight_bytes'] / 1e6:>12.1f}"
                  f"{r['state_bytes'] / 1e6:>10.2f}{r['floor_us']:>10.1f}{r['pct_floor']:>9.1f}"
                  f"{r['pct_floor_in_step']:>9.1f}")
        r0 = res["rows"][0]
        print(f"{'':<20}{r0['tp']:>4}{r0['batch']:>6}   whole step (one graph, {len(res['rows'])} layers): "
              f"{res['step_us']:.1f} us, of which the input copy {res['copy_us']:.1f}")
    by = {}
    for res in results:
        for r in res["rows"]:
            by.setdefault((r["tp"], r["batch"], r["layer"]), {})[r["backend"]] = (r["us"], r["in_step_us"])
    ratios = [(k, v) for k, v in by.items() if "auto" in v and len(v) > 1]
    if ratios:
        print("\nspeed-up over auto (us_auto / us_backend: alone, in the step)")
        for (tp, batch, layer), v in ratios:
            base = v["auto"]
            others = ", ".join(f"{b} {base[0] / us[0]:.2f}x, {base[1] / us[1]:.2f}x" for b, us in v.items()
                               if b != "auto")
            print(f"  tp {tp} batch {batch} layer {layer}: {others}")


def check_args(args, tps) -> None:
    """ValueError with the first reason a requested configuration cannot run, found before anything is built or
    timed: a bad value late in a list would otherwise end the run after the configurations before it had taken their
    minutes, with nothing printed."""
    for name in args.backend:
        backend_class(name)
    for what in ("copies", "replays", "context"):
        if getattr(args, what) < 1:
            raise ValueError(f"--{what} {getattr(args, what)}: at least 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup}: at least 0")
    for tp in tps:
        shard = make_shard("k3", tp=tp)
        for batch in args.batch:
            check_slice(shard, batch, args.first_layer, args.layers)


def add_run_args(p: argparse.ArgumentParser, backends: list[str], copies: int, replays: int, warmup: int) -> None:
    """The options `python -m kimi_decode.bench` and `kimi_decode.dist_bench` share, with these defaults."""
    p.add_argument("--backend", nargs="+", default=backends, metavar="NAME",
                   help=f"backends to time, in one process: {', '.join(sorted(BACKENDS))}")
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8, 64], metavar="N",
                   help=f"sequences decoded per step, 1 to {MAX_BATCH}")
    p.add_argument("--first-layer", type=int, default=1, help="index of the slice's first layer")
    p.add_argument("--layers", type=int, default=4, help="consecutive layers in the slice")
    p.add_argument("--context", type=int, default=8192, help="tokens in the MLA layers' caches")
    p.add_argument("--copies", type=int, default=copies,
                   help="slices with their own weights, rotated between replays (cold L2)")
    p.add_argument("--replays", type=int, default=replays, help="CUDA-graph replays per measurement (median)")
    p.add_argument("--warmup", type=int, default=warmup, help="replays of every graph before timing")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and states")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kimi_decode.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tp", nargs="+", type=int, default=[16, 8], metavar="N",
                   help="tensor-parallel shards to time (one rank of each)")
    add_run_args(p, ["auto"], copies=3, replays=200, warmup=10)
    p.add_argument("--json", help="also write every row to this JSON file, rewritten after each configuration "
                   "(meta.complete: true once every configuration ran)")
    args = p.parse_args(argv)
    try:
        check_args(args, args.tp)
    except ValueError as exc:
        print(f"kimi_decode.bench: error: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("kimi_decode.bench: error: needs a CUDA device", file=sys.stderr)
        return 2
    results = []
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args)}

    def save(complete: bool) -> int:
        """--json rewritten after every configuration (`complete` false until the last): a run stopped by a time
        limit or out of memory keeps what it timed."""
        if not args.json:
            return 0
        return write_json(args.json, {"meta": {**meta, "complete": complete}, "results": results}, "kimi_decode.bench")

    try:
        for tp in args.tp:
            for batch in args.batch:
                for backend in args.backend:
                    results.append(bench_config(backend, tp, batch, args))
                    if save(False):
                        return 1
    except ValueError as exc:
        print(f"kimi_decode.bench: error: {exc}", file=sys.stderr)
        return 2
    except torch.cuda.OutOfMemoryError:
        if results:
            _print_table(results)
        kept = f"; the {len(results)} before it are in {args.json}" if args.json and results else ""
        print(f"kimi_decode.bench: error: out of GPU memory at {backend} tp {tp} batch {batch}{kept}", file=sys.stderr)
        return 1
    _print_table(results)
    return save(True)


def write_json(path: str, payload: dict, prog: str) -> int:
    """Writes `payload` to `path` whole or not at all; 0, or 1 after a one-line error naming `prog`."""
    from analyzers.trace import atomic_output

    try:
        with atomic_output(path) as f:
            f.write(json.dumps(payload, indent=1).encode())
    except OSError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
