"""What the live registry forgets when it must, and who is told."""

from __future__ import annotations

import pytest
from hangwatch.server.live import registry as registry_module
from hangwatch.server.live.registry import JobRegistry

from hangwatch.wire import pb
from tests.server.conftest import rank_infos


@pytest.mark.timeout(30)
def test_an_evicted_jobs_command_streams_are_woken_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry forgets the oldest idle job past MAX_JOBS: its agents' command
    streams are woken then, to find their session gone, rather than at their
    next backstop re-check (STREAM_RECHECK_S)."""
    monkeypatch.setattr(registry_module, "MAX_JOBS", 2)
    reg = JobRegistry(stall_timeout=5.0, agent_lost_timeout=30.0, clock=lambda: 100.0)
    woken: list[str] = []
    for job in ("old", "mid"):
        sid = reg.register(
            pb.RegisterRequest(job_id=job, agent_id="a", host="h", ranks=rank_infos([0], 1))
        )
        reg.add_waker(sid, job, "a", lambda job=job: woken.append(job))
    assert woken == []
    reg.register(pb.RegisterRequest(job_id="new", agent_id="a", host="h", ranks=rank_infos([0], 1)))
    assert woken == ["old"]
    assert reg.jobs() == ["mid", "new"]
