"""Backends: tables of stage implementations. `auto` is the generic path every other backend falls back to."""
from __future__ import annotations

from .auto import AutoBackend
from .latency_specialized import LatencySpecializedBackend

BACKENDS = {"auto": AutoBackend, "latency_specialized": LatencySpecializedBackend}


def backend_class(name: str) -> type[AutoBackend]:
    """The backend class of that name; ValueError naming the available ones otherwise."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(sorted(BACKENDS))}") from None


def get_backend(name: str, **kwargs) -> AutoBackend:
    """A new backend by name; every configuration runs (a backend falls back to `auto` stage by stage)."""
    return backend_class(name)(**kwargs)
