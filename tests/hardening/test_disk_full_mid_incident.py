"""The fault matrix's "coordinator disk full" column, where it is not collection's.

The whole data directory of a real `hangwatch server` (its SQLite store and
every bundle) is a small tmpfs; two nodes' agents speak its gRPC protocol
with real FR dumps (rank 2 never entered all_reduce #5).

- opened: the disk is full before the agents register (they are taken all
  the same) and when the hang begins. No incident can be stored;
  the coordinator says so once, keeps serving, shows the stall live, and
  opens the incident once space is freed: rank 2 named, one incident.

- analysing: the analyzer worker is SIGSTOPped once collection ends, the
  disk is filled to the last byte, and the worker goes on. The verdict
  cannot be stored. The incident stays open, collecting, with every file
  the nodes sent; the coordinator keeps serving and says why. Once space is
  freed, the verdict the analysis already made is stored: rank 2 named,
  one incident, every file unchanged.
- resolving: with the verdict stored and the hang still live, the disk is
  filled again and the job moves past #5. The resolution cannot be stored;
  the incident is never shown resolved before it is, and once space is freed
  it resolves, once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import grpc
import pytest

from hangwatch.wire import rpc
from tests.hardening.util import analyzer_worker, rank_2_named, rank_files, tmpfs, wait_for
from tests.server.conftest import hang_rank_2, two_nodes
from tests.support.chaos import CoordinatorProc, TmpfsMount

# Room for the store and four ranks' small dumps, many times over.
SIZE = 16 * 1024 * 1024


def _on_tmpfs(data: Path) -> tuple[TmpfsMount, CoordinatorProc]:
    """A tmpfs over `data` and a coordinator (not started) on it. The protocol
    agents report only when told: a lost-agent timeout past the test keeps the
    job live (an ended job would close the incident as ended)."""
    mnt = tmpfs(data, SIZE)
    coord = CoordinatorProc(data, stall_timeout=0.5, dump_deadline=60.0, agent_lost_timeout=300.0)
    return mnt, coord


@pytest.mark.timeout(120)
def test_a_disk_that_fills_while_it_analyses_and_resolves_delays_both_and_loses_nothing(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    mnt, coord = _on_tmpfs(data)
    worker = None
    try:
        with coord, grpc.insecure_channel(coord.grpc) as ch:
            worker = wait_for(lambda: analyzer_worker(coord.pid), 30, "the analyzer worker")
            a, b = two_nodes(rpc.CoordinatorStub(ch), "job")
            os.kill(worker, signal.SIGSTOP)
            iid = hang_rank_2(a, b, seq=5)
            bundle = data / "incidents" / iid
            doc = bundle / "incident.json"
            wait_for(lambda: doc.is_file(), 30, "incident.json")
            held = rank_files(bundle)
            assert len(held) == 8, held

            # Analysing, and the disk fills.
            mnt.fill(0)
            os.kill(worker, signal.SIGCONT)
            wait_for(
                lambda: "the data directory is full" in coord.log(), 30, "the deferred verdict"
            )
            assert coord.health().serving
            row = coord.api(f"/api/incidents/{iid}")
            assert row["status"] == "collecting", row
            assert rank_files(bundle) == held

            mnt.free()
            rank_2_named(coord, iid, "the verdict once space is freed")
            assert rank_files(bundle) == held
            assert json.loads(doc.read_text())["ranks_dumped"] == [0, 1, 2, 3]

            # Resolving, and the disk fills again.
            mnt.fill(0)
            a.progress({0: (5, 5), 1: (5, 5)})
            b.progress({2: (5, 5), 3: (5, 5)})
            wait_for(lambda: "its state change waits" in coord.log(), 30, "a refused resolution")
            assert coord.api(f"/api/incidents/{iid}")["status"] == "analyzed"
            mnt.free()
            assert coord.log().count("its state change waits") == 1  # said once, not per tick
            row = wait_for(
                lambda: (r := coord.api(f"/api/incidents/{iid}"))["status"] == "resolved" and r,
                30,
                "the resolution once space is freed",
            )
            assert row["lagging_ranks"] == [2], row
            assert [r["id"] for r in coord.api("/api/incidents?job=job")] == [iid]
            assert rank_files(bundle) == held
            a.close()
            b.close()
    finally:
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
        mnt.unmount()


@pytest.mark.timeout(120)
def test_a_disk_full_when_the_hang_begins_opens_its_incident_once_space_frees(
    tmp_path: Path,
) -> None:
    mnt, coord = _on_tmpfs(tmp_path / "data")
    try:
        with coord, grpc.insecure_channel(coord.grpc) as ch:
            # Full before the agents even register: they are taken all the same.
            mnt.fill(0)
            a, b = two_nodes(rpc.CoordinatorStub(ch), "job")
            assert "not recorded in the history" in coord.log()

            def while_full() -> None:
                wait_for(
                    lambda: "cannot open an incident" in coord.log(), 30, "the refused incident"
                )
                assert coord.health().serving
                assert coord.api("/api/incidents?job=job") == []
                [stall] = coord.api("/api/jobs/job/ranks")["stalled"]
                assert (stall["seq"], stall["not_entered_ranks"]) == (5, [2]), stall
                assert coord.log().count("cannot open an incident") == 1  # not once per tick
                mnt.free()

            iid = hang_rank_2(a, b, seq=5, on_stalled=while_full)
            rank_2_named(coord, iid, "the verdict")
            a.close()
            b.close()
    finally:
        mnt.unmount()
