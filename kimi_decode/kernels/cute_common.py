"""Shared host plumbing of the CuTe DSL kernels: availability, compile cache, torch tensors in, current stream.

Kernels are compiled once per shape key against fake tensors (so the same code path compiles for `sm_90a` on a
machine without a GPU), cached in-process, and launched on the current torch stream so CUDA graphs capture them.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

try:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack, make_fake_stream, make_fake_tensor

    try:
        from cuda.bindings import driver as cuda_driver
    except ImportError:  # older cuda-python layout
        from cuda import cuda as cuda_driver
    HAVE_CUTE = True
except ImportError:  # the `kernels` extra is not installed
    cutlass = cute = cuda_driver = None
    HAVE_CUTE = False

_TORCH_TO_CUTE = {}
if HAVE_CUTE:
    _TORCH_TO_CUTE = {torch.bfloat16: cutlass.BFloat16, torch.float32: cutlass.Float32,
                      torch.float16: cutlass.Float16, torch.int32: cutlass.Int32, torch.uint8: cutlass.Uint8}

_cache: dict[tuple, Callable] = {}


def cute_dtype(dtype: torch.dtype):
    return _TORCH_TO_CUTE[dtype]


def fake_like(t: torch.Tensor, align: int = 16):
    """A fake CuTe tensor with `t`'s dtype, shape and strides (static), for compiling without data."""
    return make_fake_tensor(cute_dtype(t.dtype), tuple(t.shape), stride=tuple(t.stride()), assumed_align=align)


def signature(*tensors: torch.Tensor) -> tuple:
    return tuple((t.dtype, tuple(t.shape), tuple(t.stride())) for t in tensors)


def target_arch() -> str | None:
    """`--gpu-arch` for cross-compiling (CI: KIMI_DECODE_CUTE_ARCH=sm_90a); None compiles for the GPU in use."""
    return os.environ.get("KIMI_DECODE_CUTE_ARCH")


def compile_kernel(key: tuple, op, *fake_args):
    """Compile `op` for `fake_args` once per `key` (cached in-process)."""
    fn = _cache.get(key)
    if fn is None:
        arch = target_arch()
        opts = {"options": f"--gpu-arch {arch}"} if arch else {}
        fn = _cache[key] = cute.compile(op, *fake_args, make_fake_stream(), **opts)
    return fn


def launch(fn, *tensors: torch.Tensor, align: int = 16) -> None:
    """Run a compiled kernel on torch tensors, on the current torch stream (capturable by CUDA graphs).

    `align` must be the alignment the kernel was compiled for (see `fake_like`).
    """
    stream = cuda_driver.CUstream(torch.cuda.current_stream().cuda_stream)
    fn(*(from_dlpack(t, assumed_align=align) for t in tensors), stream)
