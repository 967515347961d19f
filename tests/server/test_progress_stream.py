"""Progress on one stream per agent session (StreamProgress), beside the unary form.

A real coordinator over loopback gRPC; the agent side is the agent's own
client (`agent.client.CoordinatorClient`), and an older agent is the wire
contract's unary ReportProgress (`ProtocolAgent`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from hangwatch.agent.client import CoordinatorClient, StaleSession
from hangwatch.server.coordinator import Coordinator

from hangwatch.config import Config
from hangwatch.wire import rpc
from tests.server.conftest import ProtocolAgent, progress_at, rank_infos, wait_for


@pytest.fixture
def client(coordinator: Coordinator) -> Iterator[CoordinatorClient]:
    c = CoordinatorClient(
        Config.of(coordinator=coordinator.grpc_address, job_id="streamed"),
        agent_id="node-a",
        host="host-a",
    )
    yield c
    c.close()


def _completed(coordinator: Coordinator, job: str, rank: int) -> int | None:
    snap = coordinator.registry.snapshot(job)
    if snap is None:
        return None
    row = next((r for r in snap.ranks if r.rank == rank), None)
    g = None if row is None else next((g for g in row.groups if g.group == "0"), None)
    return None if g is None else g.last_completed


@pytest.mark.timeout(30)
def test_an_agent_streams_and_an_older_agent_calls_on_the_same_coordinator(
    coordinator: Coordinator, client: CoordinatorClient, stub: rpc.CoordinatorStub
) -> None:
    client.register(rank_infos([0, 1], 2))
    for step in range(1, 6):
        client.report_progress(step, progress_at([0, 1], step))
    wait_for(lambda: _completed(coordinator, "streamed", 1) == 5, 10, "the streamed reports")
    # An agent that knows only ReportProgress, on the same coordinator.
    old = ProtocolAgent(stub, job_id="unary", agent_id="node-b", ranks=[0, 1], world_size=2)
    old.register()
    assert old.progress({0: (3, 3), 1: (3, 3)})
    assert _completed(coordinator, "unary", 0) == 3
    m = coordinator.metrics
    ok = {"code": "OK"}
    assert m.value("hangwatch_grpc_requests_total", {"method": "StreamProgress", **ok}) == 5
    assert m.value("hangwatch_grpc_requests_total", {"method": "ReportProgress", **ok}) == 1
    # The agent sent columns; the older agent's messages were read all the same.
    assert m.value("hangwatch_progress_ranks_total", {"form": "columns"}) == 10
    assert m.value("hangwatch_progress_ranks_total", {"form": "messages"}) == 2
    # One stream carried all five: the agent opened no call per report.
    assert not client.progress_needs_full()


@pytest.mark.timeout(30)
def test_a_replaced_session_ends_the_stream_and_the_agent_registers_again(
    coordinator: Coordinator, client: CoordinatorClient
) -> None:
    client.register(rank_infos([0, 1], 2))
    client.report_progress(1, progress_at([0, 1], 1))
    # The same node registers again elsewhere (a restarted agent): this
    # session is over, and the coordinator says so on the stream.
    other = CoordinatorClient(client.cfg, agent_id="node-a", host="host-a")
    try:
        other.register(rank_infos([0, 1], 2))
    finally:
        other.close()

    def stale() -> bool:
        try:
            client.report_progress(2, progress_at([0, 1], 2))
        except StaleSession:
            return True
        time.sleep(0.05)
        return False

    wait_for(stale, 10, "the agent to learn its session is gone")
    assert client.session_id == ""
    # Registered again, it streams again on a new stream, every rank in full.
    client.register(rank_infos([0, 1], 2))
    assert client.progress_needs_full()
    client.report_progress(3, progress_at([0, 1], 7))
    wait_for(lambda: _completed(coordinator, "streamed", 0) == 7, 10, "the new stream's report")


@pytest.mark.timeout(30)
def test_an_invalid_report_ends_the_stream_with_invalid_argument(
    coordinator: Coordinator, client: CoordinatorClient
) -> None:
    client.register(rank_infos([0, 1], 2))
    bad = progress_at([0], 1)
    bad[0].groups[0].last_completed = -5  # below -1: refused by validation
    client.report_progress(1, bad)

    def refused() -> bool:
        try:
            client.report_progress(2, progress_at([0, 1], 2))
        except Exception as e:  # the stream's end, as the agent's sender sees it
            return "INVALID_ARGUMENT" in str(getattr(e, "code", lambda: "")())
        time.sleep(0.05)
        return False

    wait_for(refused, 10, "the stream to end with INVALID_ARGUMENT")
    labels = {"method": "StreamProgress", "code": "INVALID_ARGUMENT"}
    assert coordinator.metrics.value("hangwatch_grpc_requests_total", labels) == 1
    # The next report opens a new stream and is applied.
    assert client.progress_needs_full()
    client.report_progress(3, progress_at([0, 1], 4))
    wait_for(lambda: _completed(coordinator, "streamed", 1) == 4, 10, "the new stream's report")
