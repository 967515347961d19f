"""The agent's quiet-period stack sample (agent/quietstack.py) on real gloo ranks under the hook.

Rank 1 runs torch.compile with a backend that waits on a file lock the test
holds, as inductor's builds wait on their cache's lock while another rank
compiles; rank 0 waits for it in all_reduce. Time passes on the `now` the
poller is given, not on sleeps.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from filelock import FileLock
from hangwatch.agent import quietstack
from hangwatch.agent.delta import signature
from hangwatch.agent.ranks import GroupState, RankTracker, poll_rank

from hangwatch.formats import RankInfo
from tests.agent.live_ranks import start_job

pytestmark = pytest.mark.torch


def _poll(ts: dict[int, RankTracker], now: float) -> None:
    for t in ts.values():
        poll_rank(t, now, entries_after_s=60.0)
        quietstack.sample(t, now)


@pytest.mark.timeout(120)
def test_a_rank_waiting_on_a_compile_lock_is_in_compile_and_its_blocked_peer_is_not(
    tmp_path: Path,
) -> None:
    (tmp_path / "run").mkdir()
    lock = FileLock(str(tmp_path / "run" / "compile.lock"))
    lock.acquire()
    job = start_job(tmp_path, mode="compile")
    try:
        job.wait_ready()
        ts = job.trackers()
        start = time.monotonic()
        _poll(ts, start)
        # Each round is one resample period later on the poller's clock, so
        # every round samples; rank 1 is in the backend once dynamo has traced.
        now, deadline = start, time.monotonic() + 60
        while not ts[1].in_compile:
            assert time.monotonic() < deadline, f"rank 1 never read in compile\n{job.output()}"
            now += quietstack.RESAMPLE_S
            _poll(ts, now)
            time.sleep(0.2)
        assert ts[0].in_compile is False  # blocked in all_reduce: a collective, not a compile
        rp = ts[1].progress_pb(now)
        assert rp.in_compile and signature(rp) != signature(ts[0].progress_pb(now))

        # Not due again within RESAMPLE_S: no request is made.
        sampled = ts[1].stack_sampled_at
        quietstack.sample(ts[1], now + quietstack.RESAMPLE_S / 2)
        assert ts[1].stack_sampled_at == sampled

        # The lock is freed: rank 1 compiles, both finish the all_reduce, their
        # counters move, and the flag clears on the poll that sees the move.
        lock.release()
        deadline = time.monotonic() + 60
        while "COMPILED" not in job.logs[1].read_text(errors="replace"):
            assert time.monotonic() < deadline, job.output()
            time.sleep(0.1)
        now += quietstack.RESAMPLE_S
        _poll(ts, now)
        assert not ts[1].in_compile and not ts[1].progress_pb(now).in_compile
    finally:
        if lock.is_locked:
            lock.release()
        job.close()


def test_a_rank_is_not_sampled_while_its_counters_move() -> None:
    t = RankTracker(
        info=RankInfo(rank=0, world_size=1, pid=1, socket="/nonexistent.sock"),
        rankinfo_path="",
        rankinfo_mtime=0.0,
    )
    t.groups["0"] = GroupState(name="0", completed_changed_at=100.0, enqueued_changed_at=100.0)
    t.in_compile = True
    quietstack.sample(t, 100.0 + quietstack.QUIET_AFTER_S / 2)
    assert t.in_compile is False and t.stack_sampled_at == float("-inf")
