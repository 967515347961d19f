"""A stall whose lagging rank is working, on the fake clock: rank 0 evaluating or
writing a checkpoint while its peers wait in a barrier is not paged at the stall
timeout, only at the bound for busy ranks (QUIET_BOUND_FACTOR stall timeouts);
an idle laggard still is, and one that stops working is within a CPU window.

The real registry, incident manager and SQLite store with test_fake_clock's
harness (agents played by feeding real protobuf messages to the registry).
"""

from __future__ import annotations

import pytest
from hangwatch.server.live.detector import BUSY_CORES, QUIET_BOUND_FACTOR

from . import test_fake_clock
from .test_fake_clock import JOB, STALL, Env

env = test_fake_clock.env  # its fixture: real registry, manager and store on a FakeClock

SEQ = 5
BUSY_BOUND = QUIET_BOUND_FACTOR * STALL


def _seconds(env: Env, seconds: int, cores: dict[int, float], entered: bool = False) -> None:
    """Heartbeats, one a second: ranks 0-2 inside collective SEQ, rank 3 not entered
    (or, with `entered`, inside it too); each rank burns `cores` of CPU (0 if absent)."""
    cpu: dict[int, float] = env.__dict__.setdefault("cpu_s", {r: 1.0 for r in range(4)})
    for _ in range(seconds):
        env.clock.advance(1.0)
        for r in range(4):
            cpu[r] += cores.get(r, 0.0)
        ns = {r: int(cpu[r] * 1e9) for r in range(4)}
        late = (SEQ, SEQ - 1) if entered else (SEQ - 1, SEQ - 1)
        env.a.report({0: (SEQ, SEQ - 1), 1: (SEQ, SEQ - 1)}, cpu_ns=ns)
        env.b.report({2: (SEQ, SEQ - 1), 3: late}, cpu_ns=ns)
        env.manager.tick()


@pytest.mark.timeout(20)
def test_a_busy_laggard_is_paged_at_the_bound_not_the_stall_timeout(env: Env) -> None:
    _seconds(env, int(BUSY_BOUND) - 1, {3: 1.0})
    assert env.store.list_incidents() == []
    [st] = env.registry.stalls(JOB)
    assert (st.busy_ranks, st.timeout_s, st.over_timeout) == ([3], BUSY_BOUND, False)
    _seconds(env, 1, {3: 1.0})
    row = env.only_incident()
    assert row.trigger == "stall"
    assert row.reason.startswith("group 0 stalled at seq 5 (all_reduce): ranks 0-2 waiting, ")
    assert row.reason.endswith(
        f"no progress for {BUSY_BOUND:.1f}s, ranks 3 busy on a CPU all along, "
        f"past the {BUSY_BOUND:.0f}s bound for busy ranks"
    ), row.reason


@pytest.mark.timeout(20)
def test_an_idle_laggard_is_paged_at_the_stall_timeout(env: Env) -> None:
    """A trickle of CPU (a rank blocked elsewhere still wakes now and then) is idle."""
    _seconds(env, int(STALL), {3: BUSY_CORES / 5, 0: 1.0})
    row = env.only_incident()
    assert "busy" not in row.reason, row.reason
    assert row.reason.endswith(f"no progress for {STALL:.1f}s"), row.reason


@pytest.mark.timeout(20)
def test_a_laggard_that_stops_working_is_paged_within_a_window(env: Env) -> None:
    """Rank 3 computes, then blocks (a real hang after some work): once its CPU
    window shows it idle, the stall is judged by the stall timeout again."""
    _seconds(env, int(STALL) + 2, {3: 1.0})
    assert env.store.list_incidents() == []
    # The window spans half to one and a half stall timeouts: idle within that.
    waited = 0
    while not env.store.list_incidents() and waited <= 1.5 * STALL + 1:
        _seconds(env, 1, {})
        waited += 1
    assert env.only_incident().trigger == "stall"
    assert int(STALL) + 2 + waited < BUSY_BOUND, waited


@pytest.mark.timeout(20)
def test_a_slow_evaluation_that_ends_raises_nothing(env: Env) -> None:
    """Rank 3 evaluates for two stall timeouts, then enters the barrier; the
    collective completes and training goes on: nothing opened, nothing stalled."""
    _seconds(env, int(2 * STALL), {3: 1.0})
    _seconds(env, 1, {3: 1.0}, entered=True)
    for _ in range(int(BUSY_BOUND)):
        env.clock.advance(1.0)
        env.a.report({0: (SEQ, SEQ), 1: (SEQ, SEQ)})
        env.b.report({2: (SEQ, SEQ), 3: (SEQ, SEQ)})
        env.manager.tick()
    assert env.store.list_incidents() == []
    assert env.registry.stalls(JOB) == []
