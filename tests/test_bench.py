"""`python -m kimi_decode.bench`: the in-step layer times from the step's prefix graphs, the table it prints, and on
a GPU the prefix graphs themselves."""
import argparse
import json

import pytest
import torch

from kimi_decode import DecodeSlice
from kimi_decode.bench import _print_table, step_layer_us


def test_a_step_of_the_first_layers_runs_only_those():
    """`step(layers=n)` copies the input in and advances the first n layers' states, and leaves the others alone;
    the residual state it leaves is the one a slice of just those layers leaves."""
    sl = DecodeSlice(model="tiny", tp=1, batch=2, first_layer=1, num_layers=4, context=16, device="cpu", seed=3)
    before = [st.clone() for st in sl.states]
    sl.step(layers=2)
    for i, (b, st) in enumerate(zip(before, sl.states)):
        moved = any(not torch.equal(t, getattr(b, name)) for name, t in st.tensors())
        assert moved == (i < 2), i
    short = DecodeSlice(model="tiny", tp=1, batch=2, first_layer=1, num_layers=2, context=16, device="cpu", seed=3)
    short.step()
    for mine, theirs in ((sl.res.partial, short.res.partial), (sl.res.blocks, short.res.blocks)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True)  # blocks not yet written are NaN

    sl.res.partial.fill_(float("nan"))
    before = [st.clone() for st in sl.states]
    sl.step(layers=0)  # the input copy alone
    assert torch.equal(sl.res.partial, sl.input.partial)
    assert all(torch.equal(t, getattr(b, name)) for b, st in zip(before, sl.states) for name, t in st.tensors())


@pytest.mark.parametrize("layers", [-1, 5])
def test_a_step_of_more_layers_than_the_slice_has_is_refused(layers):
    sl = DecodeSlice(model="tiny", tp=1, batch=1, first_layer=1, num_layers=4, context=8, device="cpu")
    with pytest.raises(ValueError, match="the slice has 4"):
        sl.step(layers=layers)


def test_in_step_layer_times_are_what_each_prefix_adds():
    assert step_layer_us([4.0, 75.5, 146.0, 300.0]) == [71.5, 70.5, 154.0]
    with pytest.raises(ValueError, match="at least one layer"):
        step_layer_us([4.0])


def test_graph_times_are_the_median_per_position_over_rounds(monkeypatch):
    """`_median_us` on a fake clock: an event records the time, a graph's replay advances it by the graph's
    duration (in ms, as CUDA events measure); per position of the rounds, the median of its graphs' times, in us."""
    from kimi_decode import bench

    clock = [0.0]

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.t = clock[0]

        def elapsed_time(self, other):
            return other.t - self.t

    class Graph:
        def __init__(self, ms):
            self.ms = ms

        def replay(self):
            clock[0] += self.ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    rounds = [[Graph(0.004), Graph(0.070)], [Graph(0.005), Graph(0.072)], [Graph(0.100), Graph(0.071)]]
    assert bench._median_us(rounds) == pytest.approx([5.0, 71.0])


@pytest.mark.parametrize("module, argv, message", [
    ("bench", ["--backend", "auto", "nope"], "unknown backend 'nope'"),
    ("bench", ["--tp", "16", "5"], "do not divide by tp=5"),  # the valid TP16 is not run first
    ("bench", ["--batch", "1", "65"], "batch 65 is outside"),
    ("bench", ["--first-layer", "90"], "layers 90..93 are outside 0..92"),
    ("bench", ["--replays", "0"], "--replays 0"),
    ("bench", ["--copies", "0"], "--copies 0"),
    ("bench", ["--warmup", "-1"], "--warmup -1"),
    ("dist_bench", ["--world", "5"], "do not divide by tp=5"),
    ("dist_bench", ["--batch", "0"], "batch 0 is outside"),
])
def test_a_configuration_that_cannot_run_is_refused_before_anything_runs(module, argv, message, capsys,
                                                                           monkeypatch):
    import importlib

    mod = importlib.import_module(f"kimi_decode.{module}")
    # on a GPU machine too: the check comes before any slice is built or timed
    monkeypatch.setattr(mod, "bench_config", lambda *a, **k: pytest.fail("a configuration ran"), raising=False)
    assert mod.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kimi_decode.{module}: error:") and message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("module, copies", [("bench", 3), ("dist_bench", 2)])
def test_help_says_what_each_option_is_and_its_default(module, copies, capsys):
    import importlib

    with pytest.raises(SystemExit) as done:
        importlib.import_module(f"kimi_decode.{module}").main(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "backends to time, in one process: auto, latency_specialized" in text
    assert f"rotated between replays (cold L2) (default: {copies})" in text
    assert "sequences decoded per step, 1 to 64 (default: [1, 8, 64])" in text


def test_the_json_is_written_whole_or_not_at_all(tmp_path, capsys):
    from kimi_decode.bench import write_json

    path = tmp_path / "out.json"
    assert write_json(str(path), {"results": [1, 2]}, "kimi_decode.bench") == 0
    assert json.loads(path.read_text()) == {"results": [1, 2]}
    missing = tmp_path / "no_such_dir" / "out.json"
    assert write_json(str(missing), {"results": []}, "kimi_decode.bench") == 1
    err = capsys.readouterr().err
    assert err.startswith("kimi_decode.bench: error:") and len(err.splitlines()) == 1
    with pytest.raises(TypeError):  # not serialisable: the file already there is left as it was
        write_json(str(path), {"results": object()}, "kimi_decode.bench")
    assert json.loads(path.read_text()) == {"results": [1, 2]} and [f.name for f in tmp_path.iterdir()] == ["out.json"]


@pytest.mark.parametrize("fail_at", [None, 3, 1])
def test_the_json_keeps_each_configuration_as_it_is_timed(monkeypatch, tmp_path, capsys, fail_at):
    """--json is rewritten after every configuration: a run that runs out of GPU memory at configuration `fail_at`
    keeps the ones before it (meta.complete false) and ends with a one-line error naming the configuration, exit 1;
    a whole run ends complete."""
    from kimi_decode import bench

    done = []

    def fake_config(backend, tp, batch, args):
        if len(done) + 1 == fail_at:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.15 GiB")
        done.append((backend, tp, batch))
        return {"rows": [dict(_row(backend, 1, 80.0, 70.0), tp=tp, batch=batch)], "step_us": 74.0, "copy_us": 4.0}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a test card")
    monkeypatch.setattr(bench, "bench_config", fake_config)
    path = tmp_path / "run.json"
    rc = bench.main(["--backend", "latency_specialized", "--tp", "16", "8", "--batch", "1", "8", "--json", str(path)])
    err = capsys.readouterr().err
    doc = json.loads(path.read_text()) if path.exists() else None
    if fail_at is None:
        assert rc == 0 and err == "" and doc["meta"]["complete"] is True and doc["meta"]["gpu"] == "a test card"
        assert [(r["rows"][0]["tp"], r["rows"][0]["batch"]) for r in doc["results"]] == [(16, 1), (16, 8), (8, 1),
                                                                                         (8, 8)]
        return
    assert rc == 1 and len(err.splitlines()) == 1 and err.startswith("kimi_decode.bench: error: out of GPU memory")
    failed = [(16, 1), (16, 8), (8, 1)][fail_at - 1]
    assert f"latency_specialized tp {failed[0]} batch {failed[1]}" in err
    if fail_at == 1:  # nothing timed: no file
        assert doc is None and str(path) not in err
    else:
        assert f"the {fail_at - 1} before it are in {path}" in err
        assert doc["meta"]["complete"] is False and len(doc["results"]) == fail_at - 1 == len(done)


def _row(backend, layer, us, in_step, floor=50.0):
    return {"backend": backend, "tp": 16, "batch": 1, "layer": layer, "kind": "kda", "us": us, "in_step_us": in_step,
            "kernels": 8, "weight_bytes": 200e6, "state_bytes": 1e6, "floor_us": floor,
            "pct_floor": round(100 * floor / us, 1), "pct_floor_in_step": round(100 * floor / in_step, 1)}


def test_the_table_shows_both_times_and_both_speed_ups(capsys):
    results = [{"rows": [_row("auto", 1, 200.0, 196.0)], "step_us": 200.0, "copy_us": 4.0},
               {"rows": [_row("latency_specialized", 1, 80.0, 70.0)], "step_us": 74.0, "copy_us": 4.0}]
    _print_table(results)
    out = capsys.readouterr().out
    lines = out.splitlines()
    ls = next(line for line in lines if line.startswith("latency_specialized"))
    assert ls.split()[5:7] == ["80.0", "70.0"]  # us alone, in the step
    assert ls.split()[-2:] == ["62.5", "71.4"]  # % of the floor, alone and in the step
    assert "74.0 us, of which the input copy 4.0" in out
    assert "tp 16 batch 1 layer 1: latency_specialized 2.50x, 2.80x" in out


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "latency_specialized"])
def test_the_prefix_graphs_hold_the_steps_first_layers(backend):
    """Each prefix graph replays the input copy and the step's first n layers: as many kernels as the input copy's
    graph plus those layers' own graphs; and each layer's in-step time is positive and near its time alone."""
    from kimi_decode.bench import _Captured, _count_kernels, bench_config

    cap = _Captured(DecodeSlice(backend=backend, tp=16, batch=1, first_layer=1, num_layers=3, context=256,
                                device="cuda"))
    assert len(cap.prefix_graphs) == 4 and cap.prefix_graphs[-1] is cap.step_graph
    copy = _count_kernels(cap.prefix_graphs[0])
    per_layer = [_count_kernels(g) for g in cap.layer_graphs]
    assert [_count_kernels(g) for g in cap.prefix_graphs] == [copy + sum(per_layer[:n]) for n in range(4)]
    del cap

    args = argparse.Namespace(first_layer=1, layers=2, context=256, copies=2, replays=20, warmup=2, seed=0)
    res = bench_config(backend, 16, 1, args)
    assert res["copy_us"] > 0
    for row in res["rows"]:
        assert 0.5 * row["us"] < row["in_step_us"] < 1.2 * row["us"], row


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "latency_specialized"])
@pytest.mark.parametrize("tp,batch", [(8, 8), (16, 64)])
def test_timed_slices_give_their_memory_back_without_the_cycle_collector(backend, tp, batch, no_cycle_collector):
    """A slice with its graphs (what `bench_config` times: at batch 8 the experts run grouped and the specialized
    backend makes its weight copies; at 64 rows its projections beside the main stream run cuBLAS on its branch
    streams), once dropped, holds no GPU memory, with the cycle collector off, slice after slice: a bench of many
    configurations in one process must not keep the ones before (ten in one process ran out of memory on an H100).
    Counted from after the process's first slice: what torch keeps for the process from then on (cuBLAS handles, a
    workspace per stream that ran cuBLAS) is not the slice's."""
    from kimi_decode.bench import _Captured

    def captured():
        return _Captured(DecodeSlice(backend=backend, tp=tp, batch=batch, first_layer=1, num_layers=2, context=256,
                                     device="cuda"))

    first = captured()
    del first
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for _ in range(2):
        cap = captured()
        held, weights = torch.cuda.memory_allocated() - base, cap.sl.weight_bytes()
        del cap
        torch.cuda.synchronize()
        left = torch.cuda.memory_allocated() - base
        assert held > weights and left < 4 * 2**20, (held, weights, left)
