"""Commands through the relay (RelayCommands, server.ingest.watches).

A real coordinator and a real relay over loopback gRPC, every port 0; the
agents are the agent's own client (`agent.client.CoordinatorClient`) with
`progress_relay` set. Commands are put in agents' mailboxes the way the
incident manager puts them (`JobRegistry.push_command`). What must hold: an
agent watching through the relay gets its commands as it would from the
coordinator, once each, including those queued before it watched; its watch
ends as WatchCommands would end it (unknown session, replaced session); and
when the relay goes away the agent watches the coordinator at once and the
command waiting in its mailbox reaches it there.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from hangwatch.agent.client import CoordinatorClient
from hangwatch.server.coordinator import Coordinator
from hangwatch.server.live.commands import Command
from hangwatch.server.relay import Relay

from hangwatch.config import Config
from hangwatch.wire import pb, rpc
from tests.server.conftest import free_port, rank_infos, wait_for

JOB = "relayed-commands"


class Watch:
    """A WatchCommands call read on a thread of its own: what arrived, and how it ended."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.items: queue.Queue[pb.Command | grpc.RpcError | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for cmd in self.call:
                self.items.put(cmd)
            self.items.put(None)  # ended normally
        except grpc.RpcError as e:
            self.items.put(e)

    def next(self, timeout: float = 10.0) -> pb.Command | grpc.RpcError | None:
        return self.items.get(timeout=timeout)

    def close(self) -> None:
        self.call.cancel()
        self._thread.join(5)


@pytest.fixture
def agents(coordinator: Coordinator, relay: Relay) -> Iterator[Callable[[int], CoordinatorClient]]:
    made: list[CoordinatorClient] = []

    def make(node: int) -> CoordinatorClient:
        cfg = Config.of(
            coordinator=coordinator.grpc_address, progress_relay=relay.address, job_id=JOB
        )
        c = CoordinatorClient(cfg, agent_id=f"node-{node}", host=f"host-{node}")
        c.register(rank_infos([2 * node, 2 * node + 1], 8))
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def _dump(coordinator: Coordinator, node: int, incident: str) -> None:
    reg = coordinator.registry
    cmd = Command(
        kind=pb.COMMAND_KIND_DUMP,
        incident_id=incident,
        reason="test",
        deadline_s=60.0,
        expires=reg.now() + 60.0,
    )
    assert reg.push_command(JOB, f"node-{node}", cmd)


def _watchers(coordinator: Coordinator, node: int) -> int:
    """Open watches the agent's mailbox wakes (a relay's or a direct call's)."""
    agent = coordinator.registry._agent(JOB, f"node-{node}")
    return 0 if agent is None else len(agent.mailbox.wakers)


@pytest.mark.timeout(60)
def test_agents_get_their_commands_through_the_relay_once_each(
    coordinator: Coordinator, relay: Relay, agents: Callable[[int], CoordinatorClient]
) -> None:
    a, b = agents(0), agents(1)
    _dump(coordinator, 0, "20261204T000000Z-queued")  # waiting before any watch
    wa, wb = Watch(a.watch_commands()), Watch(b.watch_commands())
    try:
        assert a.commands_via_relay and b.commands_via_relay
        got = wa.next()
        assert isinstance(got, pb.Command) and got.incident_id == "20261204T000000Z-queued"
        assert got.kind == pb.COMMAND_KIND_DUMP and 0 < got.deadline_s <= 60
        wait_for(lambda: relay.stats().command_watches == 2, 10, "both watches held")
        for node in (0, 1):
            _dump(coordinator, node, "20261204T000001Z-both")
        for w in (wa, wb):
            got = w.next()
            assert isinstance(got, pb.Command) and got.incident_id == "20261204T000001Z-both"
        # Each agent's mailbox is woken through the relay's one stream, and
        # nothing is sent twice on the same watch (the mailbox keeps both).
        assert _watchers(coordinator, 0) == _watchers(coordinator, 1) == 1
        _dump(coordinator, 1, "20261204T000002Z-one")
        got = wb.next()
        assert isinstance(got, pb.Command) and got.incident_id == "20261204T000002Z-one"
        assert wa.items.empty()
        assert relay.stats().commands_forwarded == 4
    finally:
        wa.close()
        wb.close()
    wait_for(lambda: _watchers(coordinator, 0) == 0, 10, "the watch closed at the coordinator")


@pytest.mark.timeout(60)
def test_a_watch_ends_through_the_relay_as_at_the_coordinator(
    coordinator: Coordinator, relay: Relay, agents: Callable[[int], CoordinatorClient]
) -> None:
    a = agents(0)
    w = Watch(a.watch_commands())
    try:
        wait_for(lambda: _watchers(coordinator, 0) == 1, 10, "a's watch at the coordinator")
        # The agent restarts: a newer Register replaces a's session. Its open
        # watch ends normally (the agent opens a new call) ...
        again = CoordinatorClient(a.cfg, agent_id="node-0", host="host-0")
        try:
            again.register(rank_infos([0, 1], 8))
        finally:
            again.close()
        assert w.next() is None
    finally:
        w.close()
    # ... and a new one on the old session is refused as unknown (re-register).
    w = Watch(a.watch_commands())
    try:
        err = w.next()
        assert isinstance(err, grpc.RpcError), err
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
        assert "unknown session" in (err.details() or "")
        assert not a.commands_failed(err)  # not the relay's failure: back off, re-register
    finally:
        w.close()


@pytest.mark.timeout(60)
def test_when_the_relay_goes_the_agent_watches_the_coordinator_and_gets_its_dump(
    coordinator: Coordinator, relay: Relay, agents: Callable[[int], CoordinatorClient]
) -> None:
    a = agents(0)
    w = Watch(a.watch_commands())
    try:
        wait_for(lambda: _watchers(coordinator, 0) == 1, 10, "a's watch through the relay")
        relay.stop()
        err = w.next()
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAVAILABLE, err
    finally:
        w.close()
    # The incident's DUMP arrives while no watch is open: it waits in the mailbox.
    _dump(coordinator, 0, "20261204T000003Z-after")
    assert a.commands_failed(err)  # the relay failed: open the next call at once, straight
    w = Watch(a.watch_commands())
    try:
        assert not a.commands_via_relay
        got = w.next()
        assert isinstance(got, pb.Command) and got.incident_id == "20261204T000003Z-after"
    finally:
        w.close()


@pytest.mark.timeout(60)
def test_a_relay_without_its_coordinator_turns_watches_away(coordinator: Coordinator) -> None:
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there
    r = Relay(Config.of(coordinator=nowhere, grpc_port=0, http_port=0))
    r.start()
    try:
        cfg = Config.of(coordinator=coordinator.grpc_address, progress_relay=r.address, job_id=JOB)
        a = CoordinatorClient(cfg, agent_id="node-0", host="host-0")
        try:
            a.register(rank_infos([0, 1], 8))
            w = Watch(a.watch_commands())
            try:
                err = w.next()
                assert isinstance(err, grpc.RpcError), err
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            finally:
                w.close()
            assert a.commands_failed(err)
            _dump(coordinator, 0, "20261204T000004Z-direct")
            w = Watch(a.watch_commands())
            try:
                got = w.next()
                assert isinstance(got, pb.Command) and got.incident_id == "20261204T000004Z-direct"
            finally:
                w.close()
        finally:
            a.close()
    finally:
        r.stop()


@pytest.mark.timeout(30)
def test_the_coordinator_refuses_a_watch_naming_no_valid_sender(coordinator: Coordinator) -> None:
    """RelayCommands checks each watch as WatchCommands checks its request: a
    relay that sends one without a valid job or agent id has its stream ended
    with INVALID_ARGUMENT, and holds no waker at the coordinator."""
    bad = pb.WatchRequest(job_id="../etc", agent_id="node-0", session_id="s")
    with grpc.insecure_channel(coordinator.grpc_address) as ch:
        call = rpc.CoordinatorStub(ch).RelayCommands(
            iter([pb.CommandWatch(relay_id="test-relay", opened=[bad])]), timeout=10
        )
        with pytest.raises(grpc.RpcError) as refused:
            list(call)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    assert "job_id" in (refused.value.details() or "")
