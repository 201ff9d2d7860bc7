"""The HTML diff report: one self-contained file whose numbers are `kprof analyze --format json` of each side."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from profiler.cli import app
from reports.html import num

sys.path.insert(0, str(Path(__file__).parent / "data"))
from synthetic import decode_capture  # noqa: E402

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[str, dict, dict, dict]:
    folder = tmp_path_factory.mktemp("report")
    base, new = folder / "auto_tp16_b1.kprof", folder / "fused_tp16_b1.kprof"
    decode_capture("auto").save(base)
    decode_capture("fused").save(new)
    out = folder / "report.html"
    result = run("diff", base, new, "-o", out, "--gate", "1.05")
    assert result.exit_code == 0, result.output
    assert "kprof: wrote" in result.stderr
    analyses = [json.loads(run("analyze", p, "--format", "json").stdout) for p in (base, new)]
    diff_doc = json.loads(run("diff", base, new, "--format", "json", "--gate", "1.05").stdout)
    return out.read_text(), diff_doc, *analyses


def test_one_self_contained_file(report):
    html = report[0]
    assert html.startswith("<!DOCTYPE html>")
    assert not re.search(r"<script[^>]+src=", html)  # nothing loaded: plotly.js is inline
    assert not re.search(r"<link[^>]+href=\"http", html)
    assert html.count("Plotly.newPlot") >= 4 and html.count("plotly.js v") == 1  # the bundle once
    assert 3_000_000 < len(html.encode()) < 7_000_000


def test_embedded_json_is_the_diff_document(report):
    html, diff_doc, _, _ = report
    embedded = re.search(r'<script type="application/json" id="kprof-diff">(.*?)</script>', html, re.S).group(1)
    assert json.loads(embedded.replace("<\\/", "</")) == diff_doc


def test_headline_numbers_equal_analyze_json(report):
    html, diff_doc, base, new = report
    for doc, side in ((base, "base"), (new, "new")):
        kda = [l for l in doc["layers"] if l["kind"] == "kda"]
        us = round(sum(l["own_us"] for l in kda) / len(kda), 3)
        kernels = sum(l["kernels_per_step"] for l in kda) / len(kda)
        assert diff_doc["headline"][f"{side}_us_per_layer"] == us
        assert diff_doc["headline"][f"{side}_kernels_per_layer"] == kernels
    head = diff_doc["headline"]
    verdict = re.search(r'<div class="verdict[^"]*" id="verdict">([^<]*)', html).group(1)
    assert verdict == f"fused is {head['speedup']:.2f}x faster per layer (KDA layers), 13 vs 24 kernels/layer"
    assert f"{num(head['new_us_per_layer'])} vs {num(head['base_us_per_layer'])}" in html
    assert f"{num(head['new_kernels_per_layer'])} vs {num(head['base_kernels_per_layer'])}" in html
    # Every layer's own time of both sides, and the whole-step overlap figures, appear as analyze printed them.
    for doc in (base, new):
        for layer in doc["layers"]:
            assert f"<td>{num(layer['own_us'])}</td>" in html
        for key in ("comm_us", "compute_us", "overlap_us"):
            assert f"<td>{num(doc['overlap'][key])}</td>" in html
        assert f"<td>{num(doc['prefetch']['prefetch_us'])}</td>" in html
    assert f"{new['overlap']['comm_hidden_pct']:.2f}%" in html


def test_sections_and_metadata(report):
    html = report[0]
    for anchor in ("layers", "timeline", "stages", "overlap", "prefetch", "kernels"):
        assert f'id="{anchor}"' in html
    assert "NVIDIA H200" in html and "auto_tp16_b1.kprof" in html and "passed" in html
    assert 'class="sortable"' in html and "cute_mxfp4_moe_up" in html
    assert "decode step 2 of 3" in html  # the timeline's representative step


def test_report_of_captures_without_layers_still_renders(tmp_path):
    # A Kineto trace with kernels but no layer ranges: nothing to align, but a file and no traceback.
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 1, "dur": 1,
         "args": {"correlation": 1000}},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 3, "dur": 2,
         "args": {"device": 0, "stream": 7, "correlation": 1000}}]}))
    out = tmp_path / "r.html"
    result = run("diff", trace, trace, "-o", out, "--gate", "1.1")
    assert result.exit_code == 0, result.output
    assert "no layers to compare" in out.read_text() or "cannot be compared" in out.read_text()
