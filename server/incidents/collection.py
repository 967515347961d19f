"""Collecting an incident's dumps: who was asked, who answered, what is on disk.

A `Collection` is one open incident between "DUMP sent" and "analysis
starts". It is not locked itself: the incident manager's lock guards it while
gRPC handlers add answers, and once `finalizing` is set only the finalizer
touches it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from hangwatch.analyzer.report import Report
from hangwatch.server.incidents.store import IncidentRow
from hangwatch.server.live.commands import Command

from hangwatch import formats
from hangwatch.formats import MissingReason, nodearchive
from hangwatch.wire import pb

log = logging.getLogger("hangwatch.server")

# Reasons that mean "nobody could look at this rank", as opposed to a rank
# whose own process refused a dump (frozen, gone): the former are unobserved,
# not guilty, unless other ranks' FR blames them (MissingReason.unobserved).
AGENT_UNREACHABLE: Final = MissingReason.AGENT_UNREACHABLE
NO_ANSWER: Final = MissingReason.NO_ANSWER
RESTARTED: Final = MissingReason.RESTARTED


def fr_stored(bundle: Path, ranks: Iterable[int]) -> set[int]:
    """Those of `ranks` whose FR file, full or tail, is in place: in the rank's
    directory, or in a node archive (each stored only when whole)."""
    ranks = list(ranks)
    if not ranks:
        return set()
    archived, unreadable = nodearchive.index(bundle)
    for path, why in unreadable:
        # Checked whole when stored: unreadable now is damage on disk, and its
        # ranks count as not dumped.
        log.warning("incident %s: node archive %s unreadable: %s", bundle.name, path.name, why)
    out: set[int] = set()
    for r in ranks:
        names = (f"{formats.FR_FILE_PREFIX}{r}", f"{formats.FR_TAIL_PREFIX}{r}")
        d = bundle / f"rank_{r}"
        if any((r, n) in archived or (d / n).is_file() for n in names):
            out.add(r)
    return out


def tail_context_for(expected: int, full_dump_max_ranks: int, tail_context: int) -> int:
    """> 0: collect FR tails first. Above `full_dump_max_ranks` full dumps cost
    more to collect than the verdict is worth waiting for (docs/scaling.md)."""
    return max(1, tail_context) if expected > full_dump_max_ranks else 0


@dataclass
class Collection:
    incident_id: str
    job_id: str
    trigger: str
    created: float  # unix
    onset: float  # coordinator monotonic: best estimate of when the hang began
    deadline: float  # coordinator monotonic
    world_size: int | None
    expected: set[int]
    asked: dict[str, list[int]]  # agent -> its ranks, asked to dump
    dumped: set[int] = field(default_factory=set)
    unreachable: dict[int, str] = field(default_factory=dict)
    answered_agents: set[str] = field(default_factory=set)
    trigger_info: dict[str, Any] = field(default_factory=dict)
    finalizing: bool = False
    tail_context: int = 0  # > 0: agents upload FR tails first (two-phase collection)
    # A finalize the coordinator's disk refused (full): not before this
    # (coordinator monotonic), and with the verdict it already made for that
    # outcome, (dumped, unreachable) -> report, if any (dumps that land
    # meanwhile change the outcome, and the analysis is made again).
    retry_at: float = float("-inf")
    analysed: tuple[tuple[frozenset[int], frozenset[tuple[int, str]]], Report] | None = None

    # An incident a previous coordinator left collecting: its agents are asked
    # again once they re-register (they kept their dumps), until `deadline`.
    recovering: bool = False

    @classmethod
    def recovered(cls, row: IncidentRow, bundle: Path, now: float, wait_s: float) -> Collection:
        """An incident a previous coordinator left collecting. What arrived is on
        disk; the rest is asked for again as the agents re-register (each kept
        its bundle under its run directory), for `wait_s`: one lost-agent
        timeout for them to notice the restart, one dump deadline to answer."""
        have = fr_stored(bundle, row.ranks_expected)
        return cls(
            incident_id=row.id,
            job_id=row.job_id,
            trigger=row.trigger,
            created=row.created,
            onset=now,
            deadline=now + wait_s,
            world_size=len(row.ranks_expected) or None,
            expected=set(row.ranks_expected),
            asked={},
            dumped=have,
            recovering=True,
        )

    def settle_recovered(self) -> None:
        """Ranks of a recovered incident nobody was found to ask: the restart lost them."""
        asked = {r for ranks in self.asked.values() for r in ranks}
        for r in self.expected - self.dumped - set(self.unreachable) - asked:
            self.unreachable[r] = RESTARTED

    def accounted(self) -> bool:
        return self.expected <= (self.dumped | set(self.unreachable))

    def due(self, now: float) -> bool:
        """Ready to finalize: every rank answered for, or the deadline passed."""
        if self.finalizing or now < self.retry_at:
            return False
        return self.accounted() or now >= self.deadline

    def dump_command(self, reason: str, dump_deadline: float) -> Command:
        return Command(
            kind=pb.COMMAND_KIND_DUMP,
            incident_id=self.incident_id,
            reason=reason,
            deadline_s=dump_deadline,
            expires=self.deadline,
            tail_context=self.tail_context,
        )

    def apply_result(self, res: pb.DumpResult) -> None:
        """An agent's CompleteDump: a rank dumped by anyone stays dumped; a
        failure only counts for a rank nobody dumped."""
        for r in res.ranks_dumped:
            if r in self.expected:
                self.dumped.add(r)
                self.unreachable.pop(r, None)
        for f in res.failures:
            if f.rank in self.expected and f.rank not in self.dumped:
                self.unreachable[f.rank] = f.reason or MissingReason.DUMP_FAILED
        self.answered_agents.add(res.agent_id)

    def pending(self) -> set[int]:
        return self.expected - self.dumped

    def settle(self, stored: set[int], dump_deadline: float) -> tuple[set[int], dict[int, str]]:
        """Close the books: `stored` ranks (FR file on disk) count as dumped, and
        every other rank still unaccounted for gets the reason it is missing.
        Returns copies of (dumped, unreachable)."""
        # A rank whose FR file was stored is dumped even if its agent's
        # CompleteDump missed the deadline: at thousands of ranks collection
        # can outlast it, and the evidence is on disk.
        for r in stored:
            self.dumped.add(r)
            self.unreachable.pop(r, None)
        for agent_id, ranks in self.asked.items():
            for r in ranks:
                if r in self.expected and r not in self.dumped and r not in self.unreachable:
                    if agent_id not in self.answered_agents:
                        self.unreachable[r] = f"{NO_ANSWER} ({dump_deadline:.0f}s)"
                    else:
                        self.unreachable[r] = MissingReason.NO_RESULT
        for r in self.expected - self.dumped - set(self.unreachable):
            self.unreachable[r] = NO_ANSWER
        return set(self.dumped), dict(self.unreachable)
