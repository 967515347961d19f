"""Build flight-recorder dumps the way torch writes them, for torch-free tests.

`SimJob` plays a job's ranks issuing collectives and p2p ops; each rank keeps
a ring buffer of entries and pg_status counters with torch's semantics (NCCL:
`state` goes scheduled -> started -> completed with timestamps; gloo: always
`scheduled`, `retired` marks completion; pg_status reports the seq of the last
*work* of either kind, as torch does). Dumps are written as pickle (ints,
`None` timestamps) or JSON (string pg_status values, `0` timestamps).
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

T0 = 1_700_000_000_000_000_000


@dataclass
class _PG:
    pg_id: int
    coll_seq: int = 0
    p2p_seq: int = 0
    last_enq: int = -1
    last_comp: int = -1


@dataclass
class SimRank:
    rank: int
    job: SimJob
    entries: list[dict[str, Any]] = field(default_factory=list)
    pgs: dict[str, _PG] = field(default_factory=dict)
    record_id: int = 0

    def pg(self, group: str) -> _PG:
        if group not in self.pgs:
            self.pgs[group] = _PG(pg_id=len(self.pgs))
        return self.pgs[group]

    def _local(self, group: str) -> int:
        return sorted(self.job.groups[group][1]).index(self.rank)

    def _add(self, e: dict[str, Any]) -> dict[str, Any]:
        self.entries.append(e)
        self.record_id += 1
        buf = self.job.buffer_size
        if buf is not None and len(self.entries) > buf:
            del self.entries[: len(self.entries) - buf]
        return e

    def _base(
        self, group: str, pg: _PG, name: str, done: bool, state: str | None
    ) -> dict[str, Any]:
        nccl = self.job.backend == "nccl"
        if state is None:
            state = ("completed" if done else "scheduled") if nccl else "scheduled"
        t = T0 + self.record_id * 1000 + self.rank
        e: dict[str, Any] = {
            "record_id": self.record_id,
            "pg_id": pg.pg_id,
            "process_group": (group, self.job.groups[group][0]),
            "collective_seq_id": pg.coll_seq,
            "p2p_seq_id": 0,
            "op_id": pg.coll_seq + pg.p2p_seq,
            "profiling_name": f"{self.job.backend}:{name}",
            "time_created_ns": t,
            "input_sizes": [[4]],
            "input_dtypes": ["Float"],
            "output_sizes": [[4]],
            "output_dtypes": ["Float"],
            "state": state,
            "time_discovered_started_ns": t + 10
            if nccl and state in ("started", "completed")
            else None,
            "time_discovered_completed_ns": t + 20 if nccl and state == "completed" else None,
            "retired": bool(done),
            "timeout_ms": 600000,
            "is_p2p": False,
            "thread_name": "pt_main_thread",
            "thread_id": "140000000000001",
            "frames": [
                {"name": "train_step", "filename": "train.py", "line": 100 + pg.coll_seq},
                {"name": "main", "filename": "train.py", "line": 10},
            ],
        }
        return e

    def coll(
        self,
        group: str,
        op: str = "all_reduce",
        *,
        done: bool = True,
        state: str | None = None,
        sizes: list[list[int]] | None = None,
        out_sizes: list[list[int]] | None = None,
        dtypes: list[str] | None = None,
        out_dtypes: list[str] | None = None,
        coalesced: int = 0,
    ) -> SimRank:
        pg = self.pg(group)
        pg.coll_seq += 1
        # A coalesced op: `coalesced` member entries, then the closing one.
        for _ in range(coalesced):
            e = self._base(group, pg, op, done, state)
            self._add(e)
        e = self._base(group, pg, "coalesced" if coalesced else op, done, state)
        if sizes is not None:
            e["input_sizes"] = sizes
            e["output_sizes"] = out_sizes if out_sizes is not None else sizes
        elif out_sizes is not None:
            e["output_sizes"] = out_sizes
        if dtypes is not None:
            e["input_dtypes"] = dtypes
            e["output_dtypes"] = out_dtypes if out_dtypes is not None else dtypes
        self._add(e)
        pg.last_enq = pg.coll_seq
        if done:
            pg.last_comp = pg.coll_seq
        return self

    def p2p(self, group: str, kind: str, peer: int, *, done: bool = False) -> SimRank:
        """kind 'send'/'recv'; peer is a *global* rank, written group-local as torch does."""
        if self.job.backend == "gloo":
            return self  # gloo records no send/recv at all
        pg = self.pg(group)
        pg.p2p_seq += 1
        me = self._local(group)
        other = sorted(self.job.groups[group][1]).index(peer)
        name = f"send {me}->{other}" if kind == "send" else f"recv {me}<-{other}"
        e = self._base(group, pg, name, done, None)
        e["p2p_seq_id"] = pg.p2p_seq
        e["is_p2p"] = True
        self._add(e)
        pg.last_enq = pg.p2p_seq  # torch: pg_status tracks the last work of either kind
        if done:
            pg.last_comp = pg.p2p_seq
        return self

    def finish_all(self) -> SimRank:
        for e in self.entries:
            e["retired"] = True
            if self.job.backend == "nccl":
                e["state"] = "completed"
        for pg in self.pgs.values():
            pg.last_comp = pg.last_enq
        return self

    def dump_obj(self, *, json_form: bool = False, version: str = "2.10") -> dict[str, Any]:
        pg_config: dict[str, Any]
        if self.job.backend == "gloo":
            pg_config = {"": {"name": "", "desc": "", "ranks": "[]"}}
        else:
            pg_config = {
                g: {"name": g, "desc": d, "ranks": str(sorted(r))}
                for g, (d, r) in self.job.groups.items()
                if self.rank in r
            }
        status: dict[str, dict[str, Any]] = {
            str(pg.pg_id): {
                "last_enqueued_collective": pg.last_enq,
                "last_started_collective": -1,
                "last_completed_collective": pg.last_comp,
            }
            for pg in self.pgs.values()
        }
        entries = [dict(e) for e in self.entries]
        if json_form:
            status = {k: {kk: str(vv) for kk, vv in v.items()} for k, v in status.items()}
            for e in entries:
                e.pop("frames", None)  # the JSON dump carries no frames
                e["process_group"] = list(e["process_group"])
                for k in ("time_discovered_started_ns", "time_discovered_completed_ns"):
                    e[k] = e[k] or 0
        lib_key = "comm_lib_version" if version == "2.10" else "nccl_version"
        if version == "2.0":
            # 2.0 predates is_p2p, retired, thread_* and timeout_ms.
            for e in entries:
                for k in ("is_p2p", "retired", "thread_name", "thread_id", "timeout_ms"):
                    e.pop(k, None)
        return {
            "version": version,
            "pg_config": pg_config,
            lib_key: "2.21.5" if self.job.backend == "nccl" else "",
            "pg_status": status,
            "entries": entries,
        }

    def dump_bytes(self, *, json_form: bool = False, version: str = "2.10") -> bytes:
        obj = self.dump_obj(json_form=json_form, version=version)
        return json.dumps(obj).encode() if json_form else pickle.dumps(obj)


class SimJob:
    def __init__(
        self, world: int, *, backend: str = "nccl", buffer_size: int | None = None
    ) -> None:
        self.backend = backend
        self.buffer_size = buffer_size
        self.groups: dict[str, tuple[str, list[int]]] = {"0": ("default_pg", list(range(world)))}
        self.ranks = [SimRank(r, self) for r in range(world)]
        for r in self.ranks:
            r.pg("0")

    def group(self, name: str, ranks: list[int], desc: str = "undefined") -> str:
        self.groups[name] = (desc, sorted(ranks))
        for r in sorted(ranks):
            self.ranks[r].pg(name)
        return name

    def all(
        self, group: str = "0", op: str = "all_reduce", *, ranks: list[int] | None = None, **kw: Any
    ) -> None:
        for r in ranks if ranks is not None else self.groups[group][1]:
            self.ranks[r].coll(group, op, **kw)

    def write(
        self,
        d: Path,
        *,
        json_form: bool = False,
        ranks: list[int] | None = None,
        name: str = "nccl_trace_rank_{rank}",
        version: str = "2.10",
    ) -> Path:
        d.mkdir(parents=True, exist_ok=True)
        for r in ranks if ranks is not None else range(len(self.ranks)):
            (d / name.format(rank=r)).write_bytes(
                self.ranks[r].dump_bytes(json_form=json_form, version=version)
            )
        return d


def write_meta(d: Path, rank: int, **fields: Any) -> Path:
    """A bundle rank directory with meta.json (schema hangwatch.rankmeta/1)."""
    rd = d / f"rank_{rank}"
    rd.mkdir(parents=True, exist_ok=True)
    meta = {"schema": "hangwatch.rankmeta/1", "rank": rank, "host": "node-a", "pid": 1000 + rank}
    meta.update(fields)
    (rd / "meta.json").write_text(json.dumps(meta))
    return rd
