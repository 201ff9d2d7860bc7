"""Vectorised arithmetic on sets of half-open time intervals ``[start, end)``.

All functions take and return ``int64`` numpy arrays (nanoseconds in the trace model). An interval whose end is
not after its start is empty and ignored. Touching intervals (``[0, 5)`` and ``[5, 8)``) merge into one.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

_EMPTY = np.empty(0, dtype=np.int64)


def _as_int64(starts, ends) -> tuple[np.ndarray, np.ndarray]:
    starts = np.asarray(starts, dtype=np.int64).ravel()
    ends = np.asarray(ends, dtype=np.int64).ravel()
    if starts.shape != ends.shape:
        raise ValueError(f"starts and ends differ in length: {starts.size} != {ends.size}")
    keep = ends > starts
    return starts[keep], ends[keep]


def merge(starts, ends) -> tuple[np.ndarray, np.ndarray]:
    """The union of the intervals, as sorted, disjoint, non-touching intervals ``(starts, ends)``."""
    starts, ends = _as_int64(starts, ends)
    if starts.size == 0:
        return _EMPTY.copy(), _EMPTY.copy()
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    first = np.empty(starts.size, dtype=bool)
    first[0] = True
    first[1:] = starts[1:] > reach[:-1]
    heads = np.flatnonzero(first)
    tails = np.append(heads[1:] - 1, starts.size - 1)
    return starts[heads], reach[tails]


def union_length(starts, ends) -> int:
    """Total time covered by at least one interval."""
    merged_starts, merged_ends = merge(starts, ends)
    return int((merged_ends - merged_starts).sum())


def union_length_by_group(groups, starts, ends, n_groups: int | None = None) -> np.ndarray:
    """Covered time of each group's intervals: ``out[g]`` is the union length of the intervals with ``groups == g``.

    ``groups`` are non-negative integer codes (for example from ``DataFrame.groupby(...).ngroup()``); the result has
    ``n_groups`` entries (default: ``max(groups) + 1``), zero for groups without a non-empty interval.
    """
    groups = np.asarray(groups, dtype=np.int64).ravel()
    starts = np.asarray(starts, dtype=np.int64).ravel()
    ends = np.asarray(ends, dtype=np.int64).ravel()
    if not groups.size == starts.size == ends.size:
        raise ValueError("groups, starts and ends must have the same length")
    if n_groups is None:
        n_groups = int(groups.max()) + 1 if groups.size else 0
    out = np.zeros(n_groups, dtype=np.int64)
    g, s, e = merge_by_group(groups, starts, ends)
    np.add.at(out, g, e - s)
    return out


def merge_by_group(groups: np.ndarray, starts: np.ndarray, ends: np.ndarray):
    """Union of each group's intervals: (group, start, end) arrays of disjoint intervals, sorted by group, start.

    Empty intervals are dropped; ``groups`` are integer codes.
    """
    keep = ends > starts
    groups, starts, ends = groups[keep], starts[keep], ends[keep]
    if groups.size == 0:
        return groups, starts, ends
    order = np.lexsort((starts, groups))
    groups, starts, ends = groups[order], starts[order], ends[order]
    # The running maximum of ends restarts at each group: a segmented cummax.
    reach = pd.Series(ends).groupby(groups).cummax().to_numpy()
    first = np.empty(groups.size, dtype=bool)
    first[0] = True
    first[1:] = (groups[1:] != groups[:-1]) | (starts[1:] > reach[:-1])
    heads = np.flatnonzero(first)
    tails = np.append(heads[1:] - 1, groups.size - 1)
    return groups[heads], starts[heads], reach[tails]


def intersection(a_starts, a_ends, b_starts, b_ends) -> tuple[np.ndarray, np.ndarray]:
    """The time covered by both interval sets, as sorted, disjoint intervals ``(starts, ends)``."""
    a_starts, a_ends = merge(a_starts, a_ends)
    b_starts, b_ends = merge(b_starts, b_ends)
    if a_starts.size == 0 or b_starts.size == 0:
        return _EMPTY.copy(), _EMPTY.copy()
    times = np.concatenate([a_starts, b_starts, a_ends, b_ends])
    steps = np.concatenate([np.ones(a_starts.size + b_starts.size, dtype=np.int64),
                            -np.ones(a_ends.size + b_ends.size, dtype=np.int64)])
    # Ends sort before starts at the same time: the intervals are half-open.
    order = np.lexsort((steps, times))
    times, depth = times[order], np.cumsum(steps[order])
    both = np.flatnonzero(depth[:-1] == 2)
    starts, ends = times[both], times[both + 1]
    keep = ends > starts
    return starts[keep], ends[keep]


def intersection_length(a_starts, a_ends, b_starts, b_ends) -> int:
    """Total time covered by both interval sets."""
    starts, ends = intersection(a_starts, a_ends, b_starts, b_ends)
    return int((ends - starts).sum())
