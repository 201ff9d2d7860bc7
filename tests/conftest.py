import fcntl
import gc
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_card_shared(request, tmp_path_factory):
    """Under pytest-xdist the workers share one card. The GPU tests of unsharded (TP1) layers, over 30 GiB each, hold
    a lock that the workers share, so that they run one at a time; after each GPU test its worker hands its cached
    blocks back, so that one test's peak does not stay reserved while the other workers need the memory."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or "gpu" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    callspec = getattr(request.node, "callspec", None)
    with open(tmp_path_factory.getbasetemp().parent / "tp1.lock", "w") as lock:
        if callspec is not None and callspec.params.get("tp") == 1:
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture
def no_cycle_collector():
    """The cycle collector off for the test (and back as it was after): what it frees must go by reference counts
    alone."""
    enabled = gc.isenabled()
    gc.disable()
    yield
    if enabled:
        gc.enable()
