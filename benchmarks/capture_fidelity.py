"""Fidelity of `kprof capture` on the GPU: the four measurements of benchmarks/NOTES.md, as one table.

    python benchmarks/capture_fidelity.py --backend auto --tp 16 --batch 1 --layers 4 --steps 50 --out-dir $OUT

1. Attribution completeness: in CUPTI and torch.profiler captures, kernels of replayed steps outside every layer
   (these must be only what runs outside layers: the step's input copies) and kernels in a layer but no stage.
2. CUPTI vs torch.profiler on the same workload: kernels per layer (must be equal) and kernel µs per layer (within
   5%).
3. Overhead: per-layer GPU time of the same graph replays, timed with CUDA events recorded inside the graph at layer
   boundaries (``torch.cuda.Event(external=True)``), with no recorder. Two comparisons against it (each must be under
   3%): the per-layer time the CUPTI capture reports (the layer's span, first kernel start to last kernel end), and
   the same CUDA-event timing taken while the CUPTI recorder is attached (how much recording slows the replays
   down). The whole replay (events around the graph launch) is shown with and without the recorder as well.
4. Repeatability: two CUPTI captures of the same run, per-layer kernel µs (within 3%).

Each capture runs in its own process, through the same code as `kprof capture` (a process can host one CUPTI
client, and NVTX injection is set before a process starts). The captures are kept in --out-dir.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# -- the timing child: per-layer CUDA-event times of graph replays, with or without the CUPTI recorder ------------------
def timing_child(args: dict) -> dict:
    session = None
    if args["recorder"] == "cupti":
        from profiler.recorders.cupti import CuptiSession

        session = CuptiSession().start()
    import torch

    import kimi_decode.slice as slice_module
    from kimi_decode import DecodeSlice

    events: list = []  # (start, end) per layer, recorded into the graph during capture
    recording = {"on": False}
    inner = slice_module.decode_layer

    def timed_layer(*a, **k):
        if not recording["on"]:
            return inner(*a, **k)
        start = torch.cuda.Event(enable_timing=True, external=True)
        end = torch.cuda.Event(enable_timing=True, external=True)
        start.record()
        out = inner(*a, **k)
        end.record()
        events.append((start, end))
        return out

    slice_module.decode_layer = timed_layer
    s = DecodeSlice(backend=args["backend"], tp=args["tp"], batch=args["batch"], first_layer=args["first_layer"],
                    num_layers=args["layers"], context=args["context"], device="cuda")
    from profiler.recorders import CAPTURE_RANGE
    from profiler.workload import capture_range

    s.capture(warmup=2)
    recording["on"] = True
    with capture_range(CAPTURE_RANGE):
        s.capture(warmup=0)
    recording["on"] = False
    torch.cuda.synchronize()
    per_layer: list[list[float]] = [[] for _ in events]
    step: list[float] = []
    step_start, step_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(args["steps"]):
        step_start.record()
        s.replay()
        step_end.record()
        torch.cuda.synchronize()
        step.append(step_start.elapsed_time(step_end) * 1000.0)
        for i, (start, end) in enumerate(events):
            per_layer[i].append(start.elapsed_time(end) * 1000.0)
    out = {"layer_us": [statistics.median(v) for v in per_layer], "layers": s.layer_ids,
           "step_us": statistics.median(step)}
    if session is not None:
        from analyzers.layers import analyze
        from profiler.recorders import trim_to_capture
        from profiler.recorders.cupti import records_to_trace

        result = analyze(trim_to_capture(records_to_trace(session.stop())))
        out["cupti_span_us"] = {l["layer"]: l["span_us"] for l in result["layers"]}
    return out


def run_timing(args: argparse.Namespace, recorder: str) -> dict:
    from profiler.capture import child_env, cupti_library

    env = child_env({"NVTX_INJECTION64_PATH": cupti_library()} if recorder == "cupti" else None)
    spec = {**vars(args), "recorder": recorder}
    done = subprocess.run([sys.executable, __file__, "--timing-child", json.dumps(spec)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"timing child ({recorder}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- captures through kprof capture's own code -------------------------------------------------------------------------
def capture(args: argparse.Namespace, profiler: str, name: str) -> dict:
    from analyzers.layers import analyze, kernel_layers
    from analyzers.trace import Trace
    from profiler.capture import WorkloadOptions, capture_workload

    path = Path(args.out_dir) / f"{name}.kprof"
    options = WorkloadOptions(backend=args.backend, tp=args.tp, batch=args.batch, layers=args.layers,
                              first_layer=args.first_layer, context=args.context, steps=args.steps)
    capture_workload(options, profiler, path, f"benchmarks/capture_fidelity.py ({profiler})")
    trace = Trace.load(path)
    kernels = kernel_layers(trace)
    stepped = kernels[kernels["step"] >= 0]
    result = analyze(trace)
    return {
        "path": str(path),
        "layers": {l["layer"]: l for l in result["layers"]},
        "outside_layers": int((stepped["layer"] < 0).sum()),
        "no_stage": int(((stepped["layer"] >= 0) & (stepped["stage"] == "")).sum()),
        "no_step": int((kernels["step"] < 0).sum()),
        "steps": result["steps"],
        "mapping": trace.meta.get("graph_mapping", ""),
    }


def pct(a: float, b: float) -> float:
    return 100.0 * (a - b) / b if b else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--tp", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--first-layer", type=int, default=1)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "runs"))
    parser.add_argument("--timing-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.timing_child:
        print(json.dumps(timing_child(json.loads(args.timing_child))))
        return 0
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)

    a = capture(args, "cupti", f"fidelity_{args.backend}_tp{args.tp}_cupti_a")
    b = capture(args, "cupti", f"fidelity_{args.backend}_tp{args.tp}_cupti_b")
    t = capture(args, "torch", f"fidelity_{args.backend}_tp{args.tp}_torch")
    plain = run_timing(args, "none")
    recorded = run_timing(args, "cupti")

    print(f"# kprof capture fidelity: backend {args.backend}, TP{args.tp}, batch {args.batch}, "
          f"{args.layers} layers, context {args.context}, {args.steps} steps")
    print("\n## 1. attribution (kernels of replayed steps)")
    print(f"{'capture':<10}{'steps':>6}{'outside layers/step':>21}{'in layer, no stage':>20}{'no step':>9}  mapping")
    for name, c in (("cupti A", a), ("cupti B", b), ("torch", t)):
        print(f"{name:<10}{c['steps']:>6}{c['outside_layers'] / max(c['steps'], 1):>21.1f}{c['no_stage']:>20}"
              f"{c['no_step']:>9}  {c['mapping']}")

    print("\n## 2-4. per layer (medians over steps)")
    print(f"{'layer':<8}{'kern cupti':>11}{'kern torch':>11}{'µs cupti':>10}{'µs torch':>10}{'Δ%':>7}"
          f"{'µs cupti B':>11}{'Δ% A/B':>8}{'event µs':>10}{'+cupti µs':>10}{'Δ%':>7}{'span µs':>9}{'Δ%':>7}")
    worst = {"count": 0, "torch": 0.0, "repeat": 0.0, "overhead": 0.0, "reported": 0.0}
    for i, layer in enumerate(sorted(a["layers"])):
        la, lb, lt = a["layers"][layer], b["layers"].get(layer, {}), t["layers"].get(layer, {})
        d_torch = pct(la["kernel_us"], lt.get("kernel_us", float("nan")))
        d_rep = pct(lb.get("kernel_us", float("nan")), la["kernel_us"])
        ev = plain["layer_us"][i] if i < len(plain["layer_us"]) else float("nan")
        ev_rec = recorded["layer_us"][i] if i < len(recorded["layer_us"]) else float("nan")
        d_over = pct(ev_rec, ev)
        span = recorded.get("cupti_span_us", {}).get(str(layer), recorded.get("cupti_span_us", {}).get(layer))
        worst["count"] += int(la["kernels_per_step"] != lt.get("kernels_per_step"))
        worst["torch"] = max(worst["torch"], abs(d_torch))
        worst["repeat"] = max(worst["repeat"], abs(d_rep))
        worst["overhead"] = max(worst["overhead"], abs(d_over))
        d_span = pct(span, ev) if span is not None else float("nan")
        if span is not None:
            worst["reported"] = max(worst["reported"], abs(d_span))
        print(f"{layer:<8}{la['kernels_per_step']:>11g}{lt.get('kernels_per_step', float('nan')):>11g}"
              f"{la['kernel_us']:>10.1f}{lt.get('kernel_us', float('nan')):>10.1f}{d_torch:>7.1f}"
              f"{lb.get('kernel_us', float('nan')):>11.1f}{d_rep:>8.1f}{ev:>10.1f}{ev_rec:>10.1f}{d_over:>7.1f}"
              f"{span if span is not None else float('nan'):>9.1f}"
              f"{d_span:>7.1f}")
    print(f"\nlayers whose kernel count differs (cupti vs torch): {worst['count']} (target 0)")
    print(f"largest |Δ| kernel µs cupti vs torch: {worst['torch']:.2f}% (target < 5%)")
    print(f"largest |Δ| per-layer time reported by the CUPTI capture (span) vs the uncaptured event time: "
          f"{worst['reported']:.2f}% (target < 3%)")
    print(f"largest |Δ| per-layer event time, CUPTI attached vs not: {worst['overhead']:.2f}% (target < 3%)")
    print(f"whole replay (events around the graph launch): {plain['step_us']:.1f} µs without a recorder, "
          f"{recorded['step_us']:.1f} µs with CUPTI attached ({pct(recorded['step_us'], plain['step_us']):+.2f}%)")
    print(f"largest |Δ| kernel µs between two CUPTI captures: {worst['repeat']:.2f}% (target < 3%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
