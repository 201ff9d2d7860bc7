"""On a torch.profiler trace, kprof's per-kernel-name totals equal HolisticTraceAnalysis's kernel breakdown."""
from __future__ import annotations

import json
import logging
import random

import pytest

from profiler.readers import read_trace

hta_analysis = pytest.importorskip("hta.trace_analysis")
pytestmark = pytest.mark.filterwarnings("ignore:The inplace keyword:Warning")  # raised inside HTA

NAMES = ["ampere_bf16_gemm", "rmsnorm_kernel", "ncclDevKernel_AllReduce_Sum_bf16", "triton_poi_fused_add_0"]


def _write_trace(path, seed: int) -> None:
    rng = random.Random(seed)
    events, ts = [], 5105233697250.768
    for correlation in range(1, 200):
        dur = round(rng.uniform(0.5, 40.0), 3)
        stream = rng.choice([7, 8])
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 9, "tid": 9,
                       "ts": ts, "dur": 2.0, "args": {"correlation": correlation}})
        events.append({"ph": "X", "cat": "kernel", "name": rng.choice(NAMES), "pid": 0, "tid": stream, "ts": ts + 3,
                       "dur": dur, "args": {"device": 0, "stream": stream, "correlation": correlation}})
        ts += rng.choice([1.0, dur + 1.0])
    path.write_text(json.dumps({"distributedInfo": {"rank": 0}, "traceEvents": events}))


def _hta_totals(trace_dir) -> dict[str, float]:
    logging.getLogger("hta").setLevel(logging.ERROR)
    analysis = hta_analysis.TraceAnalysis(trace_dir=str(trace_dir))
    _, kernels = analysis.get_gpu_kernel_breakdown(visualize=False, duration_ratio=1.0, num_kernels=10_000)
    return dict(zip(kernels["name"], kernels["sum (us)"].astype(float)))


def _kprof_totals(path) -> tuple[dict[str, float], dict[str, int]]:
    kernels = read_trace(path).kernels
    kernels = kernels[kernels["kind"] == "kernel"]
    grouped = (kernels["end_ns"] - kernels["start_ns"]).groupby(kernels["name"].astype(str))
    return (grouped.sum() / 1000.0).to_dict(), grouped.size().to_dict()


def test_per_kernel_name_totals_equal_hta(tmp_path, monkeypatch):
    # HTA_DISABLE_NS_ROUNDING keeps HTA on Kineto's exact (nanosecond-resolution) times, as kprof is.
    monkeypatch.setenv("HTA_DISABLE_NS_ROUNDING", "1")
    _write_trace(tmp_path / "rank0.trace.json", seed=1)
    ours, _ = _kprof_totals(tmp_path / "rank0.trace.json")
    assert set(ours) == set(NAMES)
    assert ours == pytest.approx(_hta_totals(tmp_path), abs=1e-6)


def test_per_kernel_name_totals_match_hta_within_its_default_rounding(tmp_path):
    # By default HTA moves each event's start up and its end down to whole microseconds, so each kernel loses
    # less than 2 µs there; kprof keeps nanoseconds.
    _write_trace(tmp_path / "rank0.trace.json", seed=2)
    ours, counts = _kprof_totals(tmp_path / "rank0.trace.json")
    theirs = _hta_totals(tmp_path)
    assert set(ours) == set(theirs)
    for name, total in ours.items():
        assert 0 <= total - theirs[name] < 2 * counts[name]
