"""One real coordinator process, many simulated node agents over real gRPC, one stalled rank.

A scaled-down `benchmarks/coordinator_load.py`: it checks correctness, not
speed. The coordinator runs as `python -m hangwatch server`; the agents
(`tests.support.simagents`) run in a child process, register 8 ranks
each, report progress at 1 Hz, and answer the DUMP command with chunked,
sha256-checked uploads. The analyzer in the coordinator must name the rank
the simulation made lag, in the TP group and at the seq it never entered.
"""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

import pytest
from hangwatch.analyzer.discovery import discover
from hangwatch.analyzer.reading import read_packed

from hangwatch import formats
from hangwatch.formats import nodearchive
from hangwatch.safepickle import safe_loads
from tests.helpers import wait_until
from tests.support.chaos import RelayProc
from tests.support.simagents import (
    KINDS,
    OPS_PER_STEP,
    Clock,
    CoordinatorProcess,
    DumpFactory,
    Fleet,
    Hang,
    Topology,
    last_seq,
    op_at,
    rank_pos,
    sweep,
)

# 32 agents; 129 process groups (more than 127 once crashed the analyzer).
RANKS = 256
# Fewer entries than the benchmark's 2,000 keep the bundle under the size at
# which the analyzer starts a process pool: seconds, not tens of seconds, on CI.
ENTRIES = 250
LAGGING = 179
STALL_TIMEOUT = 2.0


def _hang(topo: Topology, clock: Clock, lagging: int) -> Hang:
    h = clock.hang_index_after(time.time())
    return Hang(lagging=lagging, hang_index=h, blocked=sweep(topo, lagging, h))


@pytest.mark.timeout(30)
def test_topology_groups_are_consistent() -> None:
    topo = Topology(ranks=RANKS)
    groups = topo.groups()
    assert len(groups) == 1 + RANKS // 8 + RANKS // 4 + 8 * 4
    for r in range(RANKS):
        for k in KINDS:
            members = topo.group_members(k, r)
            assert r in members
            assert groups[topo.group_name(k, r)] == (k, members)
    # TP groups are one node; PP and DP groups span nodes.
    assert topo.group_members("tp", LAGGING) == list(range(176, 184))
    assert len({m // 8 for m in topo.group_members("pp", LAGGING)}) == 4
    assert len({m // 8 for m in topo.group_members("dp", LAGGING)}) == topo.dp


@pytest.mark.timeout(30)
def test_sweep_blocks_every_rank_behind_the_lagging_one() -> None:
    topo = Topology(ranks=RANKS)
    hang = _hang(topo, Clock(epoch=time.time()), LAGGING)
    h = hang.hang_index
    assert op_at(h)[0] == "tp"
    assert set(hang.blocked) == set(range(RANKS))
    assert all(h <= b < h + 2 * OPS_PER_STEP for b in hang.blocked.values())
    assert {r for r, b in hang.blocked.items() if b == h} == set(topo.group_members("tp", LAGGING))
    lag = rank_pos(LAGGING, h + 100, hang)
    peer = rank_pos(LAGGING + 1, h + 100, hang)
    assert (lag.completed, lag.started, lag.enqueued) == (h - 1, None, h - 1)
    assert (peer.completed, peer.started) == (h - 1, h)
    # Before the hang position every rank runs normally.
    assert rank_pos(LAGGING, h - 1, hang).started == h - 1


@pytest.mark.timeout(60)
def test_templated_dump_is_exactly_the_pickled_dump() -> None:
    topo = Topology(ranks=RANKS)
    clock = Clock(epoch=time.time() - 30)
    factory = DumpFactory(topo, clock, entries=ENTRIES)
    hang = _hang(topo, clock, LAGGING)
    for r in (0, LAGGING, LAGGING + 1, RANKS - 1):
        pos = rank_pos(r, 1 << 40, hang)
        data = factory.dump_bytes(r, pos)
        assert data == pickle.dumps(factory.dump_dict(pos, factory.rank_strings(r)), protocol=2)
        d = safe_loads(data)
        assert d["version"] == "2.10"
        assert len(d["entries"]) == ENTRIES
        names = {topo.group_name(k, r) for k in KINDS}
        assert set(d["pg_config"]) == names
        assert {e["process_group"][0] for e in d["entries"]} == names
        for k in KINDS:
            cfg = d["pg_config"][topo.group_name(k, r)]
            assert cfg["ranks"] == str(topo.group_members(k, r))
        last = d["entries"][-1]
        assert last["record_id"] == pos.enqueued
        status = d["pg_status"]["1"]  # TP: local pg_id 1
        assert status["last_completed_collective"] == last_seq("tp", pos.completed)
        if r == LAGGING:
            assert all(e["state"] == "completed" for e in d["entries"])
            assert status["last_enqueued_collective"] == hang.seq - 1
        else:
            assert any(e["state"] == "started" for e in d["entries"])


def _coordinator(data_dir: Path, *, full_dump_max_ranks: int) -> CoordinatorProcess:
    return CoordinatorProcess(
        data_dir,
        stall_timeout=STALL_TIMEOUT,
        dump_deadline=30,
        agent_lost_timeout=30,
        extra_args=["--full-dump-max-ranks", str(full_dump_max_ranks)],
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("two_phase", [False, True], ids=["full-dumps", "tails-first"])
def test_one_stalled_rank_among_many_agents_gives_one_incident(
    tmp_path: Path, two_phase: bool
) -> None:
    data_dir = tmp_path / "coord"
    # Below the job's size: the large-job path (tails, then the lagging
    # rank's full dump) at a size CI can afford.
    with _coordinator(data_dir, full_dump_max_ranks=RANKS // 2 if two_phase else RANKS) as coord:
        fleet = Fleet(target=coord.grpc, job_id="scale-job", ranks=RANKS, entries=ENTRIES, procs=1)
        with fleet:
            assert fleet.wait_ready(timeout=40) == RANKS // 8
            hang = fleet.stall(LAGGING)
            inc = coord.wait_incident("scale-job", timeout=40)
            bundle = data_dir / "incidents" / inc["id"]
            lagging_full = bundle / f"rank_{LAGGING}" / f"{formats.FR_FILE_PREFIX}{LAGGING}"
            if two_phase:
                # The agent records its full upload when the ack returns, after the
                # coordinator has put the file in place: wait for both (measured:
                # the file alone once left full_uploads empty).
                wait_until(
                    lambda: lagging_full.is_file() and bool(fleet.stats()["full_uploads"]),
                    timeout=20,
                    what="the lagging rank's full dump, stored and acknowledged",
                    interval=0.2,
                )
            stats = fleet.stats()
            # One incident, the hang's: none while the job ran healthy, none more
            # while it stays hung (the same promises on a fake clock, tick by
            # tick: tests/server/test_grpc.py).
            rows = coord.get("/api/incidents?job=scale-job")
        assert coord.stop() == 0, coord.log()[-3000:]

    assert len(rows) == 1, rows
    assert inc["status"] == "analyzed", inc.get("error")
    assert inc["ranks_dumped"] == list(range(RANKS))
    assert inc["ranks_unreachable"] == {}
    assert inc["verdict"] == "hang"
    assert inc["lagging_ranks"] == [LAGGING]
    sc = inc["report"]["stalled_collective"]
    assert sc["group"] == fleet.topo.group_name("tp", LAGGING)
    assert sc["seq"] == hang.seq
    assert sc["profiling_name"] == "nccl:_all_gather_base"
    assert sc["missing_ranks"] == [LAGGING]
    assert sorted(sc["entered_ranks"]) == [r for r in range(176, 184) if r != LAGGING]

    assert stats["errors"] == []
    assert stats["dumps_done"] == RANKS // 8 and stats["dumps_rejected"] == 0
    # Tails-first: FR tail and meta.json (stacks inside); else FR, meta, stacks.
    assert stats["files_uploaded"] == (2 if two_phase else 3) * RANKS
    assert stats["reports_failed"] == 0
    assert stats["tail_dumps"] == (RANKS // 8 if two_phase else 0)
    # Phase two: the lagging rank's full history, and nobody else's.
    assert stats["full_uploads"] == ([LAGGING] if two_phase else [])

    # What the coordinator stored is byte for byte what the agents sent.
    full = DumpFactory(fleet.topo, fleet.clock, entries=ENTRIES)
    tails = DumpFactory(fleet.topo, fleet.clock, entries=ENTRIES, tail_context=8)
    # Tails-first: one node archive per agent (BundleChunk.node_archive).
    archived, bad = nodearchive.index(bundle)
    assert bad == [] and len(nodearchive.archives(bundle)) == (RANKS // 8 if two_phase else 0)

    def stored(r: int, name: str) -> bytes | None:
        m = archived.get((r, name))
        if m is not None:
            return nodearchive.read(m, nodearchive.MAX_MEMBER_BYTES)
        p = bundle / f"rank_{r}" / name
        return p.read_bytes() if p.is_file() else None

    for r in range(RANKS):
        rank_dir = bundle / f"rank_{r}"
        pos = rank_pos(r, 1 << 40, hang)
        meta = json.loads(stored(r, formats.META_FILE) or b"null")
        assert (stored(r, formats.STACKS_FILE) is not None) != two_phase, f"rank {r}"
        assert ("stacks" in meta) == two_phase, f"rank {r}"
        full_path = rank_dir / f"{formats.FR_FILE_PREFIX}{r}"
        if two_phase:
            tail = stored(r, f"{formats.FR_TAIL_PREFIX}{r}")
            assert tail is not None and tail == tails.dump_bytes(r, pos), f"rank {r}"
            assert len(tail) < len(full.dump_bytes(r, pos)) // 4
            assert full_path.is_file() == (r == LAGGING), f"rank {r}"
        else:
            assert stored(r, f"{formats.FR_TAIL_PREFIX}{r}") is None
        if full_path.is_file():
            assert full_path.read_bytes() == full.dump_bytes(r, pos), f"rank {r}"
    assert not list(bundle.rglob("*.part"))
    if two_phase:
        # Each archive carries its node's tails decoded (hangwatch.analyzer.packed),
        # and the analyzer takes every tail from them.
        found = discover(bundle, None)
        assert len(found.columns) == RANKS // 8
        tails_found = [c for c in found.dumps if c.member is not None]
        done, errors = read_packed(
            tails_found, found.columns, max_bytes=1 << 30, max_entries=1 << 20
        )
        assert errors == [] and len(done) == len(tails_found) == RANKS
    # Either way the lagging rank's stacks reach the verdict's evidence.
    assert "_bias_dropout_add" in (inc["report"]["evidence"][str(LAGGING)]["stacks"] or "")


def _connections_to(address: str, pids: list[int]) -> int:
    """TCP connections established to `address` (HOST:PORT on loopback) from
    the processes `pids`: /proc/net/tcp's rows whose remote port is its port,
    matched by socket inode to those processes' open files."""
    port = int(address.rsplit(":", 1)[1])
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for row in f:
                fields = row.split()
                remote, state, inode = fields[2], fields[3], fields[9]
                if int(remote.rsplit(":", 1)[1], 16) == port and state == "01":
                    inodes.add(f"socket:[{inode}]")
    n = 0
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        for fd in fd_dir.iterdir():
            try:
                n += os.readlink(fd) in inodes
            except OSError:  # closed meanwhile
                continue
    return n


@pytest.mark.timeout(90)
@pytest.mark.parametrize("calls_via_relay", [True, False], ids=["carried", "straight"])
def test_agents_behind_relays_hold_no_connection_to_the_coordinator(
    tmp_path: Path, calls_via_relay: bool
) -> None:
    """32 agents behind 2 relays. With their calls carried (as the agent makes
    them), the coordinator holds one connection from each relay and none from
    an agent, registered and through the whole incident (about 20 KB of its
    memory each: benchmarks/grpc_conn_memory.py). Straight, as agents
    registered and uploaded before, every agent holds at least one."""
    agents = RANKS // 8
    data_dir = tmp_path / "coord"
    with _coordinator(data_dir, full_dump_max_ranks=RANKS // 2) as coord:
        relays = [
            RelayProc(coordinator=coord.grpc, log_path=tmp_path / f"relay-{i}.log")
            for i in range(2)
        ]
        try:
            for r in relays:
                r.start()
            fleet = Fleet(
                target=coord.grpc,
                job_id="relayed-job",
                ranks=RANKS,
                entries=ENTRIES,
                procs=1,
                progress_relays=tuple(r.grpc for r in relays),
                calls_via_relay=calls_via_relay,
            )
            with fleet:
                assert fleet.wait_ready(timeout=40) == agents

                def held() -> tuple[int, list[int]]:
                    """Connections to the coordinator: the agents', each relay's."""
                    return (
                        _connections_to(coord.grpc, fleet.pids),
                        [_connections_to(coord.grpc, [r.pid]) for r in relays],
                    )

                agents_held, relays_held = held()
                if calls_via_relay:
                    assert (agents_held, relays_held) == (0, [1, 1])
                else:
                    assert agents_held >= agents, agents_held
                fleet.stall(LAGGING)
                inc = coord.wait_incident("relayed-job", timeout=40)
                if calls_via_relay:
                    # Through the whole incident, uploads and all: still none.
                    assert held()[0] == 0
                stats = fleet.stats()
            carried = [r.metrics() for r in relays]
        finally:
            for r in relays:
                r.stop()
        assert coord.stop() == 0, coord.log()[-3000:]
    assert inc["status"] == "analyzed", inc.get("error")
    assert inc["ranks_dumped"] == list(range(RANKS))
    assert (inc["verdict"], inc["lagging_ranks"]) == ("hang", [LAGGING])
    assert stats["errors"] == [] and stats["reports_failed"] == 0
    # Each agent's Register and its node archive, through one relay or the other.
    for method, count in (("Register", agents), ("UploadFiles", agents)):
        through = sum(
            m[("hangwatch_relay_calls_carried_total", (("method", method),))] for m in carried
        )
        assert through == (count if calls_via_relay else 0), (method, carried)
