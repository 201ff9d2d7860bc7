"""Property tests of the interval arithmetic and of innermost-range attribution against brute force."""
from __future__ import annotations

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzers.attribution import innermost_ranges, range_nesting
from analyzers.intervals import (intersection, intersection_length, merge, union_length,
                                 union_length_by_group)

HORIZON = 60
intervals = st.lists(st.tuples(st.integers(0, HORIZON), st.integers(0, HORIZON)), max_size=25)


def _arrays(pairs):
    starts = np.array([a for a, _ in pairs], dtype=np.int64)
    ends = np.array([b for _, b in pairs], dtype=np.int64)
    return starts, ends


def _covered(pairs) -> np.ndarray:
    """Which unit cells [t, t+1) of the horizon the intervals cover."""
    cells = np.zeros(HORIZON, dtype=bool)
    for start, end in pairs:
        cells[start:end] = True
    return cells


@given(intervals)
def test_merge_gives_sorted_disjoint_intervals_covering_the_same_cells(pairs):
    starts, ends = merge(*_arrays(pairs))
    assert np.all(ends > starts)
    assert np.all(starts[1:] > ends[:-1])  # sorted, disjoint and not touching
    assert np.array_equal(_covered(zip(starts, ends)), _covered(pairs))
    assert union_length(*_arrays(pairs)) == _covered(pairs).sum()


@given(intervals, intervals)
def test_intersection_covers_exactly_the_cells_both_cover(a, b):
    starts, ends = intersection(*_arrays(a), *_arrays(b))
    assert np.all(ends > starts) and np.all(starts[1:] >= ends[:-1])
    expected = _covered(a) & _covered(b)
    assert np.array_equal(_covered(zip(starts, ends)), expected)
    assert intersection_length(*_arrays(a), *_arrays(b)) == expected.sum()


@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, HORIZON), st.integers(0, HORIZON)), max_size=40))
def test_union_length_by_group_matches_each_group_alone(rows):
    groups = np.array([g for g, _, _ in rows], dtype=np.int64)
    starts = np.array([s for _, s, _ in rows], dtype=np.int64)
    ends = np.array([e for _, _, e in rows], dtype=np.int64)
    lengths = union_length_by_group(groups, starts, ends, n_groups=5)
    for group in range(5):
        mine = groups == group
        assert lengths[group] == union_length(starts[mine], ends[mine])


def test_touching_intervals_merge_and_empty_ones_vanish():
    starts, ends = merge([0, 5, 9, 20, 30], [5, 8, 9, 10, 31])
    assert starts.tolist() == [0, 30] and ends.tolist() == [8, 31]
    assert union_length([], []) == 0


ranges_strategy = st.lists(
    st.tuples(st.integers(0, 1), st.integers(0, 40), st.integers(0, 40)).map(lambda r: (r[0], min(r[1:]), max(r[1:]))),
    max_size=20)
calls_strategy = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(0, 3)).map(lambda c: (c[0], c[1], c[1] + c[2])),
    min_size=1, max_size=20)


def _frame(rows):
    return pd.DataFrame(rows, columns=["tid", "start_ns", "end_ns"]).assign(pid=1).astype("int64")


@settings(max_examples=300)
@given(ranges_strategy, calls_strategy)
def test_innermost_range_is_the_latest_starting_enclosing_range(ranges, calls):
    # Ranges may overlap without nesting (NVTX start/end ranges); the innermost is the latest-starting enclosing
    # range, ties going to the shorter one, then to the later row.
    ranges_frame, calls_frame = _frame(ranges), _frame(calls)
    found = innermost_ranges(ranges_frame, calls_frame)
    for i, (tid, start, end) in enumerate(calls):
        enclosing = [j for j, (rt, rs, re) in enumerate(ranges) if rt == tid and rs <= start and end <= re]
        if not enclosing:
            assert found[i] == -1
            continue
        best = max(enclosing, key=lambda j: (ranges[j][1], -ranges[j][2], j))
        got = found[i]
        assert got in enclosing
        assert (ranges[got][1], ranges[got][2]) == (ranges[best][1], ranges[best][2])


@given(ranges_strategy)
def test_range_parent_is_the_innermost_other_range_enclosing_it(ranges):
    frame = _frame(ranges)
    parent, depth = range_nesting(frame)
    for i, (tid, start, end) in enumerate(ranges):
        if parent[i] == -1:
            assert depth[i] == 0
            continue
        p = parent[i]
        assert ranges[p][0] == tid and ranges[p][1] <= start and end <= ranges[p][2] and p != i
        assert depth[i] == depth[p] + 1
