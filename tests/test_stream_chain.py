"""benchmarks/stream_chain.py on the CPU: its read plans cover the bytes asked for, its stages add up to the layer's
floor as `kimi_decode.bench` counts it, and its kernel compiles for sm_90a in each form."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import stream_chain as sc  # noqa: E402


@pytest.mark.parametrize("nbytes", [1, 100_000, 11_700_000, 46_100_000, 208_000_000])
def test_plan_covers_the_bytes_within_one_iteration_of_the_grid(nbytes):
    ctas, iters = sc.plan(nbytes, 132)
    per_iter = sc.THREADS * sc.UNROLL * 16
    read = ctas * iters * per_iter
    assert read >= nbytes
    assert read - nbytes < iters * per_iter  # at most one CTA-iteration per iteration over the floor
    assert ctas <= 132 * sc.CTAS_PER_SM


@pytest.mark.parametrize("tp, batch, floor_mb", [(16, 1, 208.1), (8, 1, 298.3)])
def test_stages_add_up_to_the_benchmarks_layer_bytes(tp, batch, floor_mb):
    """Weight plus state bytes of layer 1 at batch 1 as `kimi_decode.bench` reported them on the H200 (NOTES, v19):
    TP16 207.2 + 0.93 MB, TP8 296.6 + 1.74 MB; the stand-in stages are within 0.5% of that."""
    total = sum(n for _, n in sc.stages(tp, batch)) / 1e6
    assert abs(total - floor_mb) / floor_mb < 5e-3


def test_distinct_experts_grow_with_the_batch():
    assert sc.distinct_experts(1) == 16
    assert sc.distinct_experts(2) < sc.distinct_experts(4) < sc.distinct_experts(32) <= 896


cute_common = pytest.importorskip("kimi_decode.kernels.cute_common")


@pytest.mark.skipif(not cute_common.HAVE_CUTE, reason="nvidia-cutlass-dsl is not installed")
@pytest.mark.parametrize("mode", [*sc.MODES[1:], "pdl-first1", "pdl-first9"])
@pytest.mark.parametrize("trigger", sc.TRIGGERS)
def test_stream_read_compiles_for_sm90a(monkeypatch, mode, trigger):
    monkeypatch.setenv("KIMI_DECODE_CUTE_ARCH", "sm_90a")
    for nbytes in (46_100_000, 11_700_000):  # 3 iterations (pdl-first1: reads before and after the wait), then 1
        ctas, iters = sc.plan(nbytes, 132)
        data = torch.empty(ctas * iters * sc.THREADS * sc.UNROLL, 4, dtype=torch.int32)
        out = torch.empty(ctas * sc.THREADS, dtype=torch.int32)
        assert sc.compile_read(data, out, ctas, iters, mode, trigger) is not None
    with pytest.raises(ValueError, match="data must be"):
        sc.compile_read(data[1:], out, ctas, iters, mode)
    for bad in ("fused", "pdl-first0", "pdl-firstx"):
        with pytest.raises(ValueError, match="mode must be"):
            sc.compile_read(data, out, ctas, iters, bad, trigger)
    with pytest.raises(ValueError, match="trigger must be"):
        sc.compile_read(data, out, ctas, iters, mode, "end")


@pytest.mark.skipif(not cute_common.HAVE_CUTE, reason="nvidia-cutlass-dsl is not installed")
@pytest.mark.parametrize("handover", sc.HANDOVERS)
@pytest.mark.parametrize("early", [[0] * 8, [1] * 8, [1, 1, 1, 1, 1, 0, 1, 1]])
def test_one_grid_chain_compiles_for_sm90a(monkeypatch, early, handover):
    """The layer's 8 stand-in stages as one ticketed grid, each CTA's first iteration before its wait or none."""
    monkeypatch.setenv("KIMI_DECODE_CUTE_ARCH", "sm_90a")
    plans = [sc.plan(n, 132) for _, n in sc.stages(16, 1)]
    op = sc.TicketChain(plans, early)
    assert op.ctas == sum(c for c, _ in plans)
    assert op.vectors * 16 >= sum(n for _, n in sc.stages(16, 1))
    data = torch.empty(op.vectors, 4, dtype=torch.int32)
    out = torch.empty(op.ctas * sc.THREADS, dtype=torch.int32)
    counters = torch.zeros(sc.counter_words(len(plans)), dtype=torch.int32)
    assert sc.compile_grid(data, out, counters, plans, early, handover) is not None
    with pytest.raises(ValueError, match="counters"):
        sc.compile_grid(data, out, counters[1:], plans, early, handover)
    with pytest.raises(ValueError, match="handover must be"):
        sc.compile_grid(data, out, counters, plans, early, "barrier")


def test_expected_xor_follows_the_read_order():
    """Thread (cta, t) of a stage reads vectors it * (ctas * T * U) + cta * (T * U) + u * T + t: flipping one word of
    one such vector changes that thread's expected value and no other."""
    plans = [(2, 3), (1, 1)]
    n = sum(c * i for c, i in plans) * sc.THREADS * sc.UNROLL
    data = torch.randint(-2**31, 2**31 - 1, (n, 4), dtype=torch.int32)
    base = sc.expected_xor(data, plans)
    assert base.shape == (3 * sc.THREADS,)
    it, cta, u, t = 2, 1, 5, 7
    data[it * (2 * sc.THREADS * sc.UNROLL) + cta * (sc.THREADS * sc.UNROLL) + u * sc.THREADS + t, 3] ^= 1
    changed = (sc.expected_xor(data, plans) != base).nonzero().flatten().tolist()
    assert changed == [cta * sc.THREADS + t]
