"""`<bundle>/rank_<R>/meta.json`: what was known about one rank when its dump was taken.

Written by the node agent beside each rank's FR dump (agent/collector.py),
by the coordinator for ranks nobody could dump (from what registration knew),
and by the hang zoo's snapshots; read by the analyzer (stacks, process state,
group memberships) and by the coordinator (was a stored incident taken from
the processes running now?).

Readers: a file without a schema tag is read (the previous release's
coordinator-written metas may lack one); unknown keys are ignored, so a newer
writer's additions never stop an older reader; a present field of the wrong
type is a `FormatError`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hangwatch.formats import checks as c
from hangwatch.formats.rankinfo import GroupInfo, Recorder, groups_from_json, recorders_from_json

RANKMETA = "hangwatch.rankmeta/1"
# RankMeta.peer_stacks in meta.json.
PEER_STACKS_KEY = "peer_stacks"
# A 4,096-member non-strided group in every one of hundreds of groups is
# still far below this; a file above it is not ours.
MAX_RANKMETA_BYTES = 16 * 1024**2
# sources["process"] of a meta.json the coordinator wrote for a rank nobody
# dumped: a stand-in, which the rank's own meta.json replaces if it arrives
# after all (an agent back from a partition).
STAND_IN_SOURCE = "coordinator"


@dataclass(frozen=True, kw_only=True)
class RankMeta:
    rank: int  # global rank
    host: str | None = None  # None: nobody could ask (the coordinator's copy of a lost rank)
    pid: int | None = None
    # The rank's process as /proc showed it when the dump was taken
    # (hangwatch.wire.state_name: "running", "stopped", "gone", ...,
    # "unknown"); None: the file does not say.
    process_state: str | None = None
    # Whether anyone reached the rank's FR endpoint. False with no FR dump:
    # the rank is unobserved (a lost agent), not necessarily guilty.
    # None: the file does not say.
    reachable: bool | None = None
    groups: tuple[GroupInfo, ...] = ()  # with members; long strided lists as ranges
    recorders: tuple[Recorder, ...] = ()  # each FR instance's own group numbering
    # Where each piece came from: "fr" a FrSource value; "stacks"
    # "worker-server" | "thread" | "py-spy" | "none"; "gpu" "nvml" | "none";
    # "process" "procfs" | "coordinator" | "none".
    sources: dict[str, str] = field(default_factory=dict)
    # NVML's view of the node ({"available": true, "devices": [...]}) or why
    # there is none ({"available": false, "reason": ...}); None: not taken.
    gpu: dict[str, Any] | None = None
    # Per piece ("fr", "stacks", "fr_tail"): why it is missing or degraded.
    errors: dict[str, str] = field(default_factory=dict)
    # The stacks text, only in a tails-first incident (instead of stacks.txt).
    stacks: str | None = None
    # Coordinator-written only: seconds since the rank's agent last reported it.
    last_report_age_s: float | None = None

    @property
    def stand_in(self) -> bool:
        """Written by the coordinator for a rank nobody dumped (STAND_IN_SOURCE)."""
        return self.reachable is False and self.sources.get("process") == STAND_IN_SOURCE

    # Uncaught exceptions the hook saw in the rank's threads, oldest first:
    # "thread <name>: <type>: <message>" (agent-written; absent: none seen).
    exceptions: tuple[str, ...] = ()
    # `py-spy dump --locals` cut to thread headers, frames and torch.distributed's
    # p2p peer arguments (hangwatch.agent.stackargs); agent-written, absent: not taken.
    peer_stacks: str | None = None
    # The agent's measured offset of this host's wall clock from the
    # coordinator's (add it to get the coordinator's) and its error bound, in
    # ns: what makes FR timestamps of different hosts comparable. None: not
    # measured (an older agent, no coordinator reached yet).
    clock_offset_ns: int | None = None
    clock_error_ns: int | None = None

    SCHEMA: ClassVar[str] = RANKMETA

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema": RANKMETA,
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "process_state": self.process_state,
            "reachable": self.reachable,
            "groups": [g.to_json(compact=True) for g in self.groups],
            "recorders": [r.to_json() for r in self.recorders],
            "sources": dict(self.sources),
            "gpu": self.gpu,
            "errors": dict(self.errors),
        }
        if self.stacks is not None:
            d["stacks"] = self.stacks
        if self.last_report_age_s is not None:
            d["last_report_age_s"] = self.last_report_age_s
        if self.exceptions:
            d["exceptions"] = list(self.exceptions)
        if self.peer_stacks is not None:
            d[PEER_STACKS_KEY] = self.peer_stacks
        if self.clock_offset_ns is not None:
            d["clock_offset_ns"] = self.clock_offset_ns
            d["clock_error_ns"] = self.clock_error_ns
        return d

    def to_bytes(self, *, pretty: bool = False) -> bytes:
        """Compact by default: with indent, json falls back to its pure-Python
        encoder, and a 4,096-member default group made that 2.6 ms and 42 KB a rank."""
        if pretty:
            return (json.dumps(self.to_json(), indent=2) + "\n").encode()
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, d: Any) -> RankMeta:
        s = RANKMETA
        d = c.document(d, s)
        return cls(
            rank=c.req_int(d, "rank", s, minimum=0),
            host=c.opt_str(d, "host", s, None),
            pid=c.opt_int(d, "pid", s, None),
            process_state=c.opt_str(d, "process_state", s, None),
            reachable=c.opt_bool(d, "reachable", s, None),
            groups=groups_from_json(d, s),
            recorders=recorders_from_json(d, s),
            sources=c.str_map(d, "sources", s),
            gpu=c.opt_object(d, "gpu", s),
            errors=c.str_map(d, "errors", s),
            stacks=c.opt_str(d, "stacks", s, None),
            peer_stacks=c.opt_str(d, PEER_STACKS_KEY, s, None),
            last_report_age_s=c.opt_float(d, "last_report_age_s", s, None),
            exceptions=tuple(c.str_list(d, "exceptions", s)),
            clock_offset_ns=c.opt_int(d, "clock_offset_ns", s, None),
            clock_error_ns=c.opt_int(d, "clock_error_ns", s, None),
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> RankMeta:
        return cls.from_json(c.loads(data, RANKMETA, MAX_RANKMETA_BYTES))

    def replace(self, **changes: Any) -> RankMeta:
        return dataclasses.replace(self, **changes)
