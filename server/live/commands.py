"""Per-agent command mailboxes: what the coordinator wants an agent to do next.

A command waits in its agent's mailbox until the agent answers or it expires,
and is re-sent on every WatchCommands stream the agent opens meanwhile: a
stream can break in the middle of a hang, and the dump request must survive
it. Mailboxes are not locked themselves; the registry's lock guards them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from hangwatch.wire import pb

PENDING_COMMANDS: Final = 16  # undelivered commands kept per agent


@dataclass(kw_only=True, frozen=True)
class Command:
    kind: int  # pb.CommandKind
    incident_id: str
    reason: str
    deadline_s: float
    expires: float  # coordinator monotonic
    tail_context: int = 0
    ranks: tuple[int, ...] = ()
    pids: tuple[int, ...] = ()  # END_RANKS: the pid of each of `ranks`
    grace_s: float = 0.0  # END_RANKS: SIGTERM to SIGKILL

    def to_pb(self, now: float) -> pb.Command:
        return pb.Command(
            kind=self.kind,  # type: ignore[arg-type]
            incident_id=self.incident_id,
            reason=self.reason,
            deadline_s=max(0.0, self.expires - now),
            tail_context=self.tail_context,
            ranks=self.ranks,
            pids=self.pids,
            grace_s=self.grace_s,
        )


@dataclass
class Mailbox:
    """One agent's undelivered commands and the open streams to wake for them."""

    # Oldest first, at most PENDING_COMMANDS. A list: one is held per agent
    # whether or not a command ever comes, and an empty deque is 624 B.
    pending: list[Command] = field(default_factory=list)
    wakers: dict[int, Callable[[], None]] = field(default_factory=dict)

    def push(self, cmd: Command) -> None:
        self.pending.append(cmd)
        del self.pending[:-PENDING_COMMANDS]
        self.wake()

    def wake(self) -> None:
        for w in list(self.wakers.values()):
            w()

    def unexpired(self, now: float) -> list[Command]:
        self.pending = [c for c in self.pending if c.expires > now]
        return list(self.pending)

    def retire(self, incident_id: str, kind: int | None = None) -> None:
        """Drop the incident's commands (only those of `kind`, when given)."""
        self.pending = [
            c
            for c in self.pending
            if c.incident_id != incident_id or (kind is not None and c.kind != kind)
        ]

    def inherit(self, old: Mailbox, now: float) -> None:
        """Take over a replaced session's mailbox: an undelivered dump request
        survives the agent's reconnect, and the old session's streams are woken
        so that they notice they are stale and end."""
        self.pending.extend(c for c in old.pending if c.expires > now)
        del self.pending[:-PENDING_COMMANDS]
        old.wake()
