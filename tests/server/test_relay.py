"""The progress relay (`hangwatch relay`, server.relay): many agents' reports, one stream.

A real coordinator and a real relay over loopback gRPC, both on port 0; the
agents are the agent's own client (`agent.client.CoordinatorClient`) with
`progress_relay` set. What the relay must keep: every report applied, in
order, as if sent straight; an agent told of its unknown session or refused
report exactly as the coordinator tells it, without ending any other agent's
stream; and, when the relay or its coordinator is gone, the agents' progress
going straight to the coordinator instead of nowhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from hangwatch.agent import client as client_mod
from hangwatch.agent.client import CoordinatorClient, StaleSession
from hangwatch.server.coordinator import Coordinator
from hangwatch.server.relay import Relay

from hangwatch.config import Config
from hangwatch.wire import pb, rpc
from tests.server.conftest import free_port, progress_at, rank_infos, start_relay, wait_for
from tests.support.pki import make_pki, needs_openssl

JOB = "relayed"


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


def _completed(coordinator: Coordinator, rank: int) -> int | None:
    snap = coordinator.registry.snapshot(JOB)
    row = None if snap is None else next((r for r in snap.ranks if r.rank == rank), None)
    g = None if row is None else next((g for g in row.groups if g.group == "0"), None)
    return None if g is None else g.last_completed


def _requests(coordinator: Coordinator, method: str, code: str = "OK") -> float:
    labels = {"method": method, "code": code}
    return coordinator.metrics.value("hangwatch_grpc_requests_total", labels)


def _until_refused(client: CoordinatorClient, seq: int, ranks: list[int]) -> grpc.RpcError:
    """Report until the agent's stream is found ended; the error it ended with."""
    end = time.monotonic() + 10
    while time.monotonic() < end:
        try:
            client.report_progress(seq, progress_at(ranks, seq))
        except grpc.RpcError as e:
            return e
        time.sleep(0.05)
    raise AssertionError("the agent's stream never ended")


@pytest.mark.timeout(60)
def test_four_agents_through_a_relay_arrive_in_batches_in_order(
    coordinator: Coordinator, relay: Relay, agents: Callable[[int], CoordinatorClient]
) -> None:
    clients = [agents(n) for n in range(4)]
    for step in range(1, 6):
        for n, c in enumerate(clients):
            c.report_progress(step, progress_at([2 * n, 2 * n + 1], step))
            assert c.progress_via_relay
        time.sleep(0.03)
    wait_for(
        lambda: all(_completed(coordinator, r) == 5 for r in range(8)), 10, "every report applied"
    )
    # Twenty reports, none on a stream of their own at the coordinator, in
    # fewer messages than reports: that is the relay's point.
    assert relay.reports_sent == 20
    assert 1 <= relay.batches_sent < 20
    assert _requests(coordinator, "StreamProgress") == 0
    # Counted once its every report is applied: a moment after the last one.
    wait_for(
        lambda: _requests(coordinator, "RelayProgress") == relay.batches_sent,
        10,
        "every batch counted",
    )
    assert coordinator.metrics.value("hangwatch_progress_ranks_total", {"form": "columns"}) == 40


@pytest.mark.timeout(60)
def test_an_unknown_session_reaches_its_agent_through_the_relay(
    coordinator: Coordinator, relay: Relay, agents: Callable[[int], CoordinatorClient]
) -> None:
    a, b = agents(0), agents(1)
    a.report_progress(1, progress_at([0, 1], 1))
    b.report_progress(1, progress_at([2, 3], 1))
    wait_for(lambda: _completed(coordinator, 3) == 1, 10, "b's first report")
    # Node 0's agent restarts elsewhere: a's session is over.
    again = CoordinatorClient(a.cfg, agent_id="node-0", host="host-0")
    try:
        again.register(rank_infos([0, 1], 8))
    finally:
        again.close()

    def stale() -> bool:
        try:
            a.report_progress(2, progress_at([0, 1], 2))
        except StaleSession:
            return True
        time.sleep(0.05)
        return False

    wait_for(stale, 10, "a to learn its session is gone")
    # b's stream through the same relay went on.
    b.report_progress(2, progress_at([2, 3], 2))
    wait_for(lambda: _completed(coordinator, 3) == 2, 10, "b's next report")
    assert b.progress_via_relay
    # Registered again, a reports through the relay on a new stream, in full.
    a.register(rank_infos([0, 1], 8))
    assert a.progress_needs_full()
    a.report_progress(3, progress_at([0, 1], 7))
    wait_for(lambda: _completed(coordinator, 0) == 7, 10, "a's report on its new stream")
    assert a.progress_via_relay


@pytest.mark.timeout(60)
def test_a_refused_report_ends_only_its_agents_stream(
    coordinator: Coordinator, relay: Relay, agents: Callable[[int], CoordinatorClient]
) -> None:
    a, b = agents(0), agents(1)
    bad = progress_at([0], 1)
    bad[0].groups[0].last_completed = -5  # below -1: refused by validation
    a.report_progress(1, bad)
    b.report_progress(1, progress_at([2, 3], 1))
    err = _until_refused(a, 2, [0, 1])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "below -1" in (err.details() or "")
    # Refused, a goes straight to the coordinator for a while; b never noticed.
    b.report_progress(2, progress_at([2, 3], 2))
    wait_for(lambda: _completed(coordinator, 2) == 2, 10, "b's report after a's was refused")
    assert b.progress_via_relay
    a.report_progress(3, progress_at([0, 1], 3))
    assert not a.progress_via_relay
    wait_for(lambda: _completed(coordinator, 0) == 3, 10, "a's report sent straight")
    assert _requests(coordinator, "StreamProgress") >= 1


@pytest.mark.timeout(60)
def test_when_the_relay_stops_its_agents_report_to_the_coordinator(
    coordinator: Coordinator, relay: Relay, agents: Callable[[int], CoordinatorClient]
) -> None:
    a = agents(0)
    a.report_progress(1, progress_at([0, 1], 1))
    wait_for(lambda: _completed(coordinator, 1) == 1, 10, "the relayed report")
    relay.stop()
    err = _until_refused(a, 2, [0, 1])
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert a.progress_needs_full()
    a.report_progress(3, progress_at([0, 1], 3))
    assert not a.progress_via_relay
    wait_for(lambda: _completed(coordinator, 1) == 3, 10, "the report sent straight")


@pytest.mark.timeout(60)
def test_a_relay_without_its_coordinator_turns_agents_away(coordinator: Coordinator) -> None:
    r = start_relay(f"127.0.0.1:{free_port()}")  # a port nothing listens on
    try:
        cfg = Config.of(coordinator=coordinator.grpc_address, progress_relay=r.address, job_id=JOB)
        a = CoordinatorClient(cfg, agent_id="node-0", host="host-0")
        try:
            a.register(rank_infos([0, 1], 8))
            err = _until_refused(a, 1, [0, 1])
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            assert "no coordinator" in (err.details() or "")
            a.report_progress(3, progress_at([0, 1], 3))
            wait_for(lambda: _completed(coordinator, 0) == 3, 10, "the report sent straight")
            assert not r.connected
        finally:
            a.close()
    finally:
        r.stop()


@pytest.mark.timeout(90)
def test_after_its_coordinator_restarts_the_relay_reconnects_and_agents_come_back(
    start_coordinator: Callable[..., Coordinator], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator goes away under a relay and comes back on the same port:
    the relay ends its agents' streams, reconnects, and an agent that reported
    straight meanwhile returns to the relay once its pause is over, on a new
    stream that opens with a full report (as the agent's sender loop drives it)."""
    monkeypatch.setattr(client_mod, "RELAY_RETRY_S", 2.0)
    port = free_port()
    first = start_coordinator(grpc_port=port)
    r = start_relay(first.grpc_address)
    try:
        wait_for(lambda: r.connected, 10, "the relay's stream to the coordinator")
        cfg = Config.of(coordinator=first.grpc_address, progress_relay=r.address, job_id=JOB)
        a = CoordinatorClient(cfg, agent_id="node-0", host="host-0")
        try:
            a.register(rank_infos([0, 1], 8))
            a.report_progress(1, progress_at([0, 1], 1))
            wait_for(lambda: _completed(first, 0) == 1, 10, "the relayed report")
            first.stop(grace=0.5)
            wait_for(lambda: not r.connected, 10, "the relay to see its coordinator gone")
            second = start_coordinator(grpc_port=port)
            wait_for(lambda: r.connected, 30, "the relay back on the restarted coordinator")
            seq = [1]
            sent: list[tuple[bool, bool]] = []  # (sent in full, through the relay)

            def back_through_the_relay() -> bool:
                seq[0] += 1
                full = False
                try:
                    if not a.session_id:
                        a.register(rank_infos([0, 1], 8))
                    full = a.progress_needs_full()
                    a.report_progress(seq[0], progress_at([0, 1], seq[0]))
                except (StaleSession, grpc.RpcError):
                    pass  # the agent's loop backs off and goes on the same way
                sent.append((full, a.progress_via_relay))
                time.sleep(0.1)
                return a.progress_via_relay

            wait_for(back_through_the_relay, 30, "the agent's progress through the relay again")
            wait_for(lambda: _completed(second, 0) == seq[0], 10, "its report applied")
            # It reported straight in between, and the report that took it back
            # to the relay was a full one, on a new stream.
            first_back = next(i for i, (_, via) in enumerate(sent) if via)
            assert first_back > 0, sent
            assert sent[first_back][0], sent
            assert _requests(second, "RelayProgress") >= 1
            assert _requests(second, "StreamProgress") >= 1
        finally:
            a.close()
    finally:
        r.stop()


@pytest.mark.timeout(60)
def test_hangwatch_relay_runs_with_a_token_and_stops_on_sigterm(
    start_coordinator: Callable[..., Coordinator], tmp_path: Path
) -> None:
    token = "relay-token-123"
    coordinator = start_coordinator(token=token)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    env["HANGWATCH_TOKEN"] = token
    cmd = [sys.executable, "-m", "hangwatch", "relay", "--grpc-port", "0", "--http-port", "0"]
    log = tmp_path / "relay.log"
    with (
        log.open("wb") as err,
        subprocess.Popen(
            [*cmd, "--relay-window", "0.05", "--coordinator", coordinator.grpc_address],
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
            text=True,
        ) as proc,
    ):
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("hangwatch relay: grpc=127.0.0.1:"), line
            address = line.split()[2].removeprefix("grpc=")
            http = line.split()[3].removeprefix("http=")
            assert http.startswith("127.0.0.1:") and http != address, line
            # Its stream to the coordinator is up once it logs so; before that
            # it would turn an agent away (the test above).
            wait_for(lambda: "forwarding progress to" in log.read_text(), 20, "the relay's log")
            cfg = Config.of(
                coordinator=coordinator.grpc_address,
                progress_relay=address,
                job_id=JOB,
                token=token,
            )
            a = CoordinatorClient(cfg, agent_id="node-0", host="host-0")
            try:
                a.register(rank_infos([0, 1], 8))
                a.report_progress(1, progress_at([0, 1], 4))
                wait_for(lambda: _completed(coordinator, 0) == 4, 20, "progress through the relay")
                assert a.progress_via_relay
                assert _requests(coordinator, "RelayProgress") >= 1
            finally:
                a.close()
            # Its /metrics is behind the same token (server.relay_http).
            metrics = f"http://{http}/metrics"
            assert httpx.get(metrics, timeout=10).status_code == 401
            auth = {"Authorization": f"Bearer {token}"}
            text = httpx.get(metrics, headers=auth, timeout=10).text
            assert "hangwatch_relay_reports_forwarded_total 1.0" in text, text
            # A caller without the token is turned away by the relay itself.
            with grpc.insecure_channel(address) as ch:
                call = rpc.CoordinatorStub(ch).StreamProgress(iter([pb.ProgressReport()]))
                with pytest.raises(grpc.RpcError) as refused:
                    list(call)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--relay-window", "0"], "--relay-window must be positive"),
        # Agents given the CA dial their relay over TLS: a relay that would serve
        # them plaintext is a setting error, not a relay that turns every agent away.
        (
            ["--tls-ca", "/nonexistent/ca.pem"],
            "dial a relay over TLS; give it --tls-cert, --tls-key",
        ),
    ],
    ids=["relay-window", "ca-without-certificate"],
)
def test_hangwatch_relay_refuses_a_bad_setting_in_one_line(args: list[str], why: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    out = subprocess.run(
        [sys.executable, "-m", "hangwatch", "relay", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=20,
    )
    assert out.returncode == 2
    assert why in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.timeout(60)
@needs_openssl
def test_a_relay_serves_and_dials_mutual_tls(
    start_coordinator: Callable[..., Coordinator], tmp_path: Path
) -> None:
    """A deployment on mTLS: the coordinator asks every peer for a certificate,
    so the relay presents its own upstream, and serves its agents TLS with the
    same one, asking them for theirs. Agents given the CA dial the relay over
    TLS as they dial the coordinator; the bearer token never crosses in clear."""
    d = make_pki(tmp_path / "pki", ("coordinator", "relay", "agent"))
    ca = str(d / "ca.pem")
    coordinator = start_coordinator(
        tls_cert=str(d / "coordinator.pem"), tls_key=str(d / "coordinator.key"), tls_ca=ca
    )
    relay = start_relay(
        coordinator.grpc_address,
        tls_cert=str(d / "relay.pem"),
        tls_key=str(d / "relay.key"),
        tls_ca=ca,
    )
    try:
        wait_for(lambda: relay.connected, 10, "the relay's mTLS stream to the coordinator")
        cfg = Config.of(
            coordinator=coordinator.grpc_address,
            progress_relay=relay.address,
            job_id=JOB,
            tls_cert=str(d / "agent.pem"),
            tls_key=str(d / "agent.key"),
            tls_ca=ca,
        )
        agent = CoordinatorClient(cfg, agent_id="node-0", host="host-0")
        try:
            agent.register(rank_infos([0, 1], 8))
            for step in (1, 2):
                agent.report_progress(step, progress_at([0, 1], step))
                assert agent.progress_via_relay
            wait_for(lambda: _completed(coordinator, 1) == 2, 10, "the relayed report applied")
            assert relay.reports_sent == 2
            # The relay answers probes over the same TLS, its agent counted.
            with client_mod.build_channel(cfg, relay=True) as ch:
                h = rpc.CoordinatorStub(ch).Health(pb.HealthRequest(), timeout=10)
            assert h.serving and h.agents_connected == 1
        finally:
            agent.close()
        # Without a client certificate, or in plaintext, the relay refuses.
        roots = grpc.ssl_channel_credentials(root_certificates=(d / "ca.pem").read_bytes())
        with grpc.secure_channel(relay.address, roots) as ch:
            with pytest.raises(grpc.RpcError) as ei:
                rpc.CoordinatorStub(ch).Health(pb.HealthRequest(), timeout=5)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(relay.address) as ch, pytest.raises(grpc.RpcError):
            rpc.CoordinatorStub(ch).Health(pb.HealthRequest(), timeout=5)
    finally:
        relay.stop()


@pytest.mark.timeout(30)
def test_a_relay_answers_health_while_it_has_its_coordinator(coordinator: Coordinator) -> None:
    """Health is the relay's own: serving only with its stream to the
    coordinator up (agents are turned away without it), open without a token."""
    port = free_port()
    relay = start_relay(f"127.0.0.1:{port}")  # nothing listens there
    try:
        with grpc.insecure_channel(relay.address) as ch:
            h = rpc.CoordinatorStub(ch).Health(pb.HealthRequest(), timeout=10)
        assert not h.serving and h.version
    finally:
        relay.stop()
    relay = start_relay(coordinator.grpc_address, token="s3cret")
    try:
        wait_for(lambda: relay.connected, 10, "the relay's stream to the coordinator")
        with grpc.insecure_channel(relay.address) as ch:
            h = rpc.CoordinatorStub(ch).Health(pb.HealthRequest(), timeout=10)
        assert h.serving and h.agents_connected == 0
    finally:
        relay.stop()


@pytest.mark.timeout(60)
def test_the_coordinator_counts_each_relays_reports_and_its_open_streams(
    coordinator: Coordinator, relay: Relay, agents: Callable[[int], CoordinatorClient]
) -> None:
    """What the HangwatchRelayDown alert reads: per relay, the reports that came
    through it and its streams open, 0 once it is gone."""
    c = agents(0)
    for step in (1, 2, 3):
        c.report_progress(step, progress_at([0, 1], step))
    labels = {"relay": relay.relay_id}
    wait_for(
        lambda: coordinator.metrics.value("hangwatch_relay_reports_total", labels) == 3,
        10,
        "three reports counted for the relay",
    )
    assert coordinator.metrics.value("hangwatch_relay_streams", labels) == 1
    relay.stop()
    wait_for(
        lambda: coordinator.metrics.value("hangwatch_relay_streams", labels) == 0,
        10,
        "the relay's stream counted closed",
    )


@pytest.mark.timeout(60)
def test_a_relay_keeps_an_agent_that_pings_often_while_it_has_nothing_to_say(
    relay: Relay, agents: Callable[[int], CoordinatorClient]
) -> None:
    """Agents ping every 20 s with or without calls, and a relay rarely sends
    them anything. With gRPC's default server settings (one ping in 5 min
    "without data", GOAWAY past 2 strikes) a relay dropped its agents about a
    minute after they connected (32,768 simulated ranks through 16 relays).
    Here a quiet WatchCommands call pings every 0.5 s under a 6 s deadline:
    its deadline ends it, not the relay (UNAVAILABLE "Too many pings" after
    3.5 s at a relay with gRPC's defaults)."""
    a = agents(0)
    options = [
        ("grpc.keepalive_time_ms", 500),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    with grpc.insecure_channel(relay.address, options=options) as ch:
        call = rpc.CoordinatorStub(ch).WatchCommands(
            pb.WatchRequest(job_id=JOB, agent_id=a.agent_id, session_id=a.session_id), timeout=6
        )
        with pytest.raises(grpc.RpcError) as ei:
            list(call)
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ei.value
