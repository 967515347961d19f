"""A rank whose Python handlers miss a status poll is asked again within seconds.

A real gloo rank holds its GIL in one C call for 3 s (rankjob.py's `gil`
mode), so the agent's status requests time out as they do for a rank starved
of CPU. Time passes on the `now` the poller is given, not on sleeps; the only
real waits are for the rank to start and end the hold.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hangwatch.agent import quietstack
from hangwatch.agent.ranks import PYTHON_RETRY_QUICK_S, PYTHON_RETRY_S, RankTracker, poll_rank

from tests.agent.live_ranks import Job, start_job

pytestmark = pytest.mark.torch

CULPRIT = 1


def _wait_output(job: Job, rank: int, text: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while job.logs[rank].read_text(errors="replace").count(text) < count:
        assert time.monotonic() < deadline, f"no {text!r} from rank {rank}\n{job.output()}"
        time.sleep(0.05)


def _poll(t: RankTracker, now: float) -> None:
    poll_rank(t, now, entries_after_s=60.0)


@pytest.mark.timeout(120)
def test_a_missed_status_poll_is_retried_in_seconds_then_rarely(tmp_path: Path) -> None:
    job = start_job(tmp_path, mode="gil", extra=("--culprit", str(CULPRIT), "--hold-s", "3"))
    try:
        job.wait_ready()
        t = job.trackers()[CULPRIT]
        now = time.monotonic()
        _poll(t, now)
        assert t.python_ok, job.output()

        # Two polls while the GIL is held: both time out, the second one
        # asked PYTHON_RETRY_QUICK_S[0] later on the poller's clock.
        (job.run_dir / "hold_gil").touch()
        _wait_output(job, CULPRIT, "HOLDING", 1)
        _poll(t, now)
        assert not t.python_ok and t.python_failures == 1
        assert t.python_retry_at == now + PYTHON_RETRY_QUICK_S[0]
        now += PYTHON_RETRY_QUICK_S[0]
        _poll(t, now)
        assert t.python_failures == 2, "the retry was not made"
        assert t.python_retry_at == now + PYTHON_RETRY_QUICK_S[1]
        _wait_output(job, CULPRIT, "RELEASED", 1)

        # Not asked before it is due, though it would answer now; and the
        # quiet-period stack sample waits with it.
        _poll(t, now + PYTHON_RETRY_QUICK_S[1] - 0.5)
        assert not t.python_ok and t.python_failures == 2
        never = t.stack_sampled_at
        quietstack.sample(t, now + PYTHON_RETRY_QUICK_S[1] - 0.5)
        assert t.stack_sampled_at == never
        now += PYTHON_RETRY_QUICK_S[1]
        _poll(t, now)
        assert t.python_ok and t.python_failures == 0, job.output()
        quietstack.sample(t, now)
        assert t.stack_sampled_at == now and not t.in_compile

        # Held again for good measure: the quick retries start over, and past
        # them a rank that keeps missing is asked every PYTHON_RETRY_S.
        (job.run_dir / "hold_gil").touch()
        _wait_output(job, CULPRIT, "HOLDING", 2)
        for wait in [*PYTHON_RETRY_QUICK_S, PYTHON_RETRY_S]:
            _poll(t, now)
            assert t.python_retry_at == now + wait
            now += wait
        _wait_output(job, CULPRIT, "RELEASED", 2)
        _poll(t, now)
        assert t.python_ok and t.python_failures == 0, job.output()
    finally:
        job.close()
