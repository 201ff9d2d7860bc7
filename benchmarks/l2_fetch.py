"""Run a module with the CUDA context's L2 fetch granularity set (the driver's CU_LIMIT_MAX_L2_FETCH_GRANULARITY:
how many bytes the L2 asks of DRAM for one missed 32-byte sector, 0 to 128), printing the value before and after.

    python benchmarks/l2_fetch.py BYTES MODULE [ARGS ...]
    python benchmarks/l2_fetch.py 32 kimi_decode.bench --backend latency_specialized --tp 16 --batch 8

The limit is a hint the driver may round or ignore; the printed value after setting it is what the context holds.
It matters for kernels that read part of each 128-byte line: a padded TP16 w2 row uses 96 of its 128 bytes, and a
64-byte fetch brings the fourth sector along.
"""
from __future__ import annotations

import ctypes
import runpy
import sys

import torch

CU_LIMIT_MAX_L2_FETCH_GRANULARITY = 0x05


def _limit(driver) -> int:
    value = ctypes.c_size_t()
    rc = driver.cuCtxGetLimit(ctypes.byref(value), CU_LIMIT_MAX_L2_FETCH_GRANULARITY)
    if rc:
        raise SystemExit(f"l2_fetch: cuCtxGetLimit failed with CUresult {rc}")
    return value.value


def main() -> None:
    if len(sys.argv) < 3 or not sys.argv[1].isdigit() or int(sys.argv[1]) > 128:
        raise SystemExit("usage: l2_fetch.py BYTES(0-128) MODULE [ARGS ...]")
    want, module = int(sys.argv[1]), sys.argv[2]
    if not torch.cuda.is_available():
        raise SystemExit("l2_fetch: no CUDA device")
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    driver = ctypes.CDLL("libcuda.so.1")
    before = _limit(driver)
    rc = driver.cuCtxSetLimit(CU_LIMIT_MAX_L2_FETCH_GRANULARITY, ctypes.c_size_t(want))
    if rc:
        raise SystemExit(f"l2_fetch: cuCtxSetLimit({want}) failed with CUresult {rc}")
    print(f"l2_fetch: L2 fetch granularity {before} -> {_limit(driver)} bytes", flush=True)
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
