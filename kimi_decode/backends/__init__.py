"""Backends: tables of stage implementations. `auto` is the generic path every other backend falls back to."""
from __future__ import annotations

from ..config import ShardConfig
from .auto import AutoBackend
from .latency_specialized import LatencySpecializedBackend

BACKENDS = {"auto": AutoBackend, "latency_specialized": LatencySpecializedBackend}


def get_backend(name: str, shard: ShardConfig | None = None, batch: int = 1, **kwargs) -> AutoBackend:
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(sorted(BACKENDS))}") from None
    backend = cls(**kwargs)
    if shard is not None:
        reason = backend.unsupported_reason(shard, batch)
        if reason:
            raise ValueError(f"backend {name!r} cannot run this configuration: {reason}")
    return backend
