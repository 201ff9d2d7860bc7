"""tests/conftest.py shares one card among pytest-xdist workers: at most GPU_SLOTS GPU tests at once, and the GPU
tests of unsharded (TP1) layers one at a time. Checked on the CPU: the project's conftest in a scratch project whose
workers see a CUDA device (faked), and whose tests log when they ran."""
from pathlib import Path

import pytest

pytest.importorskip("xdist")
pytest_plugins = "pytester"

TESTS = '''
import os, time, pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tp", {tps})
def test_runs(tp):
    t0 = time.monotonic()
    time.sleep(0.5)
    with open(os.environ["RUN_LOG"], "a") as f:
        f.write(f"{{tp}} {{t0}} {{time.monotonic()}}\\n")
'''


def _runs(pytester, monkeypatch, tmp_path, tps, workers, slots):
    """(tp, start, end) of each test of a scratch project's run on `workers` workers with `slots` GPU slots."""
    log = tmp_path / "runs.txt"
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(fake_cuda="import torch\ntorch.cuda.is_available = lambda: True\n",
                        test_runs=TESTS.format(tps=tps))
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    monkeypatch.setenv("RUN_LOG", str(log))
    monkeypatch.setenv("KIMI_TEST_GPU_SLOTS", str(slots))
    result = pytester.runpytest_subprocess("-p", "fake_cuda", "-p", "no:cacheprovider", "-n", str(workers))
    result.assert_outcomes(passed=len(tps))
    return [(int(tp), float(t0), float(t1)) for tp, t0, t1 in (line.split() for line in log.read_text().splitlines())]


def _most_at_once(intervals):
    events = sorted([(t0, 1) for t0, _ in intervals] + [(t1, -1) for _, t1 in intervals])
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def test_tp1_gpu_tests_run_one_at_a_time_across_workers(pytester, monkeypatch, tmp_path):
    runs = _runs(pytester, monkeypatch, tmp_path, [1, 16, 1, 8, 1, 16], workers=3, slots=9)
    assert _most_at_once([(t0, t1) for tp, t0, t1 in runs if tp == 1]) == 1, runs


def test_no_more_gpu_tests_at_once_than_slots(pytester, monkeypatch, tmp_path):
    runs = _runs(pytester, monkeypatch, tmp_path, [16, 8] * 4, workers=4, slots=2)
    assert _most_at_once([(t0, t1) for _, t0, t1 in runs]) <= 2, runs
