"""benchmarks/experts_alone.py as a command: bad arguments and a machine without a GPU get a one-line error and a
non-zero exit; on a GPU, a short run prints a row per (kernel, shard, setting) with cold and hot times."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "experts_alone.py"


def _run(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["--settings", "KIMI_DECODE_W13_WARPS"], "expected \"defaults\" or NAME=VALUE"),
    (["--settings", "defaults", "=4"], "expected \"defaults\" or NAME=VALUE"),
    (["--kernel", "w4"], "invalid choice"),
    (["--sets", "0"], "at least 1"),
])
def test_bad_arguments_get_one_line_and_exit_2(args, message):
    r = _run(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert message in r.stderr.strip().splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_and_exits_1():
    r = _run("--tp", "16")
    assert r.returncode == 1
    assert r.stderr.strip() == "experts_alone: needs a CUDA GPU (the kernels run on it)"


@pytest.mark.gpu
def test_a_short_run_prints_cold_and_hot_times_per_kernel_and_setting():
    pytest.importorskip("cutlass")
    r = _run("--kernel", "w13", "w2", "--tp", "16", "--settings", "defaults", "KIMI_DECODE_W13_WARPS=4",
             "--sets", "2", "--replays", "3", timeout=600)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()[1:]]
    assert [(row[0], row[1], row[2]) for row in rows] == [
        ("w13", "16", "defaults"), ("w2", "16", "defaults"),
        ("w13", "16", "KIMI_DECODE_W13_WARPS=4"), ("w2", "16", "KIMI_DECODE_W13_WARPS=4")]
    for row in rows:
        cold, hot, mb = map(float, row[3:6])
        assert cold > 0 and hot > 0 and mb > 10


@pytest.mark.gpu
def test_a_value_the_kernels_refuse_is_a_one_line_error():
    pytest.importorskip("cutlass")
    r = _run("--tp", "16", "--settings", "KIMI_DECODE_W13_WARPS=9", "--sets", "1", "--replays", "1", timeout=600)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("experts_alone: KIMI_DECODE_W13_WARPS")
