import gc
import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # Under `pytest -n N --dist loadgroup` the GPU tests of unsharded (TP1) layers, over 30 GiB each, run one
        # after another on one worker instead of side by side on one card.
        for item in items:
            if "gpu" in item.keywords and getattr(item, "callspec", None) and item.callspec.params.get("tp") == 1:
                item.add_marker(pytest.mark.xdist_group("tp1"))
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_cache_released(request):
    """Under pytest-xdist the workers share one card: after each GPU test its worker hands its cached blocks back,
    so that one test's peak does not stay reserved while the other workers need the memory."""
    yield
    if "gpu" in request.keywords and os.environ.get("PYTEST_XDIST_WORKER") and torch.cuda.is_available():
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
