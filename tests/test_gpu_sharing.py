"""tests/conftest.py shares one card among pytest-xdist workers: at most GPU_SLOTS GPU tests at once, a GPU test
waiting only while GPU_SLOTS others run, and the GPU tests of unsharded (TP1) layers one at a time. Checked on the
CPU: the project's conftest in a scratch project whose workers see a CUDA device (faked), and whose tests log when
they ran."""
from pathlib import Path

import pytest

pytest.importorskip("xdist")
pytest_plugins = "pytester"

TESTS = '''
import os, time, pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tp", {tps})
def test_runs(tp, request):
    t0 = time.monotonic()
    time.sleep(0.5)
    with open(os.environ["RUN_LOG"], "a") as f:
        f.write(f"{{tp}} {{request.node.stash[SETUP_BEGAN]}} {{t0}} {{time.monotonic()}}\\n")
'''

# when each test's setup began, before any fixture (the slot's wait is in the setup)
SETUP_PLUGIN = '''
import time, pytest

SETUP_BEGAN = pytest.StashKey()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[SETUP_BEGAN] = time.monotonic()
'''


def _runs(pytester, monkeypatch, tmp_path, tps, workers, slots):
    """(tp, setup began, start, end) of each test of a scratch project's run on `workers` workers with `slots` GPU
    slots."""
    log = tmp_path / "runs.txt"
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(fake_cuda="import torch\ntorch.cuda.is_available = lambda: True\n" + SETUP_PLUGIN,
                        test_runs="from fake_cuda import SETUP_BEGAN\n" + TESTS.format(tps=tps))
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    monkeypatch.setenv("RUN_LOG", str(log))
    monkeypatch.setenv("KIMI_TEST_GPU_SLOTS", str(slots))
    result = pytester.runpytest_subprocess("-p", "fake_cuda", "-p", "no:cacheprovider", "-n", str(workers))
    result.assert_outcomes(passed=len(tps))
    return [(int(tp), *map(float, times)) for tp, *times in (line.split() for line in log.read_text().splitlines())]


def _most_at_once(intervals):
    events = sorted([(t0, 1) for t0, _ in intervals] + [(t1, -1) for _, t1 in intervals])
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def test_tp1_gpu_tests_run_one_at_a_time_across_workers(pytester, monkeypatch, tmp_path):
    runs = _runs(pytester, monkeypatch, tmp_path, [1, 16, 1, 8, 1, 16], workers=3, slots=9)
    assert _most_at_once([(t0, t1) for tp, _, t0, t1 in runs if tp == 1]) == 1, runs


def test_no_more_gpu_tests_at_once_than_slots(pytester, monkeypatch, tmp_path):
    runs = _runs(pytester, monkeypatch, tmp_path, [16, 8] * 4, workers=4, slots=2)
    assert _most_at_once([(t0, t1) for _, _, t0, t1 in runs]) <= 2, runs


def test_a_gpu_test_waits_only_while_every_slot_is_held(pytester, monkeypatch, tmp_path):
    # 3 workers, 2 slots, 2 tests each: with a slot per worker (modulo 2), two workers share one slot and run their 4
    # tests one after another, ~1 s in which the third worker's slot stands free after its 2
    runs = _runs(pytester, monkeypatch, tmp_path, [16, 8] * 3, workers=3, slots=2)
    # a slot is held a little before and after its test's body (the other fixtures, the cache release; ~0.1 s here)
    margin = 0.25
    for tp, began, t0, _ in runs:
        for t in (began + 0.02 * i for i in range(int((t0 - began) / 0.02))):
            running = sum(a - margin <= t < b + margin for _, _, a, b in runs)
            assert running >= 2, f"a test waited {t - began:.2f} s into its setup with {running} running: {runs}"
