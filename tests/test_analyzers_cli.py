"""`kprof import` and `kprof analyze`: output formats, and one clear line with exit code 2 for bad input."""
from __future__ import annotations

import csv
import gzip
import io
import json
import shutil
import sqlite3
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from profiler.cli import app

DATA = Path(__file__).parent / "data"
runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def test_analyze_json_follows_the_schema():
    result = run("analyze", DATA / "kineto_eager.json", "--format", "json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert list(doc) == ["schema", "capture", "steps", "unattributed_kernels", "layers", "overlap", "prefetch"]
    assert doc["schema"] == "kprof.analyze/1"
    assert doc["capture"]["gpu"] == "NVIDIA H200"
    assert (doc["steps"], doc["unattributed_kernels"]) == (3, 4)
    layer = doc["layers"][0]
    assert list(layer) == ["layer", "kind", "kernels_per_step", "kernel_us", "busy_us", "span_us", "own_us", "stages"]
    assert list(layer["stages"][0]) == ["name", "kernels_per_step", "kernel_us", "busy_us", "span_us", "own_us"]
    assert all(isinstance(layer[k], float) for k in ("kernels_per_step", "kernel_us", "busy_us", "span_us", "own_us"))


@pytest.mark.parametrize("fixture", ["nsys_graph.sqlite", "cupti_graph.kprof"])
def test_analyze_reads_every_format_from_its_content(tmp_path, fixture):
    renamed = tmp_path / "trace.bin"  # the extension plays no part
    shutil.copy(DATA / fixture, renamed)
    result = run("analyze", renamed, "--format", "json")
    assert result.exit_code == 0, result.output
    assert [layer["kernels_per_step"] for layer in json.loads(result.stdout)["layers"]] == [3.0, 1.0]


def test_import_then_analyze_gives_the_same_numbers(tmp_path):
    run_file = tmp_path / "run.kprof"
    assert run("import", DATA / "kineto_eager.json", "-o", run_file).exit_code == 0
    direct = json.loads(run("analyze", DATA / "kineto_eager.json", "--format", "json").stdout)
    imported = json.loads(run("analyze", run_file, "--format", "json").stdout)
    assert imported == direct


def test_analyze_csv_and_table_list_layers_and_stages(tmp_path):
    rows = list(csv.DictReader(io.StringIO(run("analyze", DATA / "kineto_eager.json", "--format", "csv").stdout)))
    assert [(r["layer"], r["stage"]) for r in rows] == [("0", ""), ("0", "attn_res"), ("0", "qkv_proj"),
                                                       ("1", ""), ("1", "o_proj")]
    assert rows[0]["busy_us"] == "18.0"
    table = run("analyze", DATA / "kineto_eager.json")
    assert table.exit_code == 0 and "qkv_proj" in table.stdout and "4 kernel(s) unattributed" in table.stdout
    out = tmp_path / "layers.json"
    assert run("analyze", DATA / "kineto_eager.json", "--format", "json", "-o", out).exit_code == 0
    assert json.loads(out.read_text())["steps"] == 3


def test_layer_regex_selects_other_programs_layer_ranges(tmp_path):
    doc = json.loads((DATA / "kineto_eager.json").read_text())
    for event in doc["traceEvents"]:
        if event.get("cat") == "user_annotation" and event["name"].startswith("layer["):
            event["name"] = "model.layers." + event["name"][6]
    path = tmp_path / "other.json"
    path.write_text(json.dumps(doc))
    result = json.loads(run("analyze", path, "--format", "json", "--layer-regex", r"layers\.(\d+)$").stdout)
    assert [(layer["layer"], layer["kind"], layer["kernels_per_step"]) for layer in result["layers"]] == [
        (0, None, 5.0), (1, None, 2.0)]


def _truncated_gzip(path: Path) -> None:
    data = gzip.compress((DATA / "kineto_eager.json").read_bytes())
    path.write_bytes(data[: len(data) // 2])


def _corrupt_sqlite(path: Path) -> None:
    data = bytearray((DATA / "nsys_graph.sqlite").read_bytes())
    data[100:4000] = b"\xff" * 3900
    path.write_bytes(bytes(data))


def _foreign_sqlite(path: Path) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE recipes (name TEXT)")
    db.commit()
    db.close()


def _zip_without_header(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("hello.txt", "hi")


BAD_INPUTS = {
    "truncated JSON": (lambda p: p.write_bytes((DATA / "kineto_eager.json").read_bytes()[:9000]), "truncated"),
    "corrupt JSON": (lambda p: p.write_bytes((DATA / "kineto_eager.json").read_bytes().replace(b'"dur"', b'"dur" 1', 3)),
                     "corrupt JSON"),
    "truncated gzip": (_truncated_gzip, "truncated or corrupt gzip"),
    "empty file": (lambda p: p.write_bytes(b""), "empty file"),
    "empty trace": (lambda p: p.write_text('{"traceEvents": []}'), "no GPU kernels"),
    "JSON of another kind": (lambda p: p.write_text('{"name": "not a trace"}'), "traceEvents"),
    "CPU-only trace": (lambda p: p.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "decode_step", "pid": 1, "tid": 1, "ts": 0, "dur": 5}]})),
        "no GPU kernels"),
    "PNG image": (lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64), "not a trace"),
    "truncated SQLite": (lambda p: p.write_bytes((DATA / "nsys_graph.sqlite").read_bytes()[:3000]), "SQLite"),
    "corrupt SQLite": (_corrupt_sqlite, "SQLite"),
    "SQLite of another kind": (_foreign_sqlite, "not an Nsight Systems export"),
    "zip without header": (_zip_without_header, "not a .kprof file"),
    "truncated .kprof": (lambda p: p.write_bytes((DATA / "cupti_graph.kprof").read_bytes()[:3000]), "kprof"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
@pytest.mark.parametrize("command", ["analyze", "import"])
def test_bad_input_gives_one_line_exit_2_and_no_output_file(tmp_path, case, command):
    make, message = BAD_INPUTS[case]
    trace = tmp_path / "input"
    make(trace)
    out = tmp_path / "out"
    result = run(command, trace, "-o", out)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kprof: error: ")
    assert message.lower() in lines[0].lower()
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == [trace]  # neither the output nor a temporary file


def test_missing_file_and_bad_regex_are_user_errors(tmp_path):
    missing = run("analyze", tmp_path / "nope.json")
    assert missing.exit_code == 2 and "nope.json" in missing.stderr
    bad = run("analyze", DATA / "kineto_eager.json", "--layer-regex", "layer(")
    assert bad.exit_code == 2 and bad.stderr.startswith("kprof: error: invalid layer regex")
    no_group = run("analyze", DATA / "kineto_eager.json", "--layer-regex", "layer")
    assert no_group.exit_code == 2 and "group" in no_group.stderr


def test_output_into_a_missing_directory_is_one_line_exit_2(tmp_path):
    result = run("import", DATA / "kineto_eager.json", "-o", tmp_path / "missing" / "run.kprof")
    assert result.exit_code == 2
    assert result.stderr.strip() == f"kprof: error: cannot write {tmp_path / 'missing' / 'run.kprof'}: No such file or directory"
