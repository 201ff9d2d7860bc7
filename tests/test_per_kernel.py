"""benchmarks/per_kernel.py and timeline.py: a kernel of a layer is known by name, stage and rank among its likes
in the step, so the kernels of two streams that start in either order keep their own times; bad captures get one
line and exit 1."""
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import per_kernel  # noqa: E402
import timeline  # noqa: E402

CAPTURE = ROOT / "examples" / "captures" / "latency_specialized_tp16_b1.kprof"


def _kernels(rows):
    """rows: (step, name, stage, stream, start_ns, end_ns) of layer 1 -> `per_kernel.layer_rows` of them."""
    k = pd.DataFrame(rows, columns=["step", "name", "stage", "stream", "start_ns", "end_ns"]).assign(layer=1)
    return per_kernel.layer_rows(k, 1)


def test_kernels_of_two_streams_keep_their_times_when_their_order_swaps():
    rows = []
    for step, side_first in enumerate([True, False, False]):
        t = step * 100_000
        rows.append((step, "attn", "attn_res", 7, t, t + 3_000))
        topk = (t + 4_000, t + 6_000) if side_first else (t + 5_000, t + 7_000)
        down = (t + 5_000, t + 25_000) if side_first else (t + 4_000, t + 24_000)
        rows.append((step, "topk", "router", 7, *topk))
        rows.append((step, "down", "routed_experts", 147, *down))
        rows.append((step, "proj", "routed_experts", 147, t + 26_000, t + 30_000))
        rows.append((step, "proj", "routed_experts", 147, t + 31_000, t + 41_000))
    ordered = per_kernel.kernel_table(_kernels(rows))
    table = ordered.set_index(["name", "nth"])
    assert table.loc[("topk", 0), "dur"] == pytest.approx(2.0)
    assert table.loc[("down", 0), "dur"] == pytest.approx(20.0)
    assert table.loc[("topk", 0), "stream"] == 7 and table.loc[("down", 0), "stream"] == 147
    # the same name and stage twice in a step: two kernels, in order
    assert table.loc[("proj", 0), "dur"] == pytest.approx(4.0)
    assert table.loc[("proj", 1), "dur"] == pytest.approx(10.0)
    # rows in the order of the median start: down (4.0 us in two steps of three) before topk (5.0)
    assert list(ordered["name"]) == ["attn", "down", "topk", "proj", "proj"]
    # own time: topk 2 us where it starts first (one step), else 0 inside down's interval; down all its 20 there
    assert table.loc[("topk", 0), "own"] == pytest.approx(0.0)
    assert table.loc[("down", 0), "own"] == pytest.approx(20.0)


def test_captures_side_by_side_match_kernels_by_name_and_show_what_one_lacks():
    a = per_kernel.kernel_table(_kernels([(0, "attn", "attn_res", 7, 0, 3_000),
                                          (0, "prefetch", "prefetch", 9, 3_000, 5_000),
                                          (0, "proj", "moe_tail", 7, 5_000, 15_000)]))
    b = per_kernel.kernel_table(_kernels([(0, "attn", "attn_res", 7, 0, 3_000),
                                          (0, "proj", "moe_tail", 7, 3_500, 11_500)]))
    out = per_kernel.side_by_side([a, b])
    assert list(out["name"]) == ["attn", "prefetch", "proj"]
    assert out.loc[2, "own0"] == 10.0 and out.loc[2, "own1"] == 8.0
    assert np.isnan(out.loc[1, "own1"])


def test_a_committed_capture_gives_one_row_per_kernel_of_the_layer(capsys):
    assert per_kernel.main([str(CAPTURE)]) == 0
    out = capsys.readouterr().out.splitlines()
    kernels = per_kernel.layer_kernels(str(CAPTURE), 1)
    per_step = kernels.groupby("step").size()
    assert len(out) == 1 + per_step.max() + 1  # header, one row per kernel, the sum
    total = float(out[-1].split(":")[-1].strip(" {}'").split()[-1])
    assert total == pytest.approx(per_kernel.layer_table(str(CAPTURE), 1)["own"].sum(), abs=0.1)
    assert timeline.main([str(CAPTURE)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1 + 1 + per_step.max()


@pytest.mark.parametrize("script", [per_kernel, timeline])
@pytest.mark.parametrize("content, layer, message", [
    (None, "1", "cannot read"),
    (b"not a trace", "1", "not a trace kprof reads"),
    ("capture", "9", "no kernels of layer 9"),
])
def test_bad_input_gets_one_line_and_exit_1(tmp_path, capsys, script, content, layer, message):
    path = tmp_path / "x.kprof"
    if content == "capture":
        path = CAPTURE
    elif content is not None:
        path.write_bytes(content)
    assert script.main([str(path), "--layer", layer]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
