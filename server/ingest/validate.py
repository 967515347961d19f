"""Checks on everything agents send, before it touches state or disk.

Each check raises `Invalid` with a message naming the field; the gRPC layer
turns it into INVALID_ARGUMENT. Limits keep one bad or hostile agent from
making the coordinator hold unbounded memory or write outside its data dir.
"""

from __future__ import annotations

import re
from collections.abc import Sized
from typing import Final, Protocol

from hangwatch.server.incidents.store import INCIDENT_ID_RE
from hangwatch.server.live.registry import MAX_GROUPS_PER_RANK, MAX_RANKS_PER_AGENT, MAX_WORLD_SIZE

from hangwatch import progress_columns
from hangwatch.wire import pb

MAX_ID_LEN: Final = 128
MAX_GROUP_NAME_LEN: Final = 256
MAX_TEXT_LEN: Final = 4096
MAX_ENTRIES_PER_BATCH: Final = 100_000
MAX_FAILURES: Final = MAX_RANKS_PER_AGENT

# Bundle file names: a plain base name, no separators, no leading dot.
FILE_NAME_RE: Final = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


class Invalid(ValueError):
    """A request field is out of bounds or malformed."""


def ident(kind: str, value: str) -> str:
    """Job and agent ids: printable, bounded, nothing that could act as a path."""
    if not value:
        raise Invalid(f"{kind} is empty")
    if len(value) > MAX_ID_LEN:
        raise Invalid(f"{kind} is longer than {MAX_ID_LEN} characters")
    if "/" in value or "\\" in value or ".." in value or "\x00" in value:
        raise Invalid(f"{kind} {value!r} contains '/', '\\\\', '..' or NUL")
    if not value.isprintable():
        raise Invalid(f"{kind} {value!r} contains non-printable characters")
    return value


class _Sent(Protocol):
    @property
    def job_id(self) -> str: ...
    @property
    def agent_id(self) -> str: ...


def sender(req: _Sent) -> None:
    """Every agent message names its job and its agent."""
    ident("job_id", req.job_id)
    ident("agent_id", req.agent_id)


def at_most(items: Sized, limit: int, what: str) -> None:
    """`what` reads after the count: "ranks in one report"."""
    if len(items) > limit:
        raise Invalid(f"{len(items)} {what} (limit {limit})")


def _rank_groups(r: int, groups: Sized) -> None:
    if len(groups) > MAX_GROUPS_PER_RANK:
        raise Invalid(f"rank {r}: {len(groups)} groups (limit {MAX_GROUPS_PER_RANK})")


def group_name(value: str) -> str:
    if not value or len(value) > MAX_GROUP_NAME_LEN or "\x00" in value or not value.isprintable():
        raise Invalid(f"group name {value[:64]!r} is empty, too long or not printable")
    return value


def text(kind: str, value: str) -> str:
    if "\x00" in value:
        raise Invalid(f"{kind} contains NUL")
    return value[:MAX_TEXT_LEN]


def incident_id(value: str) -> str:
    if not INCIDENT_ID_RE.match(value):
        raise Invalid(f"incident_id {value[:80]!r} is not a valid incident id")
    return value


def file_name(value: str) -> str:
    if not FILE_NAME_RE.match(value) or ".." in value or value.endswith(".part"):
        raise Invalid(
            f"file_name {value[:80]!r} must be a plain base name "
            "([A-Za-z0-9_][A-Za-z0-9._-]*, no '..', not *.part)"
        )
    return value


def rank(value: int, *, world_size: int | None = None) -> int:
    limit = world_size if world_size else MAX_WORLD_SIZE
    if not 0 <= value < limit:
        raise Invalid(f"rank {value} is outside [0, {limit})")
    return value


def register_request(req: pb.RegisterRequest) -> None:
    sender(req)
    text("host", req.host)
    at_most(req.ranks, MAX_RANKS_PER_AGENT, "ranks on one agent")
    seen: set[int] = set()
    for ri in req.ranks:
        if not 0 < ri.world_size <= MAX_WORLD_SIZE:
            raise Invalid(
                f"rank {ri.rank}: world_size {ri.world_size} is outside [1, {MAX_WORLD_SIZE}]"
            )
        rank(ri.rank, world_size=ri.world_size)
        if ri.rank in seen:
            raise Invalid(f"rank {ri.rank} listed twice")
        seen.add(ri.rank)
        _rank_groups(ri.rank, ri.groups)
        for g in ri.groups:
            group_name(g.name)
            text("group desc", g.desc)
            _members(ri, g)
        for kind, v in (
            ("backend", ri.backend),
            ("torch_version", ri.torch_version),
            ("fr_source", ri.fr_source),
        ):
            text(kind, v)
    world_sizes = {ri.world_size for ri in req.ranks}
    if len(world_sizes) > 1:
        raise Invalid(f"ranks disagree on world_size: {sorted(world_sizes)}")


def _members(ri: pb.RankInfo, g: pb.GroupInfo) -> None:
    """A group's members, in either form, inside the world and including `ri`.
    Checked with C builtins over the list, or per run: every rank of a job
    registers its world group, so a Python call per member was ranks x world
    calls (268 million at 16,384 ranks)."""
    ws = ri.world_size
    if not g.rank_ranges:
        if len(g.ranks) > ws:
            raise Invalid(f"group {g.name!r}: {len(g.ranks)} members exceed world_size {ws}")
        if g.ranks:
            rank(min(g.ranks), world_size=ws)
            rank(max(g.ranks), world_size=ws)
        if ri.rank not in g.ranks:
            raise Invalid(f"rank {ri.rank} registers group {g.name!r} it is not a member of")
        return
    rr = g.rank_ranges
    if g.ranks:
        raise Invalid(f"group {g.name!r}: both ranks and rank_ranges")
    if len(rr) % 3 or len(rr) // 3 > ws:
        raise Invalid(f"group {g.name!r}: rank_ranges is not (start, stop, step) triples")
    last, member = -1, False
    for k in range(0, len(rr), 3):
        start, stop, step = rr[k], rr[k + 1], rr[k + 2]
        if step < 1 or start <= last or stop <= start or stop > ws + step - 1:
            raise Invalid(
                f"group {g.name!r}: run ({start}, {stop}, {step}) is not ascending within [0, {ws})"
            )
        last = start + (stop - start - 1) // step * step
        if last >= ws:
            raise Invalid(f"group {g.name!r}: member {last} is outside [0, {ws})")
        member |= start <= ri.rank < stop and (ri.rank - start) % step == 0
    if not member:
        raise Invalid(f"rank {ri.rank} registers group {g.name!r} it is not a member of")


def progress_report(req: pb.ProgressReport) -> progress_columns.Columns | None:
    """Check a report; returns its columns unpacked (None without any), for
    the registry and the straggler monitor to read without unpacking again."""
    sender(req)
    at_most(req.ranks, MAX_RANKS_PER_AGENT, "ranks in one report")
    for rp in req.ranks:
        rank(rp.rank)
        _rank_groups(rp.rank, rp.groups)
        for gp in rp.groups:
            group_name(gp.group)
            if gp.last_enqueued < -1 or gp.last_completed < -1:
                raise Invalid(f"rank {rp.rank} group {gp.group!r}: sequence numbers below -1")
    if not req.HasField("columns"):
        return None
    try:
        c = progress_columns.decode(req.columns)
    except progress_columns.ColumnsError as e:
        raise Invalid(str(e)) from None
    # Whole columns at a time: min and max run in C over the tuples.
    at_most(c.rank, MAX_RANKS_PER_AGENT - len(req.ranks), "column ranks beside the others")
    if c.rank and (min(c.rank) < 0 or max(c.rank) >= MAX_WORLD_SIZE):
        raise Invalid(f"columns.rank: outside [0, {MAX_WORLD_SIZE})")
    if req.ranks and not {rp.rank for rp in req.ranks}.isdisjoint(c.rank):
        raise Invalid("a rank is both in ranks and in columns")
    if c.cell_rank and (min(c.last_enqueued) < -1 or min(c.last_completed) < -1):
        raise Invalid("columns: sequence numbers below -1")
    for op in c.ops:
        text("in-flight op", op)
    return c


def entry_batch(req: pb.EntryBatch) -> None:
    sender(req)
    at_most(req.entries, MAX_ENTRIES_PER_BATCH, "entries in one batch")
    for e in req.entries:
        rank(e.rank)
        group_name(e.group)


def event(req: pb.Event) -> None:
    sender(req)
    if req.rank != -1:
        rank(req.rank)
    text("detail", req.detail)


def dump_result(req: pb.DumpResult) -> None:
    sender(req)
    incident_id(req.incident_id)
    if len(req.ranks_dumped) > MAX_RANKS_PER_AGENT or len(req.failures) > MAX_FAILURES:
        raise Invalid("too many ranks in one dump result")
    for r in req.ranks_dumped:
        rank(r)
    for f in req.failures:
        rank(f.rank)
        text("failure reason", f.reason)
    if len(req.actions) > MAX_RANKS_PER_AGENT:
        raise Invalid("too many ranks in one action result")
    for a in req.actions:
        rank(a.rank)
        text("action outcome", a.outcome)
        text("action detail", a.detail)
        if len(a.signals) > 4:
            raise Invalid("too many signals in one action result")
        for sig in a.signals:
            text("action signal", sig)
