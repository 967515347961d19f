"""Typed analyzer results: the one schema the CLI, JSON, dashboard and tests use.

`Report.to_json()` is the stable `hangwatch.report/1` wire form. Never parse
rendered text; read these objects (or their JSON) instead.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

SCHEMA = "hangwatch.report/1"

Verdict = Literal["hang", "mismatch", "healthy", "no-culprit-visible", "unknown"]


@dataclass(frozen=True, kw_only=True)
class StalledCollective:
    group: str  # process-group name, e.g. "0" or "37"
    group_desc: str
    group_ranks: list[int]
    seq: int  # collective_seq_id within the group
    op: str  # normalized op, backend prefix stripped ("all_reduce")
    profiling_name: str = ""  # as FR recorded it ("nccl:all_reduce")
    entered_ranks: list[int] = field(default_factory=list)  # members with an entry for seq
    completed_ranks: list[int] = field(default_factory=list)  # members known to have finished it
    missing_ranks: list[int] = field(default_factory=list)  # members that never entered it
    input_sizes: list[list[int]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Finding:
    # kinds: "not-entered", "missing-dump", "frozen", "stuck-outside-collective",
    # "cross-group-deadlock", "op-mismatch", "size-mismatch", "dtype-mismatch",
    # "state-mismatch", "p2p-unmatched", "buffer-wrapped", "gloo-p2p-blind-spot",
    # "agent-unreachable", "no-collective-in-flight", "load-error"
    kind: str
    ranks: list[int]
    group: str | None = None
    seq: int | None = None
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class FileError:
    file: str
    error: str


@dataclass(frozen=True, kw_only=True)
class Frame:
    name: str
    filename: str
    line: int


@dataclass(frozen=True, kw_only=True)
class CollectiveRef:
    group: str
    seq: int
    op: str
    state: str  # "scheduled" | "started" | "completed" | "retired"


@dataclass(frozen=True, kw_only=True)
class RankEvidence:
    """What is known about one rank, and where each piece came from."""

    rank: int
    host: str | None = None
    pid: int | None = None
    process_state: str | None = None  # running, sleeping, stopped, zombie, gone, unknown
    reachable: bool = True  # False: no dump could be taken (frozen, agent unreachable)
    last_completed: CollectiveRef | None = None
    last_entered: CollectiveRef | None = None
    frames: list[Frame] = field(default_factory=list)  # FR call-site frames of last_entered
    stacks: str | None = None  # Python stacks text (all threads)
    gpu: dict[str, Any] | None = None  # NVML readings, or {"available": false, "reason": ...}
    # evidence -> source, e.g. {"fr": "worker-server", "stacks": "py-spy", "gpu": "nvml"}
    sources: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class GroupProgress:
    group: str
    group_desc: str
    ranks: list[int]
    min_completed: int  # lowest last-completed seq among members with dumps
    max_enqueued: int  # highest seq any member enqueued
    lagging: list[int] = field(default_factory=list)  # members behind the others
    # False when only the dumps name the members (no pg_config ranks, no
    # bundle metadata, no --world-size): `ranks` is who was seen, not who is in it.
    membership_known: bool = True


@dataclass(frozen=True, kw_only=True)
class WaitEdge:
    waiter: int
    waits_on: int
    group: str
    seq: int


@dataclass(kw_only=True)
class Report:
    verdict: Verdict
    summary: str
    stalled_collective: StalledCollective | None = None
    lagging_ranks: list[int] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    ranks_loaded: list[int] = field(default_factory=list)
    ranks_missing: list[int] = field(default_factory=list)
    # Ranks analysed from an FR tail (hangwatch.frtail) because their full
    # dump was not collected: their older history is absent by design.
    tail_ranks: list[int] = field(default_factory=list)
    errors: list[FileError] = field(default_factory=list)
    # Richer detail beyond the required keys; consumers may ignore it.
    groups: list[GroupProgress] = field(default_factory=list)
    waits_for: list[WaitEdge] = field(default_factory=list)  # capped (graph.MAX_WAIT_EDGES)
    # The waits-for graph's terminal components, from all of it (not only the
    # capped edges above): ranks that wait on nobody while someone waits on
    # them, and groups of ranks that wait on each other and on nobody else.
    # Disjoint. Who is *blamed* is `lagging_ranks`.
    roots: list[int] = field(default_factory=list)
    cycles: list[list[int]] = field(default_factory=list)
    evidence: dict[int, RankEvidence] = field(default_factory=dict)
    schema: str = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        # JSON object keys are strings; keep rank keys readable and sorted.
        d["evidence"] = {str(k): v for k, v in sorted(d["evidence"].items())}
        ordered = {"schema": d.pop("schema")}
        ordered.update(d)
        return ordered

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_json(cls, text: str | bytes) -> Report:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} document (schema={d.get('schema')!r})")
        sc = d.get("stalled_collective")
        ev: dict[int, RankEvidence] = {}
        for k, v in (d.get("evidence") or {}).items():
            v = dict(v)
            v["frames"] = [Frame(**fr) for fr in v.get("frames") or []]
            for key in ("last_completed", "last_entered"):
                if v.get(key):
                    v[key] = CollectiveRef(**v[key])
            ev[int(k)] = RankEvidence(**v)
        return cls(
            verdict=d["verdict"],
            summary=d["summary"],
            stalled_collective=StalledCollective(**sc) if sc else None,
            lagging_ranks=list(d.get("lagging_ranks") or []),
            findings=[Finding(**f) for f in d.get("findings") or []],
            ranks_loaded=list(d.get("ranks_loaded") or []),
            ranks_missing=list(d.get("ranks_missing") or []),
            tail_ranks=list(d.get("tail_ranks") or []),
            errors=[FileError(**e) for e in d.get("errors") or []],
            groups=[GroupProgress(**g) for g in d.get("groups") or []],
            waits_for=[WaitEdge(**w) for w in d.get("waits_for") or []],
            # Absent from reports written before they were recorded.
            roots=[int(r) for r in d.get("roots") or []],
            cycles=[[int(r) for r in c] for c in d.get("cycles") or []],
            evidence=ev,
        )
