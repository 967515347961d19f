"""A group's collective numbering where its pg_status also counts p2p ops.

Measured on torch 2.13 and 2.15 (gloo): gloo numbers collectives and p2p ops
with one per-group counter, which pg_status reports and FR entries carry as
`op_id`, while `collective_seq_id` counts collectives only (a pipeline's
middle stage after 4 steps of recv + send + all_reduce: pg_status 12, its
all_reduce #4 has op_id 12; the end stages read 8). On NCCL (real 16-rank
dumps) pg_status holds the last op's own number: a p2p op's `p2p_seq_id`, a
collective's `collective_seq_id`. Either way those counts are not comparable
across ranks that do different amounts of p2p, so the agent maps them back to
collective numbers with what the rank's newest FR entries say.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from hangwatch.recorders import KIND_GENERIC, KIND_NCCL

# Bound on the pg_status value -> collective seq map per group.
MAX_RAW_KEYS: Final = 256


@dataclass
class Numbering:
    """One group's map from pg_status values to collective counts."""

    counts_p2p: bool = False  # seen in its FR entries; until then pg_status counts collectives
    coll_of_raw: dict[int, int] = field(default_factory=dict)
    enqueued: int | None = None  # collective numbering; None: not known now
    completed: int | None = None

    def learn(self, raw: int, coll: int, p2p: bool) -> None:
        self.counts_p2p |= p2p or raw != coll
        self.coll_of_raw.pop(raw, None)
        self.coll_of_raw[raw] = coll
        while len(self.coll_of_raw) > MAX_RAW_KEYS:
            del self.coll_of_raw[next(iter(self.coll_of_raw))]

    def apply(self, enqueued: int, completed: int) -> None:
        """Translate this poll's pg_status values."""
        if self.counts_p2p:
            self.enqueued, self.completed = self._of(enqueued), self._of(completed)

    def collectives(self, enqueued: int, completed: int) -> tuple[int, int] | None:
        """(enqueued, completed) in collective numbering, None where not known."""
        if not self.counts_p2p:
            return enqueued, completed
        if self.enqueued is None or self.completed is None:
            return None
        return self.enqueued, self.completed

    def _of(self, raw: int) -> int | None:
        return -1 if raw < 0 else self.coll_of_raw.get(raw)


def raw_key(kind: str, e: dict[str, Any], seq: int) -> int | None:
    """The pg_status value an FR entry's op leaves behind, where that is known
    (a hook-recorded instance's numbering is its own: None)."""
    try:
        if kind == KIND_GENERIC:
            return int(e["op_id"])
        if kind == KIND_NCCL:
            return int(e.get("p2p_seq_id", 0) or 0) if e.get("is_p2p") else seq
    except (KeyError, TypeError, ValueError):
        pass
    return None
