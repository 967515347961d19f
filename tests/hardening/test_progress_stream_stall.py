"""A coordinator that stops reading (SIGSTOP: a stuck process, a full kernel
queue) never blocks the agent that streams progress to it.

A real `hangwatch server`; the agent side is the agent's own client. While
the coordinator is stopped, every report the agent hands over returns at
once; once gRPC's flow control and the agent's bounded backlog are full the
client says the stream is broken (and holds no more). Resumed, the next
report opens a new stream and is applied.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from hangwatch.agent.client import UNARY_DEADLINE_S, CoordinatorClient, StreamBroken

from hangwatch.config import Config
from tests.hardening.util import ranks_view, wait_for
from tests.server.conftest import progress_at, rank_infos
from tests.support.chaos import CoordinatorProc

RANKS = list(range(8))


def _completed(coord: CoordinatorProc, rank: int) -> int | None:
    row = ranks_view(coord, "job").get(rank)
    return None if row is None else row["groups"][0]["last_completed"]


@pytest.mark.timeout(90)
def test_a_stopped_coordinator_never_blocks_the_streaming_agent(tmp_path: Path) -> None:
    coord = CoordinatorProc(tmp_path / "data", agent_lost_timeout=300.0)
    with coord:
        client = CoordinatorClient(
            Config.of(coordinator=coord.grpc, job_id="job"), agent_id="node-a", host="host-a"
        )
        try:
            client.register(rank_infos(RANKS, len(RANKS), pid_base=30_000))
            client.report_progress(1, progress_at(RANKS, 1))
            wait_for(lambda: _completed(coord, 7) == 1, 20, "the first streamed report")
            os.kill(coord.pid, signal.SIGSTOP)
            try:
                slowest, sent, broken = 0.0, 0, None
                end = time.monotonic() + 30
                while broken is None and time.monotonic() < end:
                    t0 = time.monotonic()
                    try:
                        client.report_progress(2 + sent, progress_at(RANKS, 2 + sent))
                        sent += 1
                    except StreamBroken as e:
                        broken = e
                    slowest = max(slowest, time.monotonic() - t0)
                print(f"{sent} reports handed over before the stream broke; slowest {slowest:.3f}s")
                assert broken is not None, f"{sent} reports queued and the stream never said so"
                # A unary call would have waited out its deadline on each report.
                assert slowest < UNARY_DEADLINE_S / 5, slowest
                assert client.progress_needs_full()
            finally:
                os.kill(coord.pid, signal.SIGCONT)
            # Resumed: a new stream, and its report (every rank) is applied.
            client.report_progress(10**6, progress_at(RANKS, 10**6))
            wait_for(lambda: _completed(coord, 7) == 10**6, 20, "the report on a new stream")
        finally:
            client.close()
