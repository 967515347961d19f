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


def _seconds(
    env: Env,
    seconds: int,
    cores: dict[int, float],
    entered: bool = False,
    *,
    late: frozenset[int] = frozenset({3}),
    in_compile: frozenset[int] = frozenset(),
    io_mib_s: dict[int, float] | None = None,
) -> None:
    """Heartbeats, one a second: the `late` ranks not entered in collective SEQ
    (or, with `entered`, inside it too), the others inside it; each rank burns
    `cores` of CPU (0 if absent); `in_compile` as the agents' stack samples say;
    each rank moves `io_mib_s` MiB a second to or from storage (0 if absent)."""
    cpu: dict[int, float] = env.__dict__.setdefault("cpu_s", {r: 1.0 for r in range(4)})
    if not env.__dict__.setdefault("entered_at_start", False):
        # The waiting ranks sat down in SEQ as the job registered: the stall's
        # clock starts there, as the group's (no CPU sample yet: unknown).
        env.__dict__["entered_at_start"] = True
        seqs = {r: (SEQ - 1, SEQ - 1) if r in late else (SEQ, SEQ - 1) for r in range(4)}
        env.a.report({r: seqs[r] for r in (0, 1)})
        env.b.report({r: seqs[r] for r in (2, 3)})
    for _ in range(seconds):
        env.clock.advance(1.0)
        for r in range(4):
            cpu[r] += cores.get(r, 0.0)
        ns = {r: int(cpu[r] * 1e9) for r in range(4)}
        io: dict[int, int] = env.__dict__.setdefault("io_bytes", {r: 0 for r in range(4)})
        for r in range(4):
            io[r] += int((io_mib_s or {}).get(r, 0.0) * (1 << 20))
        seqs = {
            r: (SEQ - 1, SEQ - 1) if r in late and not entered else (SEQ, SEQ - 1) for r in range(4)
        }
        kw = {"cpu_ns": ns, "in_compile": in_compile, "io_bytes": dict(io)}
        env.a.report({r: seqs[r] for r in (0, 1)}, **kw)
        env.b.report({r: seqs[r] for r in (2, 3)}, **kw)
        env.manager.tick()


def _paged_at_the_bound(reason: str, who: str) -> None:
    assert reason.endswith(
        f"no progress for {BUSY_BOUND:.1f}s, {who} all along, "
        f"past the {BUSY_BOUND:.0f}s bound for busy ranks"
    ), reason


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
    _paged_at_the_bound(row.reason, "ranks 3 busy on a CPU or storage")


@pytest.mark.timeout(20)
def test_a_laggard_writing_a_checkpoint_to_slow_storage_is_work(env: Env) -> None:
    """Rank 3 writes a checkpoint to a network filesystem while its peers wait
    in the next all_reduce: a twentieth of a core, 40 MiB/s to storage. Working:
    paged at the bound for busy ranks, not at the stall timeout. The same rank
    with a logging thread's trickle (16 KiB/s) is idle."""
    _seconds(env, int(BUSY_BOUND) - 1, {3: 0.05}, io_mib_s={3: 40.0})
    assert env.store.list_incidents() == []
    [st] = env.registry.stalls(JOB)
    assert (st.busy_ranks, st.timeout_s) == ([3], BUSY_BOUND)
    _seconds(env, 1, {3: 0.05}, io_mib_s={3: 40.0})
    _paged_at_the_bound(env.only_incident().reason, "ranks 3 busy on a CPU or storage")


@pytest.mark.timeout(20)
def test_a_trickle_of_storage_io_is_idle(env: Env) -> None:
    _seconds(env, int(STALL), {3: 0.05}, io_mib_s={3: 1 / 64})
    row = env.only_incident()
    assert "busy" not in row.reason, row.reason
    assert row.reason.endswith(f"no progress for {STALL:.1f}s"), row.reason


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


@pytest.mark.timeout(20)
def test_a_laggard_waiting_on_a_peers_compile_is_work_until_the_bound(env: Env) -> None:
    """Ranks 2 and 3 share a compile cache: rank 2 compiles (its compile workers
    on a CPU), rank 3 waits, idle, on the cache's lock; its agent's stack sample
    says torch.compile. Both are working: paged at the bound, not the stall timeout."""
    late, compiling = frozenset({2, 3}), frozenset({3})
    _seconds(env, int(BUSY_BOUND) - 1, {2: 1.0}, late=late, in_compile=compiling)
    assert env.store.list_incidents() == []
    [st] = env.registry.stalls(JOB)
    assert (st.busy_ranks, st.compiling_ranks, st.timeout_s) == ([2, 3], [3], BUSY_BOUND)
    _seconds(env, 1, {2: 1.0}, late=late, in_compile=compiling)
    _paged_at_the_bound(
        env.only_incident().reason,
        "ranks 2 busy on a CPU or storage and ranks 3 inside torch.compile",
    )


@pytest.mark.timeout(20)
def test_a_compile_with_nobody_working_is_paged_at_the_stall_timeout(env: Env) -> None:
    """Every not-entered rank inside torch.compile, and no rank of the job on a
    CPU: nobody is compiling for them, so the compile itself is hung."""
    late = frozenset({2, 3})
    _seconds(env, int(STALL), {}, late=late, in_compile=late)
    row = env.only_incident()
    assert "busy" not in row.reason and "compile" not in row.reason, row.reason
    assert row.reason.endswith(f"no progress for {STALL:.1f}s"), row.reason
