"""The relay's own HTTP port (server.relay_http): /metrics, /healthz, /readyz.

A real coordinator, a real relay and the agent's own client over loopback
gRPC, every port 0; the relay's /metrics read over HTTP and parsed with
prometheus_client's parser. What it must count is what only the relay sees:
reports it took and sent on, and every report and agent stream it turned
away, by why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
import httpx
import pytest
from hangwatch.agent.client import CoordinatorClient
from hangwatch.server import relay as relay_mod
from hangwatch.server.coordinator import Coordinator
from hangwatch.server.relay import Relay
from hangwatch.server.relay_http import ENDED_REASONS, FAMILIES, NOT_FORWARDED_REASONS
from prometheus_client.parser import text_string_to_metric_families

from hangwatch.config import Config
from tests.server.conftest import free_port, progress_at, rank_infos, start_relay, wait_for

JOB = "relay-http"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _get(relay: Relay, path: str, token: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"http://{relay.http_address}{path}", headers=headers, timeout=10)


def _scrape(relay: Relay, token: str | None = None) -> Samples:
    r = _get(relay, "/metrics", token)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
    }


def _agent(coordinator: Coordinator, relay: Relay, node: int, **kw: object) -> CoordinatorClient:
    cfg = Config.of(
        coordinator=coordinator.grpc_address, progress_relay=relay.address, job_id=JOB, **kw
    )
    c = CoordinatorClient(cfg, agent_id=f"node-{node}", host=f"host-{node}")
    c.register(rank_infos([2 * node, 2 * node + 1], 8))
    return c


def _until_refused(client: CoordinatorClient, ranks: list[int]) -> grpc.RpcError:
    """Report until the agent's stream is found ended; the error it ended with."""
    end = time.monotonic() + 10
    seq = 1
    while time.monotonic() < end:
        try:
            client.report_progress(seq, progress_at(ranks, seq))
        except grpc.RpcError as e:
            return e
        seq += 1
        time.sleep(0.05)
    raise AssertionError("the agent's stream never ended")


@pytest.fixture
def relay(coordinator: Coordinator) -> Iterator[Relay]:
    r = start_relay(coordinator.grpc_address, relay_window=0.05)
    wait_for(lambda: r.connected, 10, "the relay's stream to the coordinator")
    yield r
    r.stop()


@pytest.mark.timeout(60)
def test_the_relay_counts_what_it_took_and_sent_on(coordinator: Coordinator, relay: Relay) -> None:
    clients = [_agent(coordinator, relay, n) for n in range(2)]
    try:
        for step in (1, 2, 3):
            for n, c in enumerate(clients):
                c.report_progress(step, progress_at([2 * n, 2 * n + 1], step))
        wait_for(lambda: relay.reports_sent == 6, 10, "six reports forwarded")
        v = _scrape(relay)
    finally:
        for c in clients:
            c.close()
    assert v["hangwatch_relay_connected", ()] == 1
    assert v["hangwatch_relay_agent_streams", ()] == 2
    assert v["hangwatch_relay_pending_reports", ()] == 0
    assert v["hangwatch_relay_reports_received_total", ()] == 6
    assert v["hangwatch_relay_reports_forwarded_total", ()] == 6
    assert 1 <= v["hangwatch_relay_batches_forwarded_total", ()] == relay.batches_sent <= 6
    assert v["hangwatch_relay_upstream_failures_total", ()] == 0
    # Every family declared, every reason there from the start at 0 (a series
    # that appears only with its first count hides that count from increase()).
    names = {name for name, _ in v}
    for fam, kind, _, _ in FAMILIES:
        assert (fam + "_total" if kind == "counter" else fam) in names, fam
    for reason in NOT_FORWARDED_REASONS:
        assert v["hangwatch_relay_reports_not_forwarded_total", (("reason", reason),)] == 0
    for reason in ENDED_REASONS:
        assert v["hangwatch_relay_agent_streams_ended_total", (("reason", reason),)] == 0
    assert _get(relay, "/healthz").status_code == 200
    assert _get(relay, "/readyz").status_code == 200
    assert _get(relay, "/nothing").status_code == 404


@pytest.mark.timeout(60)
def test_the_relays_metrics_are_behind_its_token_and_its_probes_are_not(
    coordinator: Coordinator,
) -> None:
    relay = start_relay(coordinator.grpc_address, token="relay-metrics-token")
    try:
        assert _get(relay, "/metrics").status_code == 401
        assert _get(relay, "/metrics", "wrong-token").status_code == 401
        assert "hangwatch_relay_connected" not in _get(relay, "/metrics", "wrong-token").text
        assert (
            _scrape(relay, "relay-metrics-token")["hangwatch_relay_upstream_failures_total", ()]
            >= 0
        )
        assert _get(relay, "/healthz").status_code == 200
    finally:
        relay.stop()


@pytest.mark.timeout(90)
def test_when_its_coordinator_goes_the_relay_says_so_and_counts_whom_it_ended(
    start_coordinator: Callable[..., Coordinator],
) -> None:
    coordinator = start_coordinator()
    relay = start_relay(coordinator.grpc_address, relay_window=0.05)
    try:
        wait_for(lambda: relay.connected, 10, "the relay's stream to the coordinator")
        a = _agent(coordinator, relay, 0)
        try:
            a.report_progress(1, progress_at([0, 1], 1))
            wait_for(lambda: relay.reports_sent == 1, 10, "the report forwarded")
            coordinator.stop(grace=0.5)
            wait_for(lambda: not relay.connected, 10, "the relay to see its coordinator gone")
            v = _scrape(relay)
            assert v["hangwatch_relay_connected", ()] == 0
            assert v["hangwatch_relay_upstream_failures_total", ()] >= 1
            assert (
                v["hangwatch_relay_agent_streams_ended_total", (("reason", "upstream_lost"),)] == 1
            )
            assert v["hangwatch_relay_agent_streams", ()] == 0
            # Alive, but not ready: agents are turned away now.
            assert _get(relay, "/healthz").status_code == 200
            ready = _get(relay, "/readyz")
            assert ready.status_code == 503 and "coordinator" in ready.text
        finally:
            a.close()
    finally:
        relay.stop()


@pytest.mark.timeout(60)
def test_agents_turned_away_without_a_coordinator_are_counted(coordinator: Coordinator) -> None:
    relay = start_relay(f"127.0.0.1:{free_port()}")  # nothing listens there
    try:
        assert _get(relay, "/readyz").status_code == 503
        a = _agent(coordinator, relay, 0)  # registered with the live coordinator
        try:
            err = _until_refused(a, [0, 1])
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        finally:
            a.close()
        v = _scrape(relay)
        assert v["hangwatch_relay_agent_streams_ended_total", (("reason", "no_coordinator"),)] >= 1
        assert v["hangwatch_relay_upstream_failures_total", ()] >= 1
        assert v["hangwatch_relay_reports_received_total", ()] == 0
    finally:
        relay.stop()


@pytest.mark.timeout(60)
def test_reports_turned_away_for_backlog_are_counted_and_so_are_those_held_at_stop(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With room for two reports and a window far longer than the test, the
    third agent's report is turned away (RESOURCE_EXHAUSTED) and counted; the
    two held are counted as not forwarded when the relay stops."""
    monkeypatch.setattr(relay_mod, "MAX_PENDING", 2)
    relay = start_relay(coordinator.grpc_address, relay_window=120.0)
    clients: list[CoordinatorClient] = []
    try:
        wait_for(lambda: relay.connected, 10, "the relay's stream to the coordinator")
        clients = [_agent(coordinator, relay, n) for n in range(3)]
        for n in (0, 1):
            clients[n].report_progress(1, progress_at([2 * n, 2 * n + 1], 1))
        wait_for(lambda: relay.stats().pending_reports == 2, 10, "two reports held")
        err = _until_refused(clients[2], [4, 5])
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        v = _scrape(relay)
        assert v["hangwatch_relay_reports_not_forwarded_total", (("reason", "backlog"),)] == 1
        assert v["hangwatch_relay_agent_streams_ended_total", (("reason", "backlog"),)] == 1
        assert v["hangwatch_relay_reports_received_total", ()] == 3
        assert v["hangwatch_relay_reports_forwarded_total", ()] == 0
        assert v["hangwatch_relay_pending_reports", ()] == 2
    finally:
        relay.stop()
        for c in clients:
            c.close()
    assert relay.not_forwarded["stopping"] == 2
    assert relay.streams_ended["stopping"] == 2


@pytest.mark.timeout(60)
def test_a_relay_whose_forwarding_fails_stops_and_fails_its_liveness_probe(
    coordinator: Coordinator, relay: Relay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the forwarding task must not leave a relay that looks alive and
    turns every agent away: it stops (`hangwatch relay` then exits non-zero for
    its supervisor) and /healthz fails. The fault: routing the coordinator's
    answer to a refused report raises."""

    def broken(self: Relay, ack: object) -> None:
        raise RuntimeError("injected routing fault")

    monkeypatch.setattr(Relay, "_route", broken)
    a = _agent(coordinator, relay, 0)
    try:
        bad = progress_at([0], 1)
        bad[0].groups[0].last_completed = -5  # refused by validation: the coordinator acks it
        a.report_progress(1, bad)
        wait_for(lambda: not relay.alive, 10, "the relay to stop")
    finally:
        a.close()
    health = _get(relay, "/healthz")
    assert health.status_code == 503, health.text
