"""`kprof diff`: alignment by (layer kind, stage), the kprof.diff/1 JSON, the verdict, --gate exit codes, ncu CSVs and
bad input."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from analyzers.diff import diff
from analyzers.layers import activity_layers, analyze
from analyzers.prefetch import parse_ncu_csv
from analyzers.trace import Trace
from profiler.cli import app

sys.path.insert(0, str(Path(__file__).parent / "data"))
from synthetic import decode_capture  # noqa: E402

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("captures")
    decode_capture("auto").save(folder / "auto_tp16_b1.kprof")
    decode_capture("fused").save(folder / "fused_tp16_b1.kprof")
    return folder / "auto_tp16_b1.kprof", folder / "fused_tp16_b1.kprof"


def layer_trace(stages: list[tuple[str, str, int]], kind: str = "kda") -> Trace:
    """One decode step of one layer; stages: (stage, kernel name, duration in ns), run back to back."""
    ranges, launches, kernels = [("decode_step", 0, 10_000), (f"layer[0]:{kind}", 10, 9_000)], [], []
    t = 100_000
    for i, (stage, name, dur) in enumerate(stages, start=1):
        ranges.append((stage, 100 * i, 100 * i + 50))
        launches.append((i, 100 * i + 10, 100 * i + 20))
        kernels.append((i, t, t + dur, name))
        t += dur
    return Trace(
        ranges=pd.DataFrame([{"pid": 1, "tid": 1, "start_ns": s, "end_ns": e, "name": n} for n, s, e in ranges]),
        launches=pd.DataFrame([{"pid": 1, "tid": 1, "start_ns": s, "end_ns": e, "name": "cudaLaunchKernel",
                                "correlation_id": c} for c, s, e in launches]),
        kernels=pd.DataFrame([{"kind": "kernel", "stream": 7, "start_ns": s, "end_ns": e, "name": n,
                               "correlation_id": c} for c, s, e, n in kernels]),
    )


def diff_of(base: Trace, new: Trace, **kwargs) -> dict:
    acts = [activity_layers(t) for t in (base, new)]
    return diff(analyze(base), analyze(new), *[a[a["kind"] == "kernel"] for a in acts], **kwargs)


def test_alignment_is_by_kind_and_stage_not_kernel_name():
    base = layer_trace([("qkv_proj", "gemm_q", 4000), ("qkv_proj", "gemm_kv", 2000), ("o_proj", "gemm_o", 3000)])
    new = layer_trace([("qkv_proj", "fused_qkv", 3000), ("o_proj", "gemm_o", 3000)])
    doc = diff_of(base, new)
    stages = {(s["kind"], s["stage"]): s for s in doc["stages"]}
    assert set(stages) == {("kda", "qkv_proj"), ("kda", "o_proj")}
    assert (stages["kda", "qkv_proj"]["base_kernels"], stages["kda", "qkv_proj"]["new_kernels"]) == (2.0, 1.0)
    assert (stages["kda", "qkv_proj"]["base_us"], stages["kda", "qkv_proj"]["new_us"]) == (6.0, 3.0)
    assert stages["kda", "qkv_proj"]["speedup"] == 2.0
    status = {k["name"]: k["status"] for k in doc["kernels"]}
    assert status == {"gemm_q": "removed", "gemm_kv": "removed", "fused_qkv": "added", "gemm_o": "same"}
    assert doc["layers"] == [{"layer": 0, "kind": "kda", "base_kernels": 3.0, "new_kernels": 2.0, "base_us": 9.0,
                              "new_us": 6.0, "speedup": 1.5}]
    assert doc["verdict"][0] == "NEW is 1.50x faster per layer (KDA layers), 2 vs 3 kernels/layer"


def test_verdict_slower_and_as_fast():
    base = layer_trace([("qkv_proj", "a", 4000)])
    assert diff_of(base, layer_trace([("qkv_proj", "b", 5000)]))["verdict"][0].startswith("NEW is 1.25x slower")
    assert "as fast as" in diff_of(base, layer_trace([("qkv_proj", "b", 4040)]))["verdict"][0]


def test_diff_json_schema_and_numbers_equal_analyze(pair):
    base, new = pair
    result = run("diff", base, new, "--format", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert list(doc) == ["schema", "metric", "base", "new", "headline", "verdict", "kinds", "all_layers", "layers",
                         "stages", "kernels", "overlap", "prefetch", "gate", "ranks"]
    assert (doc["schema"], doc["metric"], doc["gate"], doc["ranks"]) == ("kprof.diff/1", "own_us", None, None)
    assert (doc["base"]["label"], doc["new"]["label"]) == ("auto", "fused")
    base_doc = json.loads(run("analyze", base, "--format", "json").stdout)
    new_doc = json.loads(run("analyze", new, "--format", "json").stdout)
    kda = [l for l in base_doc["layers"] if l["kind"] == "kda"]
    assert doc["headline"]["kind"] == "kda"
    assert doc["headline"]["base_us_per_layer"] == round(sum(l["own_us"] for l in kda) / len(kda), 3)
    assert doc["headline"]["base_kernels_per_layer"] == 24.0 and doc["headline"]["new_kernels_per_layer"] == 13.0
    assert [l["new_us"] for l in doc["layers"]] == [l["own_us"] for l in new_doc["layers"]]
    assert doc["overlap"]["base"] == base_doc["overlap"] and doc["overlap"]["new"] == new_doc["overlap"]
    assert doc["prefetch"]["base"] == base_doc["prefetch"] and doc["prefetch"]["toggled"] is True
    assert doc["overlap"]["pairs"][0]["a"] == "stage:shared_experts"  # both sides have the two stages
    assert doc["overlap"]["pairs"][0]["new"]["hidden_pct"] > 50  # the fused side runs them on two streams
    assert doc["verdict"][0].startswith("fused is 1.") and "13 vs 24 kernels/layer" in doc["verdict"][0]


def test_gate_exit_codes(pair, tmp_path):
    base, new = pair
    ok = run("diff", base, new, "--gate", "1.0", "-o", tmp_path / "ok.json")
    assert ok.exit_code == 0, ok.output
    assert json.loads((tmp_path / "ok.json").read_text())["gate"]["passed"] is True
    slower = run("diff", new, base, "--gate", "1.05", "-o", tmp_path / "slow.json")
    assert slower.exit_code == 1
    assert "kprof: gate failed: auto takes 1.83x fused's own_us" in slower.stderr and "allowed 1.05x" in slower.stderr
    doc = json.loads((tmp_path / "slow.json").read_text())  # the report is still written, for CI to keep
    assert doc["gate"]["passed"] is False and len(doc["gate"]["failures"]) == 3
    assert run("diff", new, base, "--gate", "2.0", "--format", "json").exit_code == 0
    bad = run("diff", base, new, "--gate", "0")
    assert bad.exit_code == 2 and bad.stderr.startswith("kprof: error: --gate")


def test_table_output_and_pairs(pair):
    base, new = pair
    result = run("diff", base, new, "--pair", "class:prefetch,class:compute", "--metric", "span_us")
    assert result.exit_code == 0, result.output
    assert "fused is" in result.stdout and "routed_experts" in result.stdout
    doc = json.loads(run("diff", base, new, "-f", "json", "--pair", "class:prefetch,class:compute").stdout)
    assert [(p["a"], p["b"]) for p in doc["overlap"]["pairs"]] == [("class:prefetch", "class:compute")]
    assert doc["overlap"]["pairs"][0]["base"]["hidden_pct"] is None
    assert run("diff", base, new, "--pair", "stage:x").exit_code == 2
    assert run("diff", base, new, "--pair", "kernel:(,stage:x").exit_code == 2


NCU_DETAILS = '''==PROF== Connected to process 4242
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python","h200","cute_mxfp4_moe_up","1","7","(128, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Mbyte","12.50"
"0","4242","python","h200","cute_mxfp4_moe_up","1","7","(128, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","Kbyte","500"
"0","4242","python","h200","cute_mxfp4_moe_up","1","7","(128, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","lts__t_sector_hit_rate.pct","%","80"
"1","4242","python","h200","cute_mxfp4_moe_up","1","7","(128, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Mbyte","13.50"
"1","4242","python","h200","cute_mxfp4_moe_up","1","7","(128, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","Kbyte","500"
"1","4242","python","h200","cute_mxfp4_moe_up","1","7","(128, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","lts__t_sector_hit_rate.pct","%","90"
'''
NCU_RAW = '''"ID","Kernel Name","dram__bytes.sum","lts__t_sector_hit_rate.pct"
"","","Gbyte","%"
"0","mxfp4_grouped_gemm_up","0.02","41.5"
"1","mxfp4_grouped_gemm_up","0.022","42.5"
'''


def test_ncu_csv_details_and_raw_pages():
    details = parse_ncu_csv(NCU_DETAILS).set_index("name")
    assert details.loc["cute_mxfp4_moe_up"].tolist() == [2, 85.0, 13.5]
    raw = parse_ncu_csv(NCU_RAW).set_index("name")
    assert raw.loc["mxfp4_grouped_gemm_up"].tolist() == [2, 42.0, 21.0]
    with pytest.raises(ValueError, match="not an Nsight Compute CSV"):
        parse_ncu_csv("a,b\n1,2\n")
    with pytest.raises(ValueError, match="no L2 hit rate"):
        parse_ncu_csv('"ID","Kernel Name","gpu__time_duration.sum"\n"0","k","5"\n')
    with pytest.raises(ValueError, match="bad value"):
        parse_ncu_csv(NCU_RAW.replace('"41.5"', '"lots"'))


def test_ncu_csvs_side_by_side_and_bad_csv(pair, tmp_path):
    base, new = pair
    (tmp_path / "base.csv").write_text(NCU_RAW)
    (tmp_path / "new.csv").write_text(NCU_DETAILS)
    doc = json.loads(run("diff", base, new, "-f", "json", "--ncu-base", tmp_path / "base.csv",
                         "--ncu-new", tmp_path / "new.csv").stdout)
    rows = {r["name"]: r for r in doc["prefetch"]["ncu"]}
    assert rows["cute_mxfp4_moe_up"]["base"] is None and rows["cute_mxfp4_moe_up"]["new"]["l2_hit_pct"] == 85.0
    assert rows["mxfp4_grouped_gemm_up"]["base"]["dram_mb"] == 21.0
    (tmp_path / "bad.csv").write_text("hello\n")
    out = tmp_path / "report.html"
    bad = run("diff", base, new, "--ncu-new", tmp_path / "bad.csv", "-o", out)
    assert bad.exit_code == 2 and bad.stderr.startswith("kprof: error: bad.csv: not an Nsight Compute CSV")
    assert not out.exists()


def test_class_table_option(pair, tmp_path):
    base, new = pair
    table = tmp_path / "classes.json"
    table.write_text(json.dumps({"rules": [["communication", "^cute_router"]]}))
    doc = json.loads(run("diff", base, new, "-f", "json", "--classes", table).stdout)
    names = {k["name"] for k in doc["overlap"]["new"]["comm_kernels"]}
    assert names == {"cute_router_topk", "one_shot_allreduce_rmsnorm"}
    table.write_text("[1, 2]")
    bad = run("diff", base, new, "--classes", table)
    assert bad.exit_code == 2 and bad.stderr.startswith("kprof: error: class table")
    assert run("analyze", base, "--classes", table).exit_code == 2


@pytest.mark.parametrize("case", ["missing", "empty", "truncated", "not a trace", "no kernels"])
def test_bad_input_one_line_exit_2_no_output(pair, tmp_path, case):
    base, _ = pair
    bad = tmp_path / "bad.kprof"
    if case == "empty":
        bad.write_bytes(b"")
    elif case == "truncated":
        bad.write_bytes(base.read_bytes()[:2000])
    elif case == "not a trace":
        bad.write_text("hello")
    elif case == "no kernels":
        bad.write_text('{"traceEvents": []}')
    out = tmp_path / "report.html"
    for args in ((base, bad), (bad, base)):
        result = run("diff", *args, "-o", out, "--gate", "1.1")
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kprof: error: ")
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".report")]


def test_usage_errors_exit_2(pair, tmp_path):
    base, new = pair
    assert run("diff", base, new, "--no-such-option").exit_code == 2
    assert run("diff", base, new, "--metric", "fastest").exit_code == 2
    html_to_stdout = run("diff", base, new, "--format", "html")
    assert html_to_stdout.exit_code == 2 and "-o report.html" in html_to_stdout.stderr
