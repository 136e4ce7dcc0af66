"""The min-cut heuristic's one-pass helpers give what the per-window scans gave."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from passes.cuts import Frontiers
from passes.heuristics import groups_from_windows


def groups_from_cuts(ops: Sequence[str], befores: Sequence[set[str]]) -> list[tuple[list[str], bool]]:
    """The reference the one-pass sweep replaced: segments ``(nodes, recompute)`` from nested
    before-sets, all recomputed but the last."""
    groups, done = [], set()
    for before in befores:
        groups.append(([n for n in ops if n in before and n not in done], True))
        done |= before
    groups.append(([n for n in ops if n not in done], False))
    return groups


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_frontiers_are_the_values_open_at_each_position(data: st.DataObject) -> None:
    count = data.draw(st.integers(1, 30))
    position = {f"v{i}": data.draw(st.integers(-1, count)) for i in range(count)}
    last = {name: data.draw(st.integers(pos, count + 1)) for name, pos in position.items()}
    lows = sorted(data.draw(st.lists(st.integers(0, count + 1), max_size=8)))
    frontiers = Frontiers(position, last)
    for low in lows:
        assert frontiers.at(low) == [n for n, pos in position.items() if pos < low <= last[n]]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_groups_from_windows_are_the_groups_of_the_before_sets(data: st.DataObject) -> None:
    ops = [f"op{i}" for i in range(data.draw(st.integers(1, 40)))]
    bounds = sorted(set(data.draw(st.lists(st.integers(0, len(ops)), max_size=10))))
    cuts = []
    for low, high in zip(bounds[::2], bounds[1::2], strict=False):
        window = ops[low:high]
        cuts.append((low, set(data.draw(st.lists(st.sampled_from(window), max_size=len(window))) if window else [])))
    befores = [set(ops[:low]) | found for low, found in cuts]
    assert groups_from_windows(ops, cuts) == groups_from_cuts(ops, befores)
