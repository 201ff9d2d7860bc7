"""benchmarks/ab_table.py: the layer times of several bench JSON files side by side, alone or in the step."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import ab_table  # noqa: E402


def _bench_json(path: Path, us: dict, in_step: dict | None, step: float, meta: dict | None = None) -> str:
    rows = [{"backend": b, "tp": 16, "batch": 1, "layer": layer, "us": t,
             **({"in_step_us": in_step[layer]} if in_step else {})}
            for b in ("auto", "latency_specialized") for layer, t in us.items()]
    for r in rows:
        if r["backend"] == "auto":
            r["us"] *= 3
    results = [{"rows": [r for r in rows if r["backend"] == b], "step_us": step * (3 if b == "auto" else 1)}
               for b in ("auto", "latency_specialized")]
    path.write_text(json.dumps({"meta": meta or {}, "results": results}))
    return str(path)


def test_settings_side_by_side_alone_and_in_the_step(tmp_path, capsys):
    a = _bench_json(tmp_path / "bench_ab_KIMI_X_0.json", {1: 74.0, 2: 73.5}, {1: 70.5, 2: 68.9}, 150.0)
    b = _bench_json(tmp_path / "bench_ab_KIMI_X_1_run2.json", {1: 73.0, 2: 72.5}, None, 148.0)
    alone = ab_table.layer_frame([a, b], "latency_specialized", in_step=False)
    assert list(alone.columns) == ["KIMI_X_0", "KIMI_X_1_run2"]
    assert alone.loc[(16, 1, "1")].tolist() == [74.0, 73.0]
    assert alone.loc[(16, 1, "step")].tolist() == [150.0, 148.0]
    assert ab_table.layer_frame([a], "auto", in_step=False).loc[(16, 1, "2"), "KIMI_X_0"] == 220.5

    assert ab_table.main([a, b, "--in-step"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3].split()[-2:] == ["70.5", "-"]  # layer 1: the older file has no in-step times
    assert lines[-1].split()[-3:] == ["step", "150.0", "148.0"]


def test_a_file_that_is_not_a_bench_json_is_an_error(tmp_path, capsys):
    bad = tmp_path / "bench_ab_broken.json"
    bad.write_text('{"meta": {}')
    assert ab_table.main([str(bad)]) == 2
    assert "not a kimi_decode.bench JSON file" in capsys.readouterr().err
    good = _bench_json(tmp_path / "b.json", {1: 1.0}, None, 2.0)
    with pytest.raises(ValueError, match="no nope rows"):
        ab_table.layer_frame([good], "nope", in_step=False)


def test_a_file_of_a_stopped_bench_is_named_incomplete(tmp_path):
    """A bench stopped before its last configuration writes meta.complete false: its column says so, and the
    configurations it did not time show as missing beside a complete file's."""
    done = _bench_json(tmp_path / "bench_ab_A.json", {1: 74.0}, None, 150.0, {"complete": True})
    stopped = tmp_path / "bench_ab_B.json"
    doc = json.loads(Path(_bench_json(stopped, {1: 73.0}, None, 148.0, {"complete": False})).read_text())
    for res in doc["results"]:  # another batch, which the stopped file lacks
        for r in res["rows"]:
            r["batch"] = 8
    stopped.write_text(json.dumps(doc))
    frame = ab_table.layer_frame([done, str(stopped)], "latency_specialized", in_step=False)
    assert list(frame.columns) == ["A", "B (incomplete)"]
    assert frame.loc[(16, 1, "1")].isna().tolist() == [False, True]
    assert frame.loc[(16, 8, "1"), "B (incomplete)"] == 73.0
