"""An agent and ranks started with different job ids: said once per rank, not silently merged."""

from __future__ import annotations

import logging
import time

import pytest
from hangwatch.agent.service import Agent

from hangwatch.config import Config
from tests.agent.live_ranks import Job

pytestmark = pytest.mark.torch


@pytest.mark.timeout(60)
def test_a_rank_of_another_job_id_is_named_once(
    hang_job: Job, caplog: pytest.LogCaptureFixture
) -> None:
    said = {int(i["rank"]): i["job_id"] for i in hang_job.rankinfo().values()}
    assert set(said) == {0, 1} and all(j != "myjob" for j in said.values()), said
    agent = Agent(
        Config.of(run_dir=str(hang_job.run_dir), job_id="myjob", coordinator="127.0.0.1:1")
    )
    try:
        with caplog.at_level(logging.WARNING, logger="hangwatch"):
            agent.discover(time.monotonic())
            agent.discover(time.monotonic())  # once per rank, not per scan
    finally:
        agent.client.close()
    lines = [r.getMessage() for r in caplog.records if "says job" in r.getMessage()]
    assert sorted(lines) == [
        f"rank {r} (pid {hang_job.pid(r)}) says job {said[r]!r}, this agent reports job 'myjob': "
        "give `hangwatch run` and the agent the same --job-id"
        for r in (0, 1)
    ], lines
