"""`kprof diff` on tensor-parallel runs: one capture per rank, given as a folder or a glob pattern; merged figures
(slowest rank per layer and stage, means of counts, overlap and prefetch) and a per-rank table."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from analyzers.layers import analyze
from analyzers.ranks import RankError, merge_ranks, order_ranks, run_files
from analyzers.trace import Trace
from profiler.cli import app

sys.path.insert(0, str(Path(__file__).parent / "data"))
from synthetic import decode_capture  # noqa: E402

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def rank_capture(backend: str, rank: int, slow: float) -> Trace:
    """The synthetic capture of `backend` as rank `rank`, every kernel `slow` times as long (no two ranks of a run
    take exactly the same time)."""
    t = decode_capture(backend)
    k = t.kernels.copy()
    k["end_ns"] = k["start_ns"] + ((k["end_ns"] - k["start_ns"]) * slow).astype("int64")
    return Trace(kernels=k, launches=t.launches, ranges=t.ranges, meta={**t.meta, "rank": rank, "world": 2})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two ranks per side; rank 1 is the slower one on the base side, rank 0 on the new side."""
    folder = tmp_path_factory.mktemp("ranks")
    for backend, slows in (("auto", (1.0, 1.2)), ("fused", (1.1, 1.0))):
        side = folder / backend
        side.mkdir()
        for rank, slow in enumerate(slows):
            rank_capture(backend, rank, slow).save(side / f"{backend}_tp2_b1.rank{rank}.kprof")
    return folder


def docs_of(folder: Path) -> list[dict]:
    return [analyze(Trace.load(f)) for f in sorted(folder.glob("*.kprof"))]


def test_merged_layer_and_stage_times_are_the_slowest_ranks(runs):
    docs = docs_of(runs / "auto")
    merged = merge_ranks(docs, [0, 1])
    assert merged["capture"]["ranks"] == [0, 1] and "rank" not in merged["capture"]
    for i, layer in enumerate(merged["layers"]):
        for metric in ("kernel_us", "busy_us", "span_us", "own_us"):
            assert layer[metric] == max(d["layers"][i][metric] for d in docs)
        assert layer[metric] > min(d["layers"][i][metric] for d in docs)  # the ranks really differ
        assert layer["kernels_per_step"] == docs[0]["layers"][i]["kernels_per_step"]
        for j, stage in enumerate(layer["stages"]):
            assert stage["name"] == docs[0]["layers"][i]["stages"][j]["name"]
            assert stage["own_us"] == max(d["layers"][i]["stages"][j]["own_us"] for d in docs)


def test_merged_overlap_and_prefetch_are_means_with_recomputed_shares(runs):
    docs = docs_of(runs / "auto")
    merged = merge_ranks(docs, [0, 1])
    ov = merged["overlap"]
    assert ov["comm_us"] == pytest.approx(sum(d["overlap"]["comm_us"] for d in docs) / 2, abs=1e-3)
    assert ov["overlap_us"] == pytest.approx(sum(d["overlap"]["overlap_us"] for d in docs) / 2, abs=1e-3)
    assert ov["comm_us"] > 0 and ov["comm_hidden_pct"] == pytest.approx(100 * ov["overlap_us"] / ov["comm_us"], abs=0.01)
    assert merged["prefetch"] == {"prefetch_us": 0.0, "hidden_us": 0.0, "exposed_us": 0.0, "hidden_pct": None,
                                  "layers": []}  # auto has no prefetch stage
    fused = docs_of(runs / "fused")
    pf = merge_ranks(fused, [0, 1])["prefetch"]
    assert pf["prefetch_us"] > 0
    assert pf["prefetch_us"] == pytest.approx(sum(d["prefetch"]["prefetch_us"] for d in fused) / 2, abs=1e-3)
    assert pf["hidden_pct"] == pytest.approx(100 * pf["hidden_us"] / pf["prefetch_us"], abs=0.01)
    assert merged["unattributed_kernels"] == sum(d["unattributed_kernels"] for d in docs)


def test_one_rank_is_its_own_merge(runs):
    doc = docs_of(runs / "auto")[0]
    assert merge_ranks([doc], [0]) is doc


def test_folder_and_glob_give_the_same_diff_with_a_per_rank_table(runs):
    by_folder = run("diff", runs / "auto", runs / "fused", "--format", "json")
    assert by_folder.exit_code == 0, by_folder.output
    doc = json.loads(by_folder.stdout)
    by_glob = run("diff", f"{runs}/auto/*.rank*.kprof", f"{runs}/fused/*.kprof", "--format", "json")
    assert by_glob.exit_code == 0, by_glob.output
    other = json.loads(by_glob.stdout)
    doc["base"]["path"] = other["base"]["path"]
    doc["new"]["path"] = other["new"]["path"]
    assert doc == other
    assert doc["ranks"]["base"] == [0, 1] and doc["ranks"]["new"] == [0, 1]
    per_rank = {r["rank"]: r for r in doc["ranks"]["per_rank"]}
    base_docs, new_docs = docs_of(runs / "auto"), docs_of(runs / "fused")
    for rank in (0, 1):
        kda = next(k for k in per_rank[rank]["kinds"] if k["kind"] == "kda")
        base_kda = [l["own_us"] for l in base_docs[rank]["layers"] if l["kind"] == "kda"]
        new_kda = [l["own_us"] for l in new_docs[rank]["layers"] if l["kind"] == "kda"]
        assert kda["base_us_per_layer"] == round(sum(base_kda) / len(base_kda), 3)
        assert kda["new_us_per_layer"] == round(sum(new_kda) / len(new_kda), 3)
    # the headline is the merged run: the slowest rank's layers on each side
    merged = merge_ranks(base_docs, [0, 1])
    kda = [l["own_us"] for l in merged["layers"] if l["kind"] == "kda"]
    assert doc["headline"]["base_us_per_layer"] == round(sum(kda) / len(kda), 3)


def test_table_and_html_show_the_ranks(runs, tmp_path):
    table = run("diff", runs / "auto", runs / "fused")
    assert table.exit_code == 0 and "per rank" in table.stdout
    out = tmp_path / "r.html"
    assert run("diff", runs / "auto", runs / "fused", "-o", out).exit_code == 0
    html = out.read_text()
    assert 'id="ranks"' in html and "slowest rank" in html


def test_rank_from_meta_else_name_else_position(tmp_path):
    paths = [tmp_path / "a.kprof", tmp_path / "x.rank3.kprof", tmp_path / "c.kprof"]
    assert order_ranks([{"rank": 5}, {}, {}], paths) == [5, 3, 2]
    with pytest.raises(RankError, match="both rank 3"):
        order_ranks([{"rank": 3}, {}, {}], paths)


def test_bad_runs_are_one_line_errors(runs, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    twice = tmp_path / "twice"
    twice.mkdir()
    for name in ("a.kprof", "b.kprof"):
        rank_capture("auto", 0, 1.0).save(twice / name)
    other = tmp_path / "other"
    other.mkdir()
    rank_capture("auto", 0, 1.0).save(other / "r0.kprof")
    t = rank_capture("auto", 1, 1.0)
    keep = ~t.ranges["name"].astype(str).str.startswith("layer[3]")
    Trace(kernels=t.kernels, launches=t.launches, ranges=t.ranges[keep], meta=t.meta).save(other / "r1.kprof")
    for base, message in ((empty, "holds no captures"), (tmp_path / "nothing*.kprof", "no file matches"),
                          (twice, "both rank 0"), (other, "other layers")):
        out = tmp_path / "r.json"
        result = run("diff", base, runs / "fused", "-o", out)
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1
        assert not out.exists()
    with pytest.raises(RankError):
        run_files(empty)
