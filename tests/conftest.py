import fcntl
import gc
import os
import time

import pytest
import torch

from kimi_decode.kernels.cute_common import env_int


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# GPU tests at once under pytest-xdist: 9 workers ran the latency_specialized GPU file on one 80 GB H100 (NOTES item
# 124); more workers (`-n auto` on a machine of many cores) wait for a slot instead of adding to the card's load. At
# least 1: with none, no GPU test would ever start.
GPU_SLOTS = env_int("KIMI_TEST_GPU_SLOTS", 9, 1, 1024, "the GPU tests at once")
SLOT_POLL_S = 0.05


def _take_gpu_slot(shared, first: int):
    """An open, locked slot file of the GPU_SLOTS in `shared`: the first free one from slot `first` on, waiting while
    all are held. Any free slot will do, so a test waits only while GPU_SLOTS others run (with one slot per worker,
    modulo GPU_SLOTS, a worker waited on its partner's long compile beside free slots: NOTES item 125)."""
    while True:
        for i in range(GPU_SLOTS):
            f = open(shared / f"gpu_slot{(first + i) % GPU_SLOTS}.lock", "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return f
            except BlockingIOError:
                f.close()
        time.sleep(SLOT_POLL_S)


@pytest.fixture(autouse=True)
def _one_card_shared(request, tmp_path_factory):
    """Under pytest-xdist the workers share one card. A GPU test holds one of GPU_SLOTS slots, so that at most
    GPU_SLOTS run at once; a GPU test of an unsharded (TP1) layer, over 30 GiB, also holds the TP1 lock, so that those
    run one at a time. After each GPU test its worker hands its cached blocks back, so that one test's peak does not
    stay reserved while the other workers need the memory. The locks are files that the workers share, always taken
    in the same order (slot, then TP1)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or "gpu" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    callspec = getattr(request.node, "callspec", None)
    tp1 = callspec is not None and callspec.params.get("tp") == 1
    shared = tmp_path_factory.getbasetemp().parent
    with _take_gpu_slot(shared, int(worker[2:])), open(shared / "tp1.lock", "w") as tp1_lock:
        if tp1:
            fcntl.flock(tp1_lock, fcntl.LOCK_EX)
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
