"""The registry's mutable per-job records, as the gRPC handlers last left them.

Only the registry changes these, under its lock; the views, the stall scan
and the incident manager read them through it. "When" fields are the
coordinator's own monotonic clock: agents' clocks are never stored here.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from hangwatch.server.live.celltable import Cell, CellTable
from hangwatch.server.live.commands import Mailbox
from hangwatch.server.live.detector import MOVE_SPACING_S, steady
from hangwatch.server.live.rates import RankRates

from hangwatch.wire import pb

EVENT_RING: Final = 256  # recent events kept per job


@dataclass(slots=True)
class RankRecord:
    """What the coordinator reads of a rank. RankInfo's local_rank,
    world_size, torch_version and fr_source and a report's fr_age_s are
    validated and not kept: nothing read them, and they were 96 bytes a rank
    (five slots, a world_size int and an age float past the small-int cache)."""

    rank: int
    agent_id: str
    host: str
    pid: int
    backend: str
    process_state: str = "unknown"
    # Reached Python's exit, its final numbers read (RankProgress.finished):
    # in no collective, and a collective it entered is one it returned from.
    finished: bool = False
    last_report: float | None = None
    # Its numbers for each group it registered: `cell_count` cells of the
    # job's CellTable from `first_cell` on, in registration order.
    first_cell: int = 0
    cell_count: int = 0
    # Its row in the job's RankRates: CPU time plus run-queue wait, ns
    # (RankProgress.cpu_time_ns, runqueue_wait_ns), and storage bytes read
    # and written (RankProgress.io_bytes), as rates.
    rate_slot: int = -1
    # Inside torch.compile at its agent's last quiet-period stack sample
    # (RankProgress.in_compile): working, while some rank of its job is busy.
    in_compile: bool = False
    # A compiler process runs under it (RankProgress.compiler_running): work.
    compiler_running: bool = False


@dataclass(slots=True)
class GroupRecord:
    name: str
    desc: str
    ranks: array[int]  # its members, ascending
    last_progress: float  # coordinator monotonic time a member's last_completed last changed
    # The registration's GroupInfo members as sent (either form): every member
    # registers the group, and one sent the same way again is not re-expanded.
    sent_as: array[int] = field(default_factory=lambda: array("i"))


@dataclass(slots=True)
class AgentRecord:
    agent_id: str
    host: str
    session_id: str
    # Sorted. A tuple: 104 B for a node's 8 ranks, where a set is 728.
    ranks: tuple[int, ...]
    registered: float
    last_report: float
    agent_version: str = ""
    lost: bool = False
    report_seq: int = 0
    mailbox: Mailbox = field(default_factory=Mailbox)
    # The session's group table (progress_columns.group_table of its
    # RegisterRequest): ProgressColumns.cell_group indexes it.
    group_names: tuple[str, ...] = ()
    # What its last columnar report's ranks and cells resolved to, reused
    # while they and the job's layout stay the same (registry._cell_plan).
    plan: CellPlan | None = None


@dataclass(slots=True, frozen=True)
class CellPlan:
    """One agent's columnar report layout, resolved to records: an agent sends
    the same ranks and cells in the same order report after report, and
    looking each up again (a rank's record, its group's two records) was a
    third of the registry's work per report (benchmarks/ingest_path.py).
    Valid while the job's `layout` is the one it was made under: only a
    registration changes which records a rank or group maps to."""

    layout: int
    # The report's Columns.packed_layout. As the unpacked tuples, an int
    # object for each rank past 256, the registry held 1,388 bytes a rank at
    # 4,096 ranks; as bytes 1,316 (benchmarks/ingest_path.py).
    packed_layout: tuple[bytes, bytes, bytes]
    rows: tuple[RankRecord, ...]
    # Per cell, its index in the job's CellTable and the job's group record;
    # -1 and None for a group the rank never registered (its numbers are not
    # applied). Indices in an array: 8 bytes a cell, not an int object each;
    # a run's as a range.
    cells: Sequence[int]
    groups: tuple[GroupRecord | None, ...]
    # cells[0] when the cells are one contiguous ascending run (an agent's
    # ranks registered together, reported in the order they registered):
    # stored a column slice at a time. Else -1.
    run: int = -1


@dataclass(slots=True)
class JobRecord:
    job_id: str
    world_size: int | None = None
    agents: dict[str, AgentRecord] = field(default_factory=dict)
    ranks: dict[int, RankRecord] = field(default_factory=dict)
    groups: dict[str, GroupRecord] = field(default_factory=dict)
    # Every rank's numbers for every group it registered (RankRecord.first_cell).
    cells: CellTable = field(default_factory=CellTable)
    rates: RankRates = field(default_factory=RankRates)
    open_incident: str | None = None
    handled: OrderedDict[tuple[str, int], str] = field(default_factory=OrderedDict)
    # rank -> the pid that last registered it, for ranks no agent holds now
    # (a held rank's is its record's): a different pid means the job was
    # restarted under the same id. A map of every rank was 98 bytes a rank.
    left_pids: dict[int, int] = field(default_factory=dict)
    events: deque[tuple[float, pb.Event]] = field(default_factory=lambda: deque(maxlen=EVENT_RING))
    last_seen: float = 0.0
    last_progress: float = 0.0  # coordinator monotonic: any member of any group completed more
    # When this run of the job's first rank registered (or it restarted with
    # new processes); 0 while no rank has: a job whose counters never move is
    # quiet since then.
    started: float = 0.0
    # When a registration last brought a rank this run had not had: a job
    # still launching (a 32,768-rank job's ranks registered over 65 s on a
    # simulated fleet; a real launch's rendezvous can take minutes, the early
    # ranks idle in it) is not quiet while ranks keep arriving. The quiet
    # clock runs from here; a launch that stops short (a node that never
    # comes up) is paged the bound after its last new rank.
    last_new_rank: float = 0.0
    # Bumped by every registration in the job: which records a rank and a
    # group name map to changes only then (AgentRecord.plan).
    layout: int = 0
    # Reports that moved a counter past a rank's first numbers, when the last
    # one arrived and the longest gap between two: whether the job was making
    # steady progress, for the no-progress rule (stalls.scan_quiet).
    progress_moves: int = 0
    last_move: float = 0.0
    longest_gap_s: float = 0.0

    def note_move(self, now: float) -> None:
        if self.progress_moves and now - self.last_move < MOVE_SPACING_S:
            return  # another node's report of the same moment, not another move
        # Gaps before the job became steady are its start-up (loading data,
        # building the model), not its rhythm.
        if steady(self.progress_moves):
            self.longest_gap_s = max(self.longest_gap_s, now - self.last_move)
        self.progress_moves += 1
        self.last_move = now

    def observed(self, r: RankRecord) -> bool:
        """Its agent is live: a lost agent's numbers are stale, so its ranks are
        unobserved rather than behind."""
        a = self.agents.get(r.agent_id)
        return a is not None and not a.lost

    def members(self, g: GroupRecord) -> list[tuple[RankRecord, Cell]]:
        """The group's members that registered it, with their numbers for it."""
        out: list[tuple[RankRecord, Cell]] = []
        t = self.cells
        gid = t.known_group(g.name)
        for rank in g.ranks:
            r = self.ranks.get(rank)
            if r is not None and (i := t.find(r.first_cell, r.cell_count, gid)) >= 0:
                out.append((r, Cell(t, i)))
        return out

    def cell(self, r: RankRecord, group: str) -> Cell | None:
        """The rank's numbers for `group`; None for a group it never registered."""
        t = self.cells
        i = t.find(r.first_cell, r.cell_count, t.known_group(group))
        return None if i < 0 else Cell(t, i)

    def cells_of(self, r: RankRecord) -> list[tuple[str, Cell]]:
        """The rank's numbers for each group it registered, in registration order."""
        t = self.cells
        names, group = t.names, t.group
        return [
            (names[group[i]], Cell(t, i)) for i in range(r.first_cell, r.first_cell + r.cell_count)
        ]


def group_sort_key(name: str) -> tuple[int, int, str]:
    # Numbered groups ("0", "1", "10") in number order, named ones after.
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def sorted_groups(groups: dict[str, GroupRecord]) -> list[GroupRecord]:
    return [groups[k] for k in sorted(groups, key=group_sort_key)]
