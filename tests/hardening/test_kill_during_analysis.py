"""The fault matrix's "analysing" row: the coordinator SIGKILLed while it analyses.

A real `hangwatch server`; two nodes' agents speak its gRPC protocol with real
FR dumps (rank 2 never entered all_reduce #5). The coordinator's analyzer
worker (its capped child process) is SIGSTOPped before the last dump arrives,
so the analysis is in flight, every dump on disk and `incident.json` written,
when the coordinator is SIGKILLed. Restarted on the same data directory, it
finishes that one incident from what is on disk, before any agent is back:
the verdict names rank 2, every file the nodes sent is there unchanged, and
no second incident opens for the same hang.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import grpc
import pytest

from hangwatch.wire import rpc
from tests.hardening.util import analyzer_worker, rank_2_named, rank_files, wait_for
from tests.server.conftest import hang_rank_2, two_nodes
from tests.support.chaos import CoordinatorProc


@pytest.mark.timeout(120)
def test_a_coordinator_killed_while_it_analyses_finishes_its_one_incident(
    tmp_path: Path,
) -> None:
    coord = CoordinatorProc(tmp_path / "data", stall_timeout=0.5, dump_deadline=60.0)
    worker = None
    with coord:
        worker = wait_for(lambda: analyzer_worker(coord.pid), 30, "the analyzer worker")
        with grpc.insecure_channel(coord.grpc) as ch:
            a, b = two_nodes(rpc.CoordinatorStub(ch), "job")
            os.kill(worker, signal.SIGSTOP)
            iid = hang_rank_2(a, b, seq=5)
            # Collection is over (incident.json written): the analysis is in flight.
            doc = tmp_path / "data" / "incidents" / iid / "incident.json"
            wait_for(lambda: doc.is_file(), 30, "incident.json")
            assert coord.api(f"/api/incidents/{iid}")["status"] == "collecting"
            a.close()
            b.close()
        coord.kill()
        os.kill(worker, signal.SIGKILL)  # what is left of the killed one's analysis
        bundle = tmp_path / "data" / "incidents" / iid
        held = rank_files(bundle)

        coord.start()
        # Every dump is on disk: the restarted coordinator analyses them at once,
        # without waiting for the agents to come back.
        rank_2_named(coord, iid, "the recovered incident's verdict")
        # What the nodes sent is all there, byte for byte.
        assert rank_files(bundle) == held and len(held) == 8
        json.loads(doc.read_text())  # whole, not half-written
