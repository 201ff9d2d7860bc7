"""CUDA streams kept for the life of the process, one per device, purpose and priority (the slices' warm-up
stream, the specialized backend's branch streams).

torch keeps a cuBLAS workspace (32 MiB on Hopper) for each stream that has run a cuBLAS call, until the process
ends, so a stream made per slice holds one more workspace with every slice built: a bench of many configurations in
one process grew by that much per configuration (benchmarks/NOTES.md, item 119).
"""
from __future__ import annotations

import functools

import torch


def process_stream(device: torch.device | str, name: str, priority: int = 0) -> torch.cuda.Stream:
    """The process's stream `name` on `device` (the current CUDA device where it names no index), made the first
    time it is asked for, at `priority` (lower runs first; one stream per device, name and priority)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    return _stream(device, name, priority)


@functools.cache
def _stream(device: torch.device, name: str, priority: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device, priority=priority)
