import gc

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_cycle_collector():
    """The cycle collector off for the test (and back as it was after): what it frees must go by reference counts
    alone."""
    enabled = gc.isenabled()
    gc.disable()
    yield
    if enabled:
        gc.enable()
