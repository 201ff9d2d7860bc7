"""tests/conftest.py shares one card among pytest-xdist workers: GPU tests of unsharded (TP1) layers run one at a
time across the workers, the others beside them. Checked on the CPU: the project's conftest in a scratch project
whose workers see a CUDA device (faked), and whose tests log when they ran."""
from pathlib import Path

import pytest

pytest.importorskip("xdist")
pytest_plugins = "pytester"

TESTS = '''
import os, time, pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tp", [1, 16, 1, 8, 1, 16])
def test_runs(tp):
    t0 = time.monotonic()
    time.sleep(0.5)
    with open(os.environ["RUN_LOG"], "a") as f:
        f.write(f"{tp} {t0} {time.monotonic()}\\n")
'''


def test_tp1_gpu_tests_run_one_at_a_time_across_workers(pytester, monkeypatch, tmp_path):
    log = tmp_path / "runs.txt"
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(fake_cuda="import torch\ntorch.cuda.is_available = lambda: True\n", test_runs=TESTS)
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    monkeypatch.setenv("RUN_LOG", str(log))
    result = pytester.runpytest_subprocess("-p", "fake_cuda", "-p", "no:cacheprovider", "-n", "3")
    result.assert_outcomes(passed=6)
    runs = [line.split() for line in log.read_text().splitlines()]
    tp1 = sorted((float(t0), float(t1)) for tp, t0, t1 in runs if tp == "1")
    assert len(tp1) == 3
    assert all(end <= start for (_, end), (start, _) in zip(tp1, tp1[1:])), tp1
