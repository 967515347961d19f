"""The coordinator's incident directory full or read-only while a real hang is diagnosed.

The incident bundles live under `<data_dir>/incidents`; here that directory
is a small tmpfs of its own (the SQLite store stays on the test's disk), so
the fault hits exactly the files that carry the dumps.

- full: the tmpfs is filled until only a few KB remain, enough for
  incident.json but not for the FR dumps. The coordinator keeps serving
  (gRPC Health, HTTP API), logs the failure, and the agent keeps its local
  copy (`<run_dir>/bundles/<incident>/`) and retries; once space is freed
  the dumps arrive and the incident is analysed with every rank.
- read-only: the tmpfs is remounted read-only before the hang. The
  coordinator keeps serving and marks the incident failed with the error.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.hardening.trainjob import TrainJob
from tests.hardening.util import all_connected, finished_incidents, tmpfs, wait_for
from tests.support.chaos import AgentProc, CoordinatorProc, TmpfsMount

pytestmark = [pytest.mark.torch]

SIZE = 4 * 1024 * 1024
LEAVE = 4096


def _dumps(rank_dir: Path) -> list[str]:
    """Names of the complete FR dump files in a bundle's rank dir (not `.part`)."""
    return [p.name for p in rank_dir.glob("fr_trace_rank_*") if not p.name.endswith(".part")]


def _collecting(coord: CoordinatorProc, job: str) -> list[dict[str, object]]:
    return [r for r in coord.api(f"/api/incidents?job={job}") if r["status"] == "collecting"]


@contextmanager
def _running(
    tmp_path: Path, job_id: str, dump_deadline: float
) -> Iterator[tuple[TmpfsMount, CoordinatorProc, AgentProc, TrainJob]]:
    """A coordinator whose incident dir is a small tmpfs, one agent on `<tmp>/run` and a
    2-rank job (culprit rank 1) with both ranks registered; all torn down on exit."""
    mnt = tmpfs(tmp_path / "data" / "incidents", SIZE)
    coord = CoordinatorProc(tmp_path / "data", stall_timeout=2.0, dump_deadline=dump_deadline)
    run = tmp_path / "run"
    agent = AgentProc(
        coordinator=coord.grpc, run_dir=run, job_id=job_id, node_id="node-a",
        log_path=tmp_path / "agent.log",
    )  # fmt: skip
    job = TrainJob(tmp_path, world=2, run_dirs=[run, run], job_id=job_id, culprit=1)
    try:
        coord.start()
        agent.start()
        job.start()
        wait_for(lambda: all_connected(coord, job_id, [0, 1]), 40, "ranks registered")
        yield mnt, coord, agent, job
    finally:
        job.close()
        agent.stop()
        coord.stop()
        mnt.unmount()


@pytest.mark.timeout(150)
def test_full_incident_dir_keeps_serving_and_dumps_arrive_later(tmp_path: Path) -> None:
    job_id = "chaos-full"
    with _running(tmp_path, job_id, dump_deadline=40.0) as (mnt, coord, agent, job):
        run = tmp_path / "run"
        left = mnt.fill(LEAVE)
        assert left <= 8192, left

        job.hang()
        [row] = wait_for(lambda: _collecting(coord, job_id), 20, "the incident to open")
        iid = str(row["id"])
        local = run / "bundles" / iid
        wait_for(
            lambda: all(_dumps(local / f"rank_{r}") for r in (0, 1)),
            20,
            "the agent's local copy of the bundle",
        )
        wait_for(lambda: "deferred" in agent.log(), 20, "the agent to defer the upload")
        # Still serving while the disk is full, and the incident waits.
        assert coord.health().serving
        assert coord.api(f"/api/incidents/{iid}")["status"] == "collecting"
        assert "No space left on device" in coord.log(), coord.log()[-3000:]
        coord_dir = tmp_path / "data" / "incidents" / iid
        assert not any(_dumps(d) for d in coord_dir.glob("rank_*")), "no dump fits yet"

        t_free = time.monotonic()
        mnt.free()
        [inc] = wait_for(lambda: finished_incidents(coord, job_id), 45, "the incident")
        print(f"incident analysed {time.monotonic() - t_free:.2f}s after space was freed")
        assert inc["status"] == "analyzed", inc
        assert sorted(inc["ranks_dumped"]) == [0, 1], inc
        assert inc["lagging_ranks"] == [1], inc["summary"]
        for r in (0, 1):
            [name] = _dumps(local / f"rank_{r}")
            assert (coord_dir / f"rank_{r}" / name).read_bytes() == (
                local / f"rank_{r}" / name
            ).read_bytes()
        agent.check()


@pytest.mark.timeout(150)
def test_read_only_incident_dir_keeps_serving_and_reports_the_error(tmp_path: Path) -> None:
    job_id = "chaos-ro"
    with _running(tmp_path, job_id, dump_deadline=5.0) as (mnt, coord, agent, job):
        mnt.read_only(True)
        job.hang()
        [inc] = wait_for(lambda: finished_incidents(coord, job_id), 40, "the incident")
        assert inc["status"] == "failed", inc
        assert "Read-only file system" in (inc["error"] or ""), inc
        assert "Read-only file system" in coord.log()
        assert coord.health().serving
        assert all_connected(coord, job_id, [0, 1])
        agent.check()
