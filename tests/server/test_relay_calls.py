"""The agents' calls a relay carries to the coordinator (server.relay_calls).

A real coordinator and a real relay on loopback, port 0; the agents are the
agent's own client (`agent.client.CoordinatorClient`), most of them given a
coordinator address nothing listens on, so that a call can only have
arrived through the relay. What must hold: every call an agent makes on its
session arrives as if sent straight, with the agent's own token and the
coordinator's own answer, refusals included; and a call the relay cannot
carry (no coordinator behind it, or a relay older than carrying) is made
again at once, straight, its upload chunks built anew.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hangwatch.agent import client as client_mod
from hangwatch.agent.client import CoordinatorClient
from hangwatch.server.coordinator import Coordinator
from hangwatch.server.relay import Relay

from hangwatch.config import Config
from hangwatch.wire import pb, rpc
from tests.server.conftest import (
    chunks,
    free_port,
    hang_rank_2,
    rank_infos,
    start_relay,
    two_nodes,
    wait_status,
)

JOB = "carried"


@pytest.fixture
def agent(relay: Relay) -> Iterator[Callable[..., CoordinatorClient]]:
    """An agent behind `relay` whose own coordinator address is a closed port."""
    made: list[CoordinatorClient] = []

    def make(node: int = 0, **kw: object) -> CoordinatorClient:
        cfg = Config.of(
            coordinator=f"127.0.0.1:{free_port()}",
            progress_relay=relay.address,
            job_id=JOB,
            **kw,
        )
        c = CoordinatorClient(cfg, agent_id=f"node-{node}", host=f"host-{node}")
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _requests(coordinator: Coordinator, method: str, code: str = "OK") -> float:
    return coordinator.metrics.value(
        "hangwatch_grpc_requests_total", {"method": method, "code": code}
    )


def _one_chunk(c: CoordinatorClient, incident_id: str) -> Iterator[pb.BundleChunk]:
    return iter(chunks(JOB, c.agent_id, incident_id, 0, "meta.json", b"{}", 1024))


@pytest.mark.timeout(60)
def test_an_agent_behind_a_relay_makes_every_call_through_it(
    coordinator: Coordinator, relay: Relay, agent: Callable[..., CoordinatorClient]
) -> None:
    a = agent()
    sid = a.register(rank_infos([0, 1], 2))
    assert sid and a.calls_via_relay
    # The clock exchange is the coordinator's: stamped with its clock (the
    # relay's own Health, for probes, stamps nothing).
    h = a.health(pb.HealthRequest(client_send_ns=time.time_ns()))
    assert h.receive_ns and h.send_ns and h.stall_timeout_s == coordinator.registry.stall_timeout
    a.report_event(pb.EVENT_KIND_RANK_UNRESPONSIVE, 1, "FR endpoint silent", 0.5)
    # Refusals come back as the coordinator gave them, and are not the
    # relay's failure: an upload and a completion for an incident it never had.
    with pytest.raises(grpc.RpcError) as ei:
        a.upload(lambda: _one_chunk(a, "no-such-incident"))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND, ei.value
    assert "no-such-incident" in (ei.value.details() or "")
    assert not a.complete_dump(
        pb.DumpResult(job_id=JOB, agent_id=a.agent_id, incident_id="no-such-incident")
    )
    assert a.calls_via_relay
    assert dict(relay.stats().calls_carried) == {
        "Register": 1,
        "Health": 1,
        "ReportEvent": 1,
        "UploadBundle": 1,
        "CompleteDump": 1,
    }
    assert relay.stats().calls_failed == {"NOT_FOUND": 1}
    assert _requests(coordinator, "Register") == 1
    assert _requests(coordinator, "ReportEvent") == 1
    assert _requests(coordinator, "UploadBundle", "NOT_FOUND") == 1


@pytest.mark.timeout(60)
def test_an_incidents_uploads_through_a_relay_are_stored_and_analysed(
    coordinator: Coordinator, relay: Relay
) -> None:
    """Every rank's FR dump and meta (8 UploadBundle streams) and each node's
    CompleteDump through the relay; the verdict is the one a straight upload
    gets (tests/server/test_grpc.py)."""
    with (
        grpc.insecure_channel(coordinator.grpc_address) as straight,
        grpc.insecure_channel(relay.address) as via,
    ):
        a, b = two_nodes(rpc.CoordinatorStub(straight), JOB)
        try:
            iid = hang_rank_2(a, b, seq=5, uploads_via=rpc.CoordinatorStub(via))
        finally:
            a.close()
            b.close()
    row = wait_status(coordinator, iid, "analyzed")
    assert (row.verdict, row.lagging_ranks) == ("hang", [2]), row.summary
    assert relay.stats().calls_carried["UploadBundle"] == 8
    assert relay.stats().calls_carried["CompleteDump"] == 2
    assert _requests(coordinator, "UploadBundle") == 8


@pytest.mark.timeout(60)
def test_the_agents_own_token_crosses_the_relay_and_a_wrong_one_is_refused_there(
    start_coordinator: Callable[..., Coordinator],
) -> None:
    """A relay with no token of its own: the coordinator, not the relay,
    decides who an agent is, and its refusal reaches the agent unchanged."""
    coordinator = start_coordinator(token="s3cret")
    r = start_relay(coordinator.grpc_address)
    try:
        nowhere = f"127.0.0.1:{free_port()}"
        made = []
        for token in ("s3cret", "wrong"):
            cfg = Config.of(coordinator=nowhere, progress_relay=r.address, job_id=JOB, token=token)
            made.append(CoordinatorClient(cfg, agent_id=f"node-{token}", host="h"))
        good, bad = made
        try:
            assert good.register(rank_infos([0], 2))
            with pytest.raises(grpc.RpcError) as ei:
                bad.register(rank_infos([1], 2))
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert ei.value.details() == "wrong bearer token"
            assert bad.calls_via_relay  # the coordinator's answer, not a relay fault
        finally:
            for c in made:
                c.close()
        assert _requests(coordinator, "Register") == 1
        assert _requests(coordinator, "Register", "UNAUTHENTICATED") == 1
    finally:
        r.stop()


@pytest.mark.timeout(60)
def test_a_call_the_relay_cannot_carry_goes_straight_at_once(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relay with no coordinator behind it answers UNAVAILABLE: the agent
    makes the call again straight, at once, and goes straight for
    RELAY_RETRY_S; an upload's chunks are built anew for the second try (a
    stream already read cannot be sent twice)."""
    r = start_relay(f"127.0.0.1:{free_port()}")  # nothing listens there
    try:
        cfg = Config.of(coordinator=coordinator.grpc_address, progress_relay=r.address, job_id=JOB)
        a = CoordinatorClient(cfg, agent_id="node-0", host="host-0")
        try:
            assert a.register(rank_infos([0, 1], 2))
            assert not a.calls_via_relay
            assert r.stats().calls_failed == {"UNAVAILABLE": 1}
            assert _requests(coordinator, "Register") == 1
            # Straight while the relay is passed over, then through it again.
            built = []

            def fresh() -> Iterator[pb.BundleChunk]:
                built.append(1)
                return _one_chunk(a, "no-such-incident")

            with pytest.raises(grpc.RpcError) as ei:
                a.upload(fresh)
            assert ei.value.code() == grpc.StatusCode.NOT_FOUND and len(built) == 1
            monkeypatch.setattr(client_mod, "RELAY_RETRY_S", 0.0)
            a._calls_relay_down_until = 0.0  # the pause over (its length is not the point)
            assert a.calls_via_relay
            with pytest.raises(grpc.RpcError) as ei:
                a.upload(fresh)
            # Tried through the relay (UNAVAILABLE there), then straight with new chunks.
            assert ei.value.code() == grpc.StatusCode.NOT_FOUND, ei.value
            assert len(built) == 3
            assert r.stats().calls_failed == {"UNAVAILABLE": 2}
            assert _requests(coordinator, "UploadBundle", "NOT_FOUND") == 2
        finally:
            a.close()
    finally:
        r.stop()


@pytest.mark.timeout(60)
def test_behind_a_relay_older_than_carrying_calls_the_agent_calls_straight(
    coordinator: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    """A relay that serves only progress and commands (as before calls were
    carried) answers the rest UNIMPLEMENTED, as any gRPC server answers a
    method it lacks: the agent registers straight all the same, and says so
    once, not every time it tries the relay again."""
    older = grpc.server(ThreadPoolExecutor(2))
    rpc.add_CoordinatorServicer_to_server(rpc.CoordinatorServicer(), older)
    port = older.add_insecure_port("127.0.0.1:0")
    older.start()
    try:
        cfg = Config.of(
            coordinator=coordinator.grpc_address, progress_relay=f"127.0.0.1:{port}", job_id=JOB
        )
        a = CoordinatorClient(cfg, agent_id="node-0", host="host-0")
        try:
            with caplog.at_level(logging.DEBUG, logger="hangwatch.agent"):
                for _ in range(3):
                    a._calls_relay_down_until = 0.0  # the pause over (its length is not the point)
                    assert a.register(rank_infos([0, 1], 2))
                    assert not a.calls_via_relay
            assert _requests(coordinator, "Register") == 3
            said = [r.levelno for r in caplog.records if "through relay" in r.getMessage()]
            assert said == [logging.WARNING, logging.DEBUG, logging.DEBUG], said
        finally:
            a.close()
    finally:
        older.stop(0)
