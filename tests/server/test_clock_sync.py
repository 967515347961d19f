"""The agent's clock offset estimate against a real coordinator, and the poll grid."""

from __future__ import annotations

from hangwatch.agent.client import CoordinatorClient
from hangwatch.agent.lateness import ClockSync, OffsetSample, next_tick_delay, offset_from
from hangwatch.server.coordinator import Coordinator

from hangwatch.config import Config
from hangwatch.wire import pb


def test_offset_formula_recovers_a_known_offset_and_delay() -> None:
    # Their clock is 5 ms ahead; 2 ms out, 1 ms handling, 3 ms back.
    t0 = 1_000_000_000
    t1 = t0 + 2_000_000 + 5_000_000
    t2 = t1 + 1_000_000
    t3 = t0 + 2_000_000 + 1_000_000 + 3_000_000
    s = offset_from(t0, t1, t2, t3)
    assert s.delay_ns == 5_000_000
    # NTP's error is at most half the delay: here the asymmetry (2 vs 3 ms) costs 0.5 ms.
    assert abs(s.offset_ns - 5_000_000) <= s.delay_ns // 2
    assert s.offset_ns == 4_500_000


def test_the_smallest_delay_among_recent_round_trips_wins() -> None:
    c = ClockSync()
    assert (c.offset_ns, c.error_ns) == (0, 0)
    c.add(OffsetSample(offset_ns=9_000_000, delay_ns=20_000_000), now=0.0)
    c.add(OffsetSample(offset_ns=1_000_000, delay_ns=400_000), now=1.0)
    c.add(OffsetSample(offset_ns=7_000_000, delay_ns=9_000_000), now=2.0)
    assert (c.offset_ns, c.error_ns) == (1_000_000, 200_000)
    assert not c.due(3.0) and c.due(40.0)


def test_polls_land_on_the_coordinators_grid() -> None:
    second = 1_000_000_000
    # 0.3 s past a tick of the coordinator's clock, whose clock is 0.25 s ahead of ours.
    wall = 41 * second + 50_000_000
    delay = next_tick_delay(1.0, wall, offset_ns=250_000_000)
    assert abs(delay - 0.7) < 1e-9
    assert (wall + int(delay * 1e9) + 250_000_000) % second == 0
    # Exactly on a tick: the next one, never a second poll now.
    assert next_tick_delay(1.0, 42 * second, 0) == 1.0


def test_exchange_with_a_real_coordinator(coordinator: Coordinator) -> None:
    client = CoordinatorClient(
        Config(coordinator=coordinator.grpc_address, job_id="j"), agent_id="a", host="h"
    )
    try:
        sync = ClockSync()
        for i in range(4):
            assert sync.exchange(client.health, now=float(i))
        # One host, one clock: the estimate is within its own error bound of zero.
        assert 0 < sync.error_ns < 50_000_000
        assert abs(sync.offset_ns) <= sync.error_ns + 1_000_000
        resp = client.health(pb.HealthRequest())
        assert 0 < resp.receive_ns <= resp.send_ns
    finally:
        client.close()
