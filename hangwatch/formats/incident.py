"""`<bundle>/incident.json`: what an incident is and, once collection ends, what it got.

The coordinator writes it when the incident opens and rewrites it with the
outcome (`ranks_dumped`, `ranks_unreachable`) when collection ends. The
analyzer reads it (an incident was triggered at all: a stall nobody can
explain is not a healthy snapshot); the coordinator reads stored ones back to
dedupe a stall it sees again after a restart.

Readers: a file without a schema tag is read; unknown keys are ignored (and
so not kept when the coordinator rewrites the outcome); a present field of
the wrong type is a `FormatError`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hangwatch.formats import checks as c

INCIDENT = "hangwatch.incident/1"
MAX_INCIDENT_BYTES = 16 * 1024**2


@dataclass(frozen=True, kw_only=True)
class IncidentDoc:
    id: str  # the incident id (also its directory's name)
    job_id: str = ""
    reason: str = ""  # what a person reads: the trigger's sentence
    created_unix: float = 0.0  # the coordinator's clock
    # The trigger's structured record, as the coordinator built it. Always
    # "kind" (a TriggerKind value); event triggers add "event", "rank",
    # "detail" (crashes "how", "exception"); stall triggers add "stalled": one
    # object per stalled collective with "group", "seq", "op", "kind" (a
    # StallKind value), "waiting_ranks", "not_entered_ranks", "dead_ranks",
    # "unobserved_ranks", "stalled_for_s" and, for a mismatch, "ops_entered"
    # (op -> the ranks that entered it).
    trigger: dict[str, Any] = field(default_factory=dict)
    world_size: int | None = None  # None: no agent reported one
    ranks_expected: tuple[int, ...] = ()  # the ranks asked to dump
    tail_context: int = 0  # > 0: FR dumps were collected as tails (hangwatch.frtail)
    ranks_dumped: tuple[int, ...] = ()  # empty until collection ends
    # rank -> why it has no dump: text that starts with a MissingReason
    # value (JSON keys are the ranks as strings).
    ranks_unreachable: dict[int, str] = field(default_factory=dict)

    SCHEMA: ClassVar[str] = INCIDENT

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": INCIDENT,
            "id": self.id,
            "job_id": self.job_id,
            "reason": self.reason,
            "created_unix": self.created_unix,
            "trigger": self.trigger,
            "world_size": self.world_size,
            "ranks_expected": sorted(self.ranks_expected),
            "tail_context": self.tail_context,
            "ranks_dumped": sorted(self.ranks_dumped),
            "ranks_unreachable": {str(r): why for r, why in sorted(self.ranks_unreachable.items())},
        }

    def to_bytes(self) -> bytes:
        return (json.dumps(self.to_json(), indent=2) + "\n").encode()

    def with_outcome(self, dumped: Iterable[int], unreachable: Mapping[int, str]) -> IncidentDoc:
        return dataclasses.replace(
            self, ranks_dumped=tuple(sorted(dumped)), ranks_unreachable=dict(unreachable)
        )

    def stalled_keys(self) -> set[tuple[str, int]]:
        """The (group, seq) pairs a stall trigger covered (empty for other triggers)."""
        s = INCIDENT
        stalled = c.object_list(self.trigger, "stalled", s)
        return {(c.req_str(x, "group", s), c.req_int(x, "seq", s)) for x in stalled}

    @classmethod
    def from_json(cls, d: Any) -> IncidentDoc:
        s = INCIDENT
        d = c.document(d, s)
        unreachable: dict[int, str] = {}
        for k, why in c.str_map(d, "ranks_unreachable", s).items():
            if not k.isdigit() or len(k) > 9:
                c.fail(s, f"ranks_unreachable key {k[:20]!r} is not a rank")
            unreachable[int(k)] = why
        return cls(
            id=c.req_str(d, "id", s),
            job_id=c.get_str(d, "job_id", s),
            reason=c.get_str(d, "reason", s),
            created_unix=c.get_float(d, "created_unix", s, 0.0),
            trigger=c.opt_object(d, "trigger", s) or {},
            world_size=c.opt_int(d, "world_size", s, None, minimum=0),
            ranks_expected=tuple(c.int_list(d, "ranks_expected", s)),
            tail_context=c.get_int(d, "tail_context", s, 0, minimum=0),
            ranks_dumped=tuple(c.int_list(d, "ranks_dumped", s)),
            ranks_unreachable=unreachable,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> IncidentDoc:
        return cls.from_json(c.loads(data, INCIDENT, MAX_INCIDENT_BYTES))
