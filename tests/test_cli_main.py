"""The installed `kprof` entry point: usage errors and exit codes as a user sees them (one line, no traceback)."""
import os
import subprocess
import sys

import pytest

EXAMPLES = "examples/captures"


def kprof(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "profiler.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120, env=env)


@pytest.mark.parametrize("args, message", [
    (["analyze", "--bogus", "x"], "No such option: --bogus"),
    (["analyze"], "Missing argument"),
    (["frobnicate"], "No such command"),
])
def test_usage_errors_are_one_line_and_exit_2(args, message):
    out = kprof(*args)
    assert out.returncode == 2
    assert out.stderr.startswith("kprof: error:") and message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_diff_help_shows_the_defaults_that_depend_on_other_options():
    # the help renderer reads "[...]" in help text as markup and drops it: these defaults must reach the user
    out = kprof("diff", "--help", env={**os.environ, "COLUMNS": "300", "NO_COLOR": "1"})
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for default in ("html when -o ends in .html, json for .json, else table",
                    "every stage but prefetch and allreduce", "its backend or file name"):
        assert default in text


def test_diff_table_rounds_times_to_a_tenth_of_a_microsecond():
    base, new = f"{EXAMPLES}/auto_tp16_b1.kprof", f"{EXAMPLES}/latency_specialized_tp16_b1.kprof"
    out = kprof("diff", base, new, "-f", "table", env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    kda = next(line for line in out.stdout.splitlines() if line.strip("│ ").startswith("KDA"))
    assert [c.strip() for c in kda.strip("│ ").split("│")] == ["KDA", "29", "8", "188.9", "69.2", "2.73x"]
    stage = next(line for line in out.stdout.splitlines() if "routed_experts" in line)
    assert [c.strip() for c in stage.strip("│ ").split("│")][2:] == ["7", "3", "87.8", "30.7", "2.86x"]


def test_a_file_of_another_kind_exits_2(tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("not a trace\n")
    out = kprof("analyze", str(bad))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1


def test_committed_captures_diff_and_gate(tmp_path):
    base, new = f"{EXAMPLES}/auto_tp16_b1.kprof", f"{EXAMPLES}/latency_specialized_tp16_b1.kprof"
    report = tmp_path / "report.html"
    ok = kprof("diff", base, new, "-o", str(report))
    assert ok.returncode == 0, ok.stderr
    assert report.stat().st_size > 1_000_000 and b"cdn.plot.ly" not in report.read_bytes()[:200_000]
    # the slower side as NEW with a tight gate fails with exit code 1
    gated = kprof("diff", new, base, "--gate", "1.05", "-o", str(tmp_path / "gate.json"))
    assert gated.returncode == 1 and "gate failed" in gated.stderr
