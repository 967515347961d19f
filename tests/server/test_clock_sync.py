"""The agent's clock offset estimate against a real coordinator, and the poll grid."""

from __future__ import annotations

from hangwatch.agent.client import CoordinatorClient
from hangwatch.agent.lateness import ClockSync, OffsetSample, next_tick_delay, offset_from
from hangwatch.server.coordinator import Coordinator

from hangwatch import pollgrid
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
    offset = 250_000_000  # the coordinator's clock is 0.25 s ahead of ours
    wall = 41 * second + 50_000_000
    instants = {pollgrid.instant_ns(k, second) for k in range(30, 60)}
    delay = next_tick_delay(1.0, wall, offset_ns=offset)
    assert 0 < delay <= 1.5
    assert wall + offset + round(delay * 1e9) in instants
    # On an instant: the next one, never a second poll now.
    on = pollgrid.instant_ns(45, second)
    assert on + round(next_tick_delay(1.0, on, 0) * 1e9) == pollgrid.instant_ns(46, second)
    # The dither spreads the instants over half a tick, the same for every agent.
    phases = sorted((pollgrid.instant_ns(k, second) % second) / second for k in range(100))
    assert phases[0] < 0.02 and phases[-1] > 0.48 and max(phases) < 0.5
    assert pollgrid.nearest(on + 3_000_000, second) == (45, 3_000_000)


def test_exchange_with_a_real_coordinator(coordinator: Coordinator) -> None:
    client = CoordinatorClient(
        Config.of(coordinator=coordinator.grpc_address, job_id="j"), agent_id="a", host="h"
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
