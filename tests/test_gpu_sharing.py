"""tests/conftest.py shares one card among pytest-xdist workers: at most GPU_SLOTS GPU tests at once, and the GPU
tests of unsharded (TP1) layers one at a time, checked on the CPU with the project's conftest in a scratch project
whose workers see a CUDA device (faked) and whose tests log when they ran; and a GPU test takes any free slot,
waiting only while all are held, checked on the conftest's slot taker itself."""
import fcntl
import importlib.util
import threading
import time
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


def _conftest_copy():
    spec = importlib.util.spec_from_file_location("card_sharing_conftest", Path(__file__).parent / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    return conftest


def _slot_taker(monkeypatch, slots):
    """The conftest's `_take_gpu_slot`, from a copy of the module with GPU_SLOTS = `slots`."""
    conftest = _conftest_copy()
    monkeypatch.setattr(conftest, "GPU_SLOTS", slots)
    return conftest._take_gpu_slot


@pytest.mark.parametrize("slots", ["0", "nine", "-1"])
def test_a_gpu_slot_count_of_none_or_not_a_number_is_refused_by_name(monkeypatch, slots):
    monkeypatch.setenv("KIMI_TEST_GPU_SLOTS", slots)
    with pytest.raises(ValueError, match=r"KIMI_TEST_GPU_SLOTS must be the GPU tests at once in 1\.\.1024"):
        _conftest_copy()


def _hold(path):
    """A slot held as another worker holds it (flock locks belong to the open file, so this one process can hold
    and contend)."""
    f = open(path, "w")
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return f


def _take_in_thread(take, shared, first):
    got = []
    thread = threading.Thread(target=lambda: got.append(take(shared, first)), daemon=True)
    thread.start()
    return thread, got


def test_a_gpu_test_takes_a_free_slot_when_its_workers_own_is_held(monkeypatch, tmp_path):
    take = _slot_taker(monkeypatch, 3)
    other = _hold(tmp_path / "gpu_slot0.lock")  # worker 0's own slot (number modulo 3), held by worker 3
    try:
        thread, got = _take_in_thread(take, tmp_path, 0)
        thread.join(timeout=10)
        assert got, "the test waited on its worker's own slot while two others were free"
        assert Path(got[0].name).name == "gpu_slot1.lock"
        got[0].close()
    finally:
        other.close()


def test_a_gpu_test_waits_while_every_slot_is_held_and_takes_the_first_freed(monkeypatch, tmp_path):
    take = _slot_taker(monkeypatch, 2)
    others = [_hold(tmp_path / f"gpu_slot{i}.lock") for i in range(2)]
    try:
        thread, got = _take_in_thread(take, tmp_path, 0)
        time.sleep(0.3)
        assert thread.is_alive() and not got, "a slot was taken while every slot was held"
        others[1].close()
        thread.join(timeout=10)
        assert got and Path(got[0].name).name == "gpu_slot1.lock"
        got[0].close()
    finally:
        for f in others:
            f.close()
