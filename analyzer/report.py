"""Typed analyzer results: the one schema the CLI, JSON, dashboard and tests use.

`Report.to_json()` is the stable `hangwatch.report/1` wire form. Never parse
rendered text; read these objects (or their JSON) instead.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

SCHEMA = "hangwatch.report/1"

Verdict = Literal["hang", "mismatch", "crash", "healthy", "no-culprit-visible", "unknown"]

# Every verdict, with what it means (docs/operations.md is generated from this).
VERDICTS: dict[str, str] = {
    "hang": "a collective (or p2p op) some members never entered: the lagging ranks are "
    "the ones everybody waits on; with basis `stacks`, FR showed no culprit and the ranks' "
    "Python stacks did (the odd ones out, or a p2p deadlock's cycle)",
    "mismatch": "members entered the same collective seq with a different op, sizes or dtypes: "
    "the lagging ranks are the odd ones out; the stalled collective is what the majority called",
    "crash": "a rank died (the incident's trigger: an uncaught exception, or its process gone "
    "with one) and the others stopped with it: the lagging rank is the first to die, its "
    "exception is in the summary and a `rank-crashed` finding; the survivors' errors after it "
    "are `crash-consequence`, and the summary says where each rank stood in its own FR (the "
    "collective the survivors had entered that the dead rank never reached)",
    "healthy": "nothing stalled in the dumps: every collective in flight was entered by all of "
    "its members (named by pg_config, bundle metadata or --world-size, not only by the dumps) "
    "and nothing is unmatched (offline dumps, no stall reported)",
    "no-culprit-visible": "a stall was reported (an incident), but FR shows nobody waiting on a "
    "rank that is behind: read the stacks",
    "unknown": "the dumps cannot tell a stuck job from a healthy one, and the summary says what "
    "is known and what is missing: a group's recorder does not record completion "
    "(completion-unknown), a rank is in an unfinished collective of a group whose members only "
    "the dumps name (membership-unknown: no pg_config ranks, no bundle metadata, no "
    "--world-size), or selected ranks have unfinished work with ranks --selected-ranks left "
    "out (outside-selection), or no rank's dump was loaded; never healthy: read the stacks, or "
    "rerun with --world-size or the whole bundle",
}


class FindingKind(StrEnum):
    """Every kind of finding the analyzer emits (meanings in FINDING_KINDS)."""

    NOT_ENTERED = "not-entered"
    STUCK_OUTSIDE_COLLECTIVE = "stuck-outside-collective"
    STUCK_INSIDE_OP = "stuck-inside-op"
    MISSING_DUMP = "missing-dump"
    FROZEN = "frozen"
    AGENT_UNREACHABLE = "agent-unreachable"
    CROSS_GROUP_DEADLOCK = "cross-group-deadlock"
    OP_MISMATCH = "op-mismatch"
    SIZE_MISMATCH = "size-mismatch"
    DTYPE_MISMATCH = "dtype-mismatch"
    P2P_UNMATCHED = "p2p-unmatched"
    BUFFER_WRAPPED = "buffer-wrapped"
    GLOO_P2P_BLIND_SPOT = "gloo-p2p-blind-spot"
    NO_COLLECTIVE_IN_FLIGHT = "no-collective-in-flight"
    COMPLETION_UNKNOWN = "completion-unknown"
    MEMBERSHIP_UNKNOWN = "membership-unknown"
    OUTSIDE_SELECTION = "outside-selection"
    THREAD_EXCEPTION = "thread-exception"
    STACK_ODD_ONE_OUT = "stack-odd-one-out"
    P2P_DEADLOCK = "p2p-deadlock"
    LATE_ARRIVAL = "late-arrival"
    ENTERED_NONE_FINISHED = "entered-none-finished"
    RANK_CRASHED = "rank-crashed"
    CRASH_CONSEQUENCE = "crash-consequence"


FINDING_KINDS: dict[FindingKind, str] = {
    FindingKind.NOT_ENTERED: "the rank never entered the stalled collective; its own older "
    "work has not finished although all its peers entered it",
    FindingKind.STUCK_OUTSIDE_COLLECTIVE: "the rank is in no collective its peers wait on and "
    "never entered the stalled one: stuck in compute, I/O or Python (see its stacks)",
    FindingKind.STUCK_INSIDE_OP: "the rank's oldest unfinished op was entered by all its peers "
    "and has not finished on it; the work others wait on is queued behind that op (stream "
    "order): it is stuck inside it (GPU, network)",
    FindingKind.MISSING_DUMP: "no dump from the rank (absent or unreadable): blamed only when "
    "no rank with a dump explains the stall, otherwise listed as not blamed",
    FindingKind.FROZEN: "the rank's process is stopped (SIGSTOP, tracing stop): no dump could "
    "be taken",
    FindingKind.AGENT_UNREACHABLE: "the rank's agent could not be reached: nothing is known of it",
    FindingKind.CROSS_GROUP_DEADLOCK: "ranks wait on each other across groups, having entered "
    "them in different orders; the odd order is blamed",
    FindingKind.OP_MISMATCH: "members called different ops at the same collective seq",
    FindingKind.SIZE_MISMATCH: "members called the collective with sizes that do not fit",
    FindingKind.DTYPE_MISMATCH: "members called the collective with dtypes that do not fit",
    FindingKind.P2P_UNMATCHED: "a peer has not posted its side of a send/recv",
    FindingKind.BUFFER_WRAPPED: "the ring buffer lost history that would settle it: raise "
    "HANGWATCH_FR_BUFFER_SIZE",
    FindingKind.GLOO_P2P_BLIND_SPOT: "gloo records no send/recv in FR: a p2p deadlock leaves "
    "dumps that look healthy",
    FindingKind.NO_COLLECTIVE_IN_FLIGHT: "a stall was reported and no collective is in flight: "
    "the hang is outside collectives",
    FindingKind.COMPLETION_UNKNOWN: "a group's recorder does not record completion: a "
    "collective counts as finished once every member entered it",
    FindingKind.MEMBERSHIP_UNKNOWN: "a rank is in an unfinished collective of a group whose "
    "members nobody names (no pg_config ranks, no bundle metadata, no --world-size)",
    FindingKind.OUTSIDE_SELECTION: "selected ranks have unfinished collectives or send/recv "
    "with ranks whose dumps --selected-ranks left out: whether they wait on them is unknown",
    FindingKind.THREAD_EXCEPTION: "a thread of the rank died of an uncaught exception (the "
    "hook saw it) before the dump: often why its main thread waits, e.g. on a dead data loader",
    FindingKind.STACK_ODD_ONE_OUT: "from its Python stacks (FR showed no culprit): the rank is "
    "not blocked in communication while the others are, or it is the one they wait on in p2p",
    FindingKind.P2P_DEADLOCK: "from the stacks' p2p peer arguments (FR showed no culprit): "
    "these ranks wait in send/recv on each other",
    FindingKind.LATE_ARRIVAL: "every member entered the collective and none finished it, and "
    "the rank entered it conspicuously after the others (entry times, beyond the clock "
    "error): they waited for it, often past their own timeout (NCCL then never completes it)",
    FindingKind.ENTERED_NONE_FINISHED: "every member entered the collective together and none "
    "finished it, long before the dumps were taken: no rank is behind in FR; the fault is "
    "below it (network, GPU)",
    FindingKind.RANK_CRASHED: "the rank died first, of the exception its hook saw (or its "
    "process was gone): the cause the others stopped for",
    FindingKind.CRASH_CONSEQUENCE: "an error on a survivor after a peer's crash (a closed "
    "connection, a collective timeout, a launcher's SIGTERM): a consequence, not a cause",
}


def verdicts_markdown() -> str:
    """The verdicts and finding kinds as docs/operations.md lists them."""
    lines = ["| verdict | means |", "|---|---|"]
    lines += [f"| `{v}` | {m} |" for v, m in VERDICTS.items()]
    lines += ["", "| finding kind | means |", "|---|---|"]
    lines += [f"| `{k.value}` | {m} |" for k, m in FINDING_KINDS.items()]
    return "\n".join(lines) + "\n"


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
    kind: str  # a FindingKind (from_dict keeps whatever an old report says)
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
    # Uncaught exceptions the hook saw in the rank's threads, oldest first:
    # "thread <name>: <type>: <message>".
    exceptions: list[str] = field(default_factory=list)
    # evidence -> source, e.g. {"fr": "worker-server", "stacks": "py-spy", "gpu": "nvml"}
    sources: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class GroupPosition:
    """Members with dumps that stand at the same place in one group."""

    ranks: list[int]
    completed: int  # their last completed seq in the group; -1: none known
    enqueued: int  # their last enqueued (entered) seq in the group; -1: none


@dataclass(frozen=True, kw_only=True)
class GroupProgress:
    group: str
    group_desc: str
    ranks: list[int]
    min_completed: int  # lowest last-completed seq among members with dumps; -1: none
    max_enqueued: int  # highest seq any member enqueued; -1: none
    lagging: list[int] = field(default_factory=list)  # members behind the others
    # False when only the dumps name the members (no pg_config ranks, no
    # bundle metadata, no --world-size): `ranks` is who was seen, not who is in it.
    membership_known: bool = True
    # Where the member list comes from (groups.GroupMeta.membership_source):
    # "inferred" says nobody named them and the complete dumps were read for it.
    membership_source: str = ""
    # Where each member with a dump is in this group (a rank's evidence names
    # only its newest collective of any group); empty in older reports.
    positions: list[GroupPosition] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class WaitEdge:
    waiter: int
    waits_on: int
    group: str
    seq: int


class StackState(StrEnum):
    """What a rank's main thread is doing, read from its Python stacks (analyzer/stackdiag.py)."""

    P2P = "p2p"  # blocked in a send/recv (or a wait on one) in torch.distributed
    COLLECTIVE = "collective"  # inside another torch.distributed call
    DATA_LOADER = "data-loader"  # waiting on torch's DataLoader
    # Inside torch.compile's compiler: compiling, or waiting on the compile
    # cache's lock while another rank compiles (stacktext.TORCH_COMPILE_FILES).
    COMPILE = "compile"
    COMPUTE = "compute"  # running Python (py-spy saw the thread active)
    SLEEPING = "sleeping"  # idle outside torch.distributed: sleep, a lock, an event, a queue
    PYTHON = "python"  # in Python code; the stack format cannot tell running from blocked
    GIL_HELD = "gil-held"  # the rank's Python handlers did not answer: the GIL is held
    NO_STACKS = "no-stacks"  # no stacks could be read


@dataclass(frozen=True, kw_only=True)
class RankStack:
    rank: int
    state: str  # a StackState
    frames: list[str] = field(default_factory=list)  # main thread, innermost first
    detail: str = ""  # e.g. "recv from rank 1 (distributed_c10d.py:2799)"
    peer: int | None = None  # p2p: the global rank it waits on, when the stack names it


@dataclass(frozen=True, kw_only=True)
class StackDiagnosis:
    """The diagnosis from every rank's stacks, made where FR shows no culprit."""

    ranks: list[RankStack] = field(default_factory=list)  # capped (stackdiag.MAX_RANK_STACKS)
    odd_ranks: list[int] = field(default_factory=list)  # the ones the others wait on
    cycles: list[list[int]] = field(default_factory=list)  # p2p deadlocks from the peers
    summary: str = ""


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
    # What the verdict rests on: "fr", or "stacks" where FR showed no culprit
    # and the ranks' Python stacks named one (stack_diagnosis says how).
    basis: str = "fr"
    stack_diagnosis: StackDiagnosis | None = None
    schema: str = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        d = _as_plain(self)
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
            groups=[
                GroupProgress(
                    **{k: v for k, v in g.items() if k != "positions"},
                    positions=[GroupPosition(**p) for p in g.get("positions") or []],
                )
                for g in d.get("groups") or []
            ],
            waits_for=[WaitEdge(**w) for w in d.get("waits_for") or []],
            # Absent from reports written before they were recorded.
            roots=[int(r) for r in d.get("roots") or []],
            cycles=[[int(r) for r in c] for c in d.get("cycles") or []],
            evidence=ev,
            basis=str(d.get("basis") or "fr"),
            stack_diagnosis=_stack_diagnosis(d.get("stack_diagnosis")),
        )


def _stack_diagnosis(d: dict[str, Any] | None) -> StackDiagnosis | None:
    if not d:
        return None
    return StackDiagnosis(
        ranks=[RankStack(**r) for r in d.get("ranks") or []],
        odd_ranks=[int(r) for r in d.get("odd_ranks") or []],
        cycles=[[int(r) for r in c] for c in d.get("cycles") or []],
        summary=str(d.get("summary") or ""),
    )


if __name__ == "__main__":  # python -m hangwatch.analyzer.report: the docs' list
    print(verdicts_markdown(), end="")


# Values dataclasses.asdict would deep-copy only to get themselves back.
_ATOMIC = frozenset({int, str, float, bool, type(None)})


def _as_plain(v: Any) -> Any:
    """dataclasses.asdict's result, without its deepcopy of every int and str:
    a 4,096-rank report holds ~40,000 ranks in its group tables, and asdict
    took 0.3 s over them."""
    if type(v) in _ATOMIC:
        return v
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _as_plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        return type(v)(*[_as_plain(x) for x in v])
    if isinstance(v, list | tuple):
        return type(v)(_as_plain(x) for x in v)
    if isinstance(v, dict):
        return type(v)((_as_plain(k), _as_plain(x)) for k, x in v.items())
    return copy.deepcopy(v)
