"""The agent against a real coordinator that rejects it, disappears and comes back."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from hangwatch.agent.client import Backoff
from hangwatch.agent.outbox import BoundedQueue
from hangwatch.agent.service import Agent
from hangwatch.server.coordinator import Coordinator

from hangwatch.config import Config
from hangwatch.wire import pb

TOKEN = "t0ken-for-tests"


def _server_cfg(tmp_path: Path, port: int = 0) -> Config:
    return Config.of(data_dir=str(tmp_path / "data"), grpc_port=port, http_port=0, token=TOKEN)


def _agent_cfg(tmp_path: Path, address: str, **kw: object) -> Config:
    base: dict[str, object] = {
        "coordinator": address,
        "run_dir": str(tmp_path / "run"),
        "poll_interval": 0.2,
        "job_id": "resilience",
        "node_id": "node-r",
        "token": TOKEN,
    }
    base.update(kw)
    return Config.of(**base)  # type: ignore[arg-type]


def _agent_ids(coord: Coordinator) -> list[str]:
    snap = coord.registry.snapshot("resilience")
    return [a.agent_id for a in snap.agents if a.connected] if snap else []


def _wait(pred: object, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():  # type: ignore[operator]
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout}s")


def _start(agent: Agent) -> threading.Thread:
    th = threading.Thread(target=agent.run, daemon=True)
    th.start()
    return th


def test_bounded_queue_drops_oldest_and_counts() -> None:
    q: BoundedQueue[int] = BoundedQueue(3)
    for i in range(5):
        q.put(i)
    assert q.dropped == 2 and q.take(10) == [2, 3, 4]
    q.put(7)
    q.push_front([5, 6])
    q.push_front([1, 2])  # full: these oldest are dropped, not the newer ones
    assert q.take(10) == [5, 6, 7] and q.dropped == 4


def test_backoff_is_capped_and_jittered() -> None:
    b = Backoff(base=0.1, cap=2.0)
    delays = [b.next() for _ in range(20)]
    assert all(0.05 <= d <= 2.0 for d in delays)
    assert max(delays[-5:]) > 1.0 and len(set(delays)) > 10
    b.reset()
    assert b.next() <= 0.1


@pytest.mark.timeout(30)
def test_wrong_token_never_blocks_polling(tmp_path: Path) -> None:
    with Coordinator(_server_cfg(tmp_path)) as coord:
        agent = Agent(_agent_cfg(tmp_path, coord.grpc_address, token="wrong", max_buffered=3))
        th = _start(agent)
        try:
            for i in range(5):
                agent.event(pb.EVENT_KIND_RANK_UNRESPONSIVE, i, "test", time.monotonic())
            time.sleep(1.0)
            assert _agent_ids(coord) == []
            t = time.monotonic()
            agent.poll_once()
            assert time.monotonic() - t < 0.5
            assert agent.polls >= 3  # the poll loop kept its pace
            assert len(agent.events) == 3 and agent.events.dropped == 2
        finally:
            agent.stop.set()
            th.join(8)
        assert not th.is_alive()


@pytest.mark.timeout(40)
def test_reconnects_within_five_seconds_after_coordinator_restart(tmp_path: Path) -> None:
    coord = Coordinator(_server_cfg(tmp_path))
    coord.start()
    port = coord.grpc_port
    agent = Agent(_agent_cfg(tmp_path, coord.grpc_address))
    th = _start(agent)
    try:
        _wait(lambda: _agent_ids(coord) == ["node-r"], 10)
        coord.stop()
        polls = agent.polls
        agent.event(
            pb.EVENT_KIND_RANK_UNRESPONSIVE, 0, "while the coordinator was away", time.monotonic()
        )
        time.sleep(1.5)
        assert agent.polls >= polls + 5  # polling continues with nobody listening
        coord2 = Coordinator(_server_cfg(tmp_path / "second", port))
        coord2.start()
        try:
            took = _wait(lambda: _agent_ids(coord2) == ["node-r"], 10)
            # A restarted coordinator knows no session: the agent re-registered, < 5 s.
            assert took < 5.0, took

            # An empty queue is not delivery: the sender takes an event off the
            # queue before its RPC lands (the race this test used to lose under load).
            def delivered() -> list[str]:
                snap = coord2.registry.snapshot("resilience")
                return [e.detail for e in snap.events] if snap is not None else []

            _wait(lambda: bool(delivered()), 5)
            assert delivered() == ["while the coordinator was away"]
            assert len(agent.events) == 0
        finally:
            agent.stop.set()
            th.join(8)
            coord2.stop()
    finally:
        agent.stop.set()
        coord.stop()
    assert not th.is_alive()
