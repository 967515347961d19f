"""meta.json member lists: long strided groups travel as ranges."""

from __future__ import annotations

import pytest

from hangwatch.formats import COMPACT_RANKS_ABOVE, MAX_RANKS, compact_ranks, expand_ranks


@pytest.mark.parametrize(
    "ranks",
    [
        list(range(4096)),  # the world group
        list(range(3, 4096, 32)),  # a data-parallel group
        list(range(COMPACT_RANKS_ABOVE + 1)),
    ],
)
def test_strided_groups_round_trip_as_ranges(ranks: list[int]) -> None:
    packed = compact_ranks(ranks)
    assert isinstance(packed, dict)
    assert expand_ranks(packed) == ranks


@pytest.mark.parametrize(
    "ranks",
    [
        list(range(8)),  # small groups stay lists: self-describing, cheap
        [*range(100), 200],  # not evenly strided
        list(range(100, 0, -1)),  # descending: kept as written
    ],
)
def test_other_groups_stay_lists(ranks: list[int]) -> None:
    assert compact_ranks(ranks) == ranks
    assert expand_ranks(ranks) == ranks


@pytest.mark.parametrize(
    "value",
    [
        {"start": 0, "stop": 10, "step": 0},
        {"start": 0, "stop": 10, "step": -1},
        {"start": -5, "stop": 10, "step": 1},
        {"start": 0, "stop": MAX_RANKS * 4, "step": 1},  # a memory bomb, not a job
        {"start": 0, "stop": "10", "step": 1},
        {"start": True, "stop": 10, "step": 1},
        {"stop": 10},
        "0-10",
        None,
    ],
)
def test_hostile_or_odd_values_expand_to_nothing(value: object) -> None:
    assert expand_ranks(value) is None
