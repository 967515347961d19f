"""What the hook in a rank tells the node agent: the rank-info file and the event lines.

`<run_dir>/hook/<pid>.json` (`RankInfo`) is rewritten atomically by the hook
each time a process group is created; the agent discovers ranks from these
files and reads FR `pg_status` (keyed by each recorder's local pg_id) through
the groups and recorders listed here. `<pid>.events.jsonl` holds one
`HookEvent` per line, appended with a single write.

Readers: a file without a schema tag is read (earlier hooks wrote some
untagged); unknown keys are ignored, so a newer hook's additions never stop
an older agent; a present field of the wrong type is a `FormatError`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from hangwatch.formats import checks as c
from hangwatch.formats.codes import Completion, HookEventKind, RecorderKind
from hangwatch.formats.files import (
    GENERIC_INSTANCE,
    compact_ranks,
    fr_file_prefix,
    rank_range,
)

RANKINFO = "hangwatch.rankinfo/1"
HOOK_EVENT = "hangwatch.hookevent/1"
# Megatron-style jobs create hundreds of groups, each listing its members.
MAX_RANKINFO_BYTES = 64 * 1024**2
MAX_EVENT_BYTES = 64 * 1024


@dataclass(frozen=True, kw_only=True)
class GroupInfo:
    """One process group this rank belongs to (rank-info and rank-meta `groups`)."""

    name: str  # torch's group name, the key everywhere: "0" is the default group
    desc: str = ""  # torch's group_desc: "default_pg", or what the job called it
    # This rank's local index of the group, which FR's pg_status is keyed by;
    # None where the writer could not know it (the coordinator's copy).
    pg_id: int | None = None
    # Global ranks. Written as {"start", "stop", "step"} when long and strided
    # (see files.compact_ranks); read back as a range then.
    ranks: Sequence[int] = ()

    def to_json(self, *, compact: bool = False) -> dict[str, Any]:
        ranks: Any
        if isinstance(self.ranks, range) and compact and len(self.ranks) > 1:
            r = self.ranks
            ranks = {"start": r.start, "stop": r.stop, "step": r.step}
        else:
            ranks = compact_ranks(list(self.ranks)) if compact else list(self.ranks)
        return {"name": self.name, "desc": self.desc, "pg_id": self.pg_id, "ranks": ranks}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], schema: str) -> GroupInfo:
        # Fast path for a well-formed group: the analyzer reads every group of
        # every rank's meta.json (16,384 at 4,096 ranks), and the checked path
        # below costs twice as much. Anything unusual takes the checked path.
        name, desc, pg_id, raw = d.get("name"), d.get("desc", ""), d.get("pg_id"), d.get("ranks")
        if (
            type(name) is str
            and type(desc) is str
            and (pg_id is None or (type(pg_id) is int and pg_id >= 0))
        ):
            fast: Sequence[int] | None = None
            if type(raw) is list and all(type(x) is int for x in raw):
                fast = raw
            elif type(raw) is dict:
                fast = rank_range(raw)
            elif raw is None:
                fast = []
            if fast is not None:
                return cls(name=name, desc=desc, pg_id=pg_id, ranks=fast)
        ranks: Sequence[int]
        if isinstance(raw, dict):
            found = rank_range(raw)
            if found is None:
                c.fail(schema, f"group ranks {str(raw)[:80]} is not a valid start/stop/step range")
            ranks = found
        else:
            ranks = c.int_list(d, "ranks", schema)
        return cls(
            name=c.req_str(d, "name", schema),
            desc=c.get_str(d, "desc", schema),
            pg_id=c.opt_int(d, "pg_id", schema, None, minimum=0),
            ranks=ranks,
        )


@dataclass(frozen=True, kw_only=True)
class Recorder:
    """One flight-recorder instance of a rank and how to read it (hangwatch.recorders)."""

    instance: str  # torch's backend= name: "gloo" (the generic one), "nccl", ...
    # A RecorderKind value; a kind a newer hook names is kept as its text.
    kind: str = RecorderKind.GENERIC
    completion: Completion = Completion.TRACKED
    # Added to pg_status's last_enqueued/last_completed to get collective seqs.
    status_offset: int = 0
    # Groups recorded here, in the order this instance numbers them: pg_id == index.
    groups: tuple[str, ...] = ()
    # torch's C++ worker-server handler for the full JSON dump (answers without the GIL).
    json_handler: str = ""

    SCHEMA: ClassVar[str] = "hangwatch.recorder"

    @property
    def file_stem(self) -> str:
        """Bundle file name before the rank: fr_trace_rank_<R> for gloo's, as always."""
        return fr_file_prefix(self.instance)

    def to_json(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "kind": str(self.kind),
            "completion": str(self.completion),
            "status_offset": self.status_offset,
            "groups": list(self.groups),
            "json_handler": self.json_handler,
        }

    @classmethod
    def from_json(cls, d: Any, schema: str = SCHEMA) -> Recorder:
        d = c.document(d, schema)
        completion = c.known(Completion, c.get_str(d, "completion", schema, Completion.TRACKED))
        return cls(
            instance=c.req_str(d, "instance", schema),
            kind=c.known(RecorderKind, c.get_str(d, "kind", schema, RecorderKind.GENERIC)),
            # A value this reader does not know promises nothing about completion.
            completion=completion if isinstance(completion, Completion) else Completion.UNKNOWN,
            status_offset=c.get_int(d, "status_offset", schema, 0),
            groups=tuple(c.str_list(d, "groups", schema)),
            json_handler=c.get_str(d, "json_handler", schema),
        )


def groups_from_json(d: Mapping[str, Any], schema: str) -> tuple[GroupInfo, ...]:
    return c.each(d, "groups", schema, GroupInfo.from_json)


def recorders_from_json(d: Mapping[str, Any], schema: str) -> tuple[Recorder, ...]:
    return c.each(d, "recorders", schema, Recorder.from_json)


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """`<run_dir>/hook/<pid>.json`: one training process, written by its hook."""

    rank: int  # global rank
    world_size: int
    pid: int
    # Clock ticks since boot (/proc/<pid>/stat field 22): tells this process
    # from a later one that reuses its pid. None where /proc was unreadable.
    proc_starttime: int | None = None
    job_id: str = ""
    local_rank: int = -1  # LOCAL_RANK, or -1 when the launcher set none
    host: str = ""
    backend: str = ""  # torch's name of the default group's backend
    torch_version: str = ""
    socket: str | None = None  # the rank's FR endpoint (Unix socket); None before it serves
    fr_source: str = ""  # a FrSource value: "worker-server" (torch's C++) or "thread"
    started_unix: float = 0.0  # when the hook attached (this host's clock)
    groups: tuple[GroupInfo, ...] = ()  # in creation order
    # Every FR instance the groups write to; empty before the first group
    # (readers then assume the generic instance in creation order).
    recorders: tuple[Recorder, ...] = ()
    # Where torch writes its dump-on-timeout file (a prefix, rank appended):
    # the run dir's fr/ unless the job set its own ("" when unknown).
    watchdog_prefix: str = ""

    SCHEMA: ClassVar[str] = RANKINFO

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": RANKINFO,
            "job_id": self.job_id,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "pid": self.pid,
            "proc_starttime": self.proc_starttime,
            "host": self.host,
            "backend": self.backend,
            "torch_version": self.torch_version,
            "socket": self.socket,
            "fr_source": self.fr_source,
            "started_unix": self.started_unix,
            "groups": [g.to_json() for g in self.groups],
            "recorders": [r.to_json() for r in self.recorders],
            "dump_prefixes": {"watchdog": self.watchdog_prefix},
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), indent=1).encode()

    @classmethod
    def from_json(cls, d: Any) -> RankInfo:
        s = RANKINFO
        d = c.document(d, s)
        prefixes = c.str_map(d, "dump_prefixes", s)
        return cls(
            rank=c.req_int(d, "rank", s, minimum=0),
            world_size=c.req_int(d, "world_size", s, minimum=1),
            pid=c.req_int(d, "pid", s, minimum=1),
            proc_starttime=c.opt_int(d, "proc_starttime", s, None),
            job_id=c.get_str(d, "job_id", s),
            local_rank=c.get_int(d, "local_rank", s, -1, minimum=-1),
            host=c.get_str(d, "host", s),
            backend=c.get_str(d, "backend", s),
            torch_version=c.get_str(d, "torch_version", s),
            socket=c.opt_str(d, "socket", s, None) or None,
            fr_source=c.get_str(d, "fr_source", s),
            started_unix=c.get_float(d, "started_unix", s, 0.0),
            groups=groups_from_json(d, s),
            recorders=recorders_from_json(d, s),
            watchdog_prefix=prefixes.get("watchdog", ""),
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> RankInfo:
        return cls.from_json(c.loads(data, RANKINFO, MAX_RANKINFO_BYTES))


@dataclass(frozen=True, kw_only=True)
class HookEvent:
    """One line of `<run_dir>/hook/<pid>.events.jsonl`."""

    # A HookEventKind value; a kind a newer hook writes is kept as its text.
    kind: str
    rank: int = -1  # -1: the process was not a rank yet
    detail: str = ""  # the exception text or what torch said, cut to 4,000 characters
    thread: str = ""  # the Python thread it happened on
    unix: float = 0.0  # this host's clock

    def to_bytes(self) -> bytes:
        """One line, newline included: appended in one write, never seen half."""
        doc = {
            "schema": HOOK_EVENT,
            "kind": str(self.kind),
            "rank": self.rank,
            "detail": self.detail,
            "thread": self.thread,
            "unix": self.unix,
        }
        return (json.dumps(doc) + "\n").encode()

    @classmethod
    def from_json(cls, d: Any) -> HookEvent:
        s = HOOK_EVENT
        d = c.document(d, s)
        return cls(
            kind=c.known(HookEventKind, c.req_str(d, "kind", s)),
            rank=c.get_int(d, "rank", s, -1, minimum=-1),
            detail=c.get_str(d, "detail", s),
            thread=c.get_str(d, "thread", s),
            unix=c.get_float(d, "unix", s, 0.0),
        )

    @classmethod
    def from_bytes(cls, line: bytes) -> HookEvent:
        return cls.from_json(c.loads(line, HOOK_EVENT, MAX_EVENT_BYTES))


__all__ = [
    "GENERIC_INSTANCE",
    "HOOK_EVENT",
    "RANKINFO",
    "GroupInfo",
    "HookEvent",
    "RankInfo",
    "Recorder",
]
