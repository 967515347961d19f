"""What the coordinator did about an incident (--on-hang, --exclude-command), as stored.

One `ActionRecord` per action, kept in the incident's row (JSON) and served
as is by the API and the dashboard: the record says what was asked, of whom,
and what came of it, rank by rank or node by node.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Final

ABORT: Final = "abort"
EXCLUDE: Final = "exclude"

# running: asked, answers outstanding; done: every target answered and did
# what was asked; partial: some did not (see the ranks or the output);
# failed: nothing could be done; skipped: not attempted, with the reason.
STATUSES: Final = ("running", "done", "partial", "failed", "skipped")


@dataclass(kw_only=True)
class RankOutcome:
    """One process an abort asked an agent to end (outcomes: agent/terminate.py)."""

    rank: int
    pid: int
    node: str  # the agent asked
    outcome: str = "pending"  # an ActionResult outcome, "pending" or "no-answer"
    signals: list[str] = field(default_factory=list)
    exit_s: float | None = None  # first signal to exit, agent clock
    detail: str = ""


@dataclass(kw_only=True)
class ActionRecord:
    kind: str  # ABORT or EXCLUDE
    status: str  # one of STATUSES
    started: float  # unix seconds
    summary: str  # one line for people
    finished: float | None = None
    # exclude: the node and host it ran for, the words it ran, its result
    node: str = ""
    host: str = ""
    argv: list[str] = field(default_factory=list)
    returncode: int | None = None
    output: str = ""  # stdout and stderr, bounded
    # abort
    ranks: list[RankOutcome] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ActionRecord:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__ and k != "ranks"}
        ranks = [
            RankOutcome(**{k: v for k, v in r.items() if k in RankOutcome.__dataclass_fields__})
            for r in d.get("ranks") or []
        ]
        return cls(**known, ranks=ranks)
