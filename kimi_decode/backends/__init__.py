"""Backends: tables of stage implementations. `auto` is the generic path every other backend falls back to."""
from __future__ import annotations

from .auto import AutoBackend
from .latency_specialized import LatencySpecializedBackend

BACKENDS = {"auto": AutoBackend, "latency_specialized": LatencySpecializedBackend}


def get_backend(name: str, **kwargs) -> AutoBackend:
    """A new backend by name; every configuration runs (a backend falls back to `auto` stage by stage)."""
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(sorted(BACKENDS))}") from None
    return cls(**kwargs)
