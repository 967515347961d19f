"""Fixtures for the hook/agent tests: a module-wide hung 2-rank gloo job."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.agent.live_ranks import Job, start_job


@pytest.fixture(scope="module")
def hang_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    """Two real gloo ranks: after 5 steps rank 1 stops calling collectives; rank 0 blocks."""
    job = start_job(tmp_path_factory.mktemp("hang"), mode="hang")
    try:
        job.wait_ready()
        yield job
    finally:
        job.close()
