"""One rank formatter for the analyzer, the incident reasons, webhooks and the dashboard."""

from __future__ import annotations

import pytest

from hangwatch.rankspec import format_ranks, spans


@pytest.mark.timeout(10)
def test_runs_of_three_collapse_and_a_pair_reads_as_two_ranks() -> None:
    ranks = [10, 9, 7, 3, 2, 1, 0, 0]
    assert spans(ranks) == [(0, 3), (7, 7), (9, 10)]
    assert format_ranks(ranks) == "0-3,7,9,10"
    assert format_ranks([]) == "none"
    assert format_ranks([5]) == "5"


@pytest.mark.timeout(10)
def test_long_lists_are_capped_and_say_the_total() -> None:
    evens = range(0, 100, 2)
    assert format_ranks(evens, limit=3) == "0,2,4,... (50 ranks)"
    # Twelve runs by default (about a line of prose); 0 shows all.
    assert format_ranks(evens).endswith(",22,... (50 ranks)")
    assert format_ranks(evens, limit=0).count(",") == 49
    assert format_ranks(range(4096), limit=3) == "0-4095"
