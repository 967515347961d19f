"""Simulated node agents that speak the real gRPC protocol, for load tests and benchmarks.

Each simulated agent stands for one 8-GPU node: it opens its own gRPC channel
(its own TCP connection), registers its 8 ranks with their process groups,
reports progress at 1 Hz, keeps a WatchCommands stream open, and answers a
DUMP command the way `hangwatch agent` does: per rank, the FR dump, meta.json
and stacks.txt uploaded file by file in chunks with a sha256, then
CompleteDump; or, when the command asks for tails (a large incident), every
rank's FR tail (`hangwatch.frtail`), meta.json and stacks.txt in one
compressed UploadFiles stream, and later the full dumps of the ranks an
UPLOAD_FULL names. Hundreds of agents share one asyncio loop per process, and a
fleet can span a few processes (`Fleet`).

The job is a Megatron-style TP x PP x DP layout (tensor-parallel groups of 8
inside a node, pipeline and data-parallel groups across nodes) running a
fixed program of collectives per step, so every rank's sequence numbers are
a pure function of time: all processes of a fleet agree on them without
talking to each other. A hang is one rank that stops before a TP collective;
where every other rank ends up blocked follows from NCCL semantics (a
collective completes only when every member's stream reaches it), computed
by one forward sweep, exactly as in `benchmarks/gen_nccl_dumps.py`.

Dumps are NCCL-shaped (FR format 2.10: `pg_config` with member lists,
`pg_status` keyed by local pg_id, entries with `started`/`completed` states,
timestamps and call-site frames) and pickled the way torch writes them
(protocol 2). Pickling 2,000 entries costs ~35 ms, far too much to do for
4,096 ranks inside a fan-out being timed, so each distinct rank *state* is
pickled once as a template whose per-rank strings (group names, member
lists, thread id) are sentinels; a rank's bytes are the template's segments
joined around its own strings. Protocol 2 has no byte offsets or frames and
the memo is by object, so the patched pickle is exactly what pickling that
rank's dict would give.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Final

import grpc
from hangwatch.agent.delta import DeltaReporter
from hangwatch.agent.uploader import pack_chunks

from hangwatch import formats, frtail
from hangwatch.wire import pb, rpc

RANKS_PER_AGENT: Final = 8
FR_VERSION: Final = "2.10"
NCCL_VERSION: Final = "2.27.3"
TORCH_VERSION: Final = "2.13.0"
# Same ceiling as the real agent's uploader (one chunk per ~0.75 MB dump).
CHUNK_BYTES: Final = 1 << 20
# The job ran this many steps before the run starts, so record ids and
# sequence numbers are as large as in a long-running job.
START_STEP: Final = 17_000
UNARY_TIMEOUT_S: Final = 30.0
UPLOAD_TIMEOUT_S: Final = 120.0

KINDS: Final = ("default", "tp", "pp", "dp")
PG_ID: Final = {"default": 0, "tp": 1, "pp": 2, "dp": 3}  # creation order on every rank
DESC: Final = {
    "default": "default_pg",
    "tp": "TENSOR_MODEL_PARALLEL_GROUP",
    "pp": "PIPELINE_MODEL_PARALLEL_GROUP",
    "dp": "DATA_PARALLEL_GROUP",
}
# One training step. Pipeline stages exchange activations with send/recv,
# which FR does not count in collective_seq_id; the PP group's collective is
# the cross-stage grad-norm all-reduce.
STEP: Final[tuple[tuple[str, str], ...]] = (
    ("tp", "_all_gather_base"),
    ("tp", "_reduce_scatter_base"),
    ("tp", "_all_gather_base"),  # the hang position: a TP op inside a node
    ("tp", "_reduce_scatter_base"),
    ("pp", "all_reduce"),
    ("dp", "_reduce_scatter_base"),
    ("dp", "_all_gather_base"),
    ("default", "all_reduce"),
)
OPS_PER_STEP: Final = len(STEP)
HANG_POS: Final = 2
assert STEP[HANG_POS][0] == "tp"

_PER_STEP = {k: sum(1 for kk, _ in STEP if kk == k) for k in KINDS}
# _UPTO[k][pos]: ops of kind k in STEP[: pos + 1]
_UPTO = {
    k: [sum(1 for kk, _ in STEP[: p + 1] if kk == k) for p in range(OPS_PER_STEP)] for k in KINDS
}
_POS_OF = {k: [p for p, (kk, _) in enumerate(STEP) if kk == k] for k in KINDS}


# ---- the job: topology and program -------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Ranks laid out Megatron-style (tp fastest, then dp, then pp)."""

    ranks: int
    tp: int = RANKS_PER_AGENT
    pp: int = 4

    def __post_init__(self) -> None:
        if self.tp != RANKS_PER_AGENT:
            raise ValueError(f"tp must be {RANKS_PER_AGENT}: one TP group per simulated node")
        if self.pp < 1 or self.ranks < self.tp * self.pp or self.ranks % (self.tp * self.pp):
            raise ValueError(
                f"ranks ({self.ranks}) must be a positive multiple of tp*pp ({self.tp}*{self.pp})"
            )

    @property
    def dp(self) -> int:
        return self.ranks // (self.tp * self.pp)

    @property
    def nodes(self) -> int:
        return self.ranks // self.tp

    def group_index(self, kind: str, rank: int) -> int:
        tp_i, rest = rank % self.tp, rank // self.tp
        dp_i, pp_i = rest % self.dp, rest // self.dp
        if kind == "default":
            return 0
        if kind == "tp":
            return rank // self.tp
        if kind == "pp":
            return tp_i + self.tp * dp_i
        return tp_i + self.tp * pp_i

    def group_count(self, kind: str) -> int:
        return {"default": 1, "tp": self.nodes, "pp": self.tp * self.dp, "dp": self.tp * self.pp}[
            kind
        ]

    def group_name(self, kind: str, rank: int) -> str:
        """Names follow torch's creation counter: default "0", then every TP,
        PP and DP group in turn (every rank calls new_group for every group)."""
        base = 1
        for k in KINDS[1:]:
            if k == kind:
                return str(base + self.group_index(kind, rank))
            base += self.group_count(k)
        return "0"

    def group_members(self, kind: str, rank: int) -> list[int]:
        if kind == "default":
            return list(range(self.ranks))
        tp_i, rest = rank % self.tp, rank // self.tp
        dp_i, pp_i = rest % self.dp, rest // self.dp
        if kind == "tp":
            return list(range(rank - tp_i, rank - tp_i + self.tp))
        if kind == "pp":
            return [tp_i + self.tp * (dp_i + self.dp * p) for p in range(self.pp)]
        return [tp_i + self.tp * (d + self.dp * pp_i) for d in range(self.dp)]

    def groups(self) -> dict[str, tuple[str, list[int]]]:
        """Every group: name -> (kind, members)."""
        out: dict[str, tuple[str, list[int]]] = {}
        for k in KINDS:
            for r in range(self.ranks):
                name = self.group_name(k, r)
                if name not in out:
                    out[name] = (k, self.group_members(k, r))
        return out


def last_seq(kind: str, idx: int) -> int:
    """collective_seq_id (1-based) of the last op of `kind` at program index <= idx; 0 = none."""
    if idx < 0:
        return 0
    step, pos = divmod(idx, OPS_PER_STEP)
    return step * _PER_STEP[kind] + _UPTO[kind][pos]


def index_of(kind: str, seq: int) -> int:
    """Program index of the seq-th op of `kind`."""
    step, i = divmod(seq - 1, _PER_STEP[kind])
    return step * OPS_PER_STEP + _POS_OF[kind][i]


def op_at(idx: int) -> tuple[str, str]:
    return STEP[idx % OPS_PER_STEP]


def sweep(topo: Topology, lagging: int, hang_index: int) -> dict[int, int]:
    """Program index each rank ends up blocked at once `lagging` never enters `hang_index`.

    From the hang on, in program order, a group's op completes only if none of
    its members is already blocked; otherwise every member that reached it
    blocks there for good. The lagging rank's own entry is the hang index (it
    completed the op before and never entered it)."""
    if op_at(hang_index)[0] != "tp":
        raise ValueError(f"hang index {hang_index} is not a TP op")
    blocked = {lagging: hang_index}
    i = hang_index
    while len(blocked) < topo.ranks:
        if i > hang_index + 3 * OPS_PER_STEP:
            raise AssertionError("the hang did not reach every rank; check the program")
        kind = op_at(i)[0]
        done: set[int] = set()
        for r in range(topo.ranks):
            gi = topo.group_index(kind, r)
            if gi in done:
                continue
            done.add(gi)
            members = topo.group_members(kind, r)
            if any(m in blocked for m in members):
                for m in members:
                    blocked.setdefault(m, i)
        i += 1
    return blocked


@dataclass(frozen=True, kw_only=True)
class Hang:
    lagging: int
    hang_index: int
    blocked: dict[int, int]

    @property
    def group_kind(self) -> str:
        return "tp"

    @property
    def seq(self) -> int:
        return last_seq("tp", self.hang_index)


@dataclass(frozen=True)
class RankPos:
    """Where a rank's stream is, as program indices: completed through
    `completed`, running `started` (None: nothing running), CPU enqueued
    through `enqueued`."""

    completed: int
    started: int | None
    enqueued: int


@dataclass(frozen=True, kw_only=True)
class Clock:
    """Program position as a function of wall time, shared by every process."""

    epoch: float  # time.time() at program index START_STEP * OPS_PER_STEP
    op_s: float = 0.05

    def index(self, t: float) -> int:
        return START_STEP * OPS_PER_STEP + max(0, int((t - self.epoch) / self.op_s))

    def time_of(self, idx: int) -> float:
        return self.epoch + (idx - START_STEP * OPS_PER_STEP) * self.op_s

    def hang_index_after(self, t: float, margin_s: float = 0.5) -> int:
        """A TP hang position at least `margin_s` ahead, so every process hears of it in time."""
        idx = self.index(t + margin_s)
        step = idx // OPS_PER_STEP + 1
        return step * OPS_PER_STEP + HANG_POS


def rank_pos(rank: int, now_idx: int, hang: Hang | None, queue_depth: int = 1) -> RankPos:
    if hang is not None:
        b = hang.blocked[rank]
        if rank == hang.lagging and now_idx >= b:
            return RankPos(b - 1, None, b - 1)
        if now_idx >= b:
            return RankPos(b - 1, b, b + queue_depth)
    return RankPos(now_idx - 1, now_idx, now_idx)


# ---- FR dumps: templates patched per rank -------------------------------------------

# Per-rank strings; each template holds these placeholders where a rank's own goes.
_SLOTS: Final = (
    "name:tp",
    "name:pp",
    "name:dp",
    "ranks:tp",
    "ranks:pp",
    "ranks:dp",
    "thread_id",
)


def _sentinel(slot: str) -> str:
    return f"\u2063hangwatch-sim:{slot}\u2063"


def _pickled_str(s: str) -> bytes:
    # Protocol 2 writes every str as BINUNICODE: 'X', uint32 length, UTF-8.
    enc = s.encode()
    return b"X" + struct.pack("<I", len(enc)) + enc


_C10D = "/usr/local/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
_LOGGER = "/usr/local/lib/python3.11/site-packages/torch/distributed/c10d_logger.py"
_MAPPINGS = "/workspace/megatron/core/tensor_parallel/mappings.py"
_DDP = "/workspace/megatron/core/distributed/param_and_grad_buffer.py"
_TRAINING = "/workspace/megatron/training/training.py"
_TRAIN: Final = (
    ("train_step", _TRAINING, 1289),
    ("train", _TRAINING, 2065),
    ("pretrain", _TRAINING, 842),
    ("<module>", "/workspace/pretrain_gpt.py", 312),
)
_HEADS: Final = {
    "_all_gather_base": (
        ("all_gather_into_tensor", _C10D, 4021),
        ("wrapper", _LOGGER, 83),
        ("_gather_along_first_dim", _MAPPINGS, 120),
    ),
    "_reduce_scatter_base": (
        ("reduce_scatter_tensor", _C10D, 4512),
        ("wrapper", _LOGGER, 83),
        ("_reduce_scatter_along_first_dim", _MAPPINGS, 164),
    ),
    "all_reduce": (
        ("all_reduce", _C10D, 3245),
        ("wrapper", _LOGGER, 83),
        ("reduce_loss", "/workspace/megatron/training/utils.py", 211),
    ),
}
_MIDS: Final = {
    "dp": (("start_grad_sync", _DDP, 402),),
    "pp": (("clip_grad_norm", "/workspace/megatron/core/optimizer/clip_grads.py", 141),),
}


def _frames(kind: str, op: str) -> list[tuple[str, str, int]]:
    return [*_HEADS[op], *_MIDS.get(kind, ()), *_TRAIN]


def _sizes(topo: Topology, kind: str, op: str) -> tuple[list[list[int]], list[list[int]], str]:
    if kind in ("default", "pp"):
        return [[1]], [[1]], "Float"
    if kind == "tp":
        shard, full = [4096 // topo.tp, 1, 5120], [4096, 1, 5120]
        return (
            ([shard], [full], "BFloat16")
            if op == "_all_gather_base"
            else ([full], [shard], "BFloat16")
        )
    shard_len = 40_000_000 // topo.dp
    if op == "_all_gather_base":
        return [[shard_len]], [[shard_len * topo.dp]], "BFloat16"
    return [[shard_len * topo.dp]], [[shard_len]], "Float"


@dataclass(frozen=True)
class _Template:
    segments: tuple[bytes, ...]
    slots: tuple[str, ...]  # slot filled between segments[i] and segments[i + 1]


class DumpFactory:
    """FR dump bytes for any rank in any state, cheaply."""

    def __init__(
        self, topo: Topology, clock: Clock, *, entries: int = 2000, tail_context: int = 0
    ) -> None:
        self.topo = topo
        self.clock = clock
        self.entries = entries
        # > 0: every dump is cut to its tail by the same code the agent runs.
        self.tail_context = tail_context
        self._templates: dict[RankPos, _Template] = {}
        self.sizes = {(k, op): _sizes(topo, k, op) for k, op in STEP}
        self._lock = threading.Lock()

    def rank_strings(self, rank: int) -> dict[str, str]:
        t = self.topo
        out = {"thread_id": str(139_800_000_000_000 + rank * 4096)}
        for k in ("tp", "pp", "dp"):
            out[f"name:{k}"] = t.group_name(k, rank)
            out[f"ranks:{k}"] = str(t.group_members(k, rank))
        return out

    def dump_bytes(self, rank: int, pos: RankPos) -> bytes:
        with self._lock:  # the pre-hashing thread builds templates too
            tpl = self._templates.get(pos)
            if tpl is None:
                tpl = self._templates[pos] = self._build(pos)
                if len(self._templates) > 64:  # bounded: only a handful of states occur
                    del self._templates[next(iter(self._templates))]
        vals = self.rank_strings(rank)
        parts: list[bytes] = [tpl.segments[0]]
        for slot, seg in zip(tpl.slots, tpl.segments[1:], strict=True):
            parts.append(_pickled_str(vals[slot]))
            parts.append(seg)
        return b"".join(parts)

    def dump_dict(self, pos: RankPos, strings: dict[str, str]) -> dict[str, Any]:
        """The dump as torch would hold it before pickling (with `strings` filled in)."""
        names = {"default": "0"} | {k: strings[f"name:{k}"] for k in ("tp", "pp", "dp")}
        groups = {k: (names[k], DESC[k]) for k in KINDS}  # one tuple per group, shared
        thread_id = strings["thread_id"]
        strs: dict[str, str] = {}  # one object per distinct string: the pickler's memo shares it

        def s(x: str) -> str:
            return strs.setdefault(x, x)

        frames = {(k, op): [(s(n), s(f), ln) for n, f, ln in _frames(k, op)] for k, op in set(STEP)}
        status = {
            str(PG_ID[k]): {
                "last_enqueued_collective": last_seq(k, pos.enqueued),
                "last_started_collective": last_seq(
                    k, pos.started if pos.started is not None else pos.completed
                ),
                "last_completed_collective": last_seq(k, pos.completed),
            }
            for k in KINDS
        }
        out: list[dict[str, Any]] = []
        last = pos.enqueued
        for idx in range(max(0, last - self.entries + 1), last + 1):
            kind, op = op_at(idx)
            seq = last_seq(kind, idx)
            created = int(self.clock.time_of(idx) * 1e9) + (idx * 7919) % 2_000_000
            ins, outs, dtype = self.sizes[(kind, op)]
            e: dict[str, Any] = {
                "frames": [
                    {"name": n, "filename": f, "line": ln} for n, f, ln in frames[(kind, op)]
                ],
                "record_id": idx,
                "pg_id": PG_ID[kind],
                "process_group": groups[kind],
                "collective_seq_id": seq,
                "p2p_seq_id": 0,
                "op_id": seq,
                "profiling_name": s("nccl:" + op),
                "time_created_ns": created,
                "input_sizes": [list(x) for x in ins],
                "input_dtypes": [s(dtype)],
                "output_sizes": [list(x) for x in outs],
                "output_dtypes": [s(dtype)],
            }
            if idx <= pos.completed:
                started = created + 20_000 + (idx * 104_729) % 380_000
                dur_ms = 0.2 + (idx % 97) * 0.09
                e |= {
                    "state": "completed",
                    "time_discovered_started_ns": started,
                    "time_discovered_completed_ns": started + int(dur_ms * 1e6),
                    "retired": True,
                    "duration_ms": dur_ms,
                }
            elif idx == pos.started:
                e |= {
                    "state": "started",
                    "time_discovered_started_ns": created + 20_000,
                    "time_discovered_completed_ns": None,
                    "retired": False,
                }
            else:
                e |= {
                    "state": "scheduled",
                    "time_discovered_started_ns": None,
                    "time_discovered_completed_ns": None,
                    "retired": False,
                }
            e |= {
                "timeout_ms": 600_000,
                "is_p2p": False,
                "thread_name": s("pt_main_thread"),
                "thread_id": thread_id,
            }
            out.append(e)
        pg_config = {
            names[k]: {
                "name": names[k],
                "desc": DESC[k],
                "ranks": strings[f"ranks:{k}"] if k != "default" else _world_str(self.topo.ranks),
            }
            for k in KINDS
        }
        return {
            "version": FR_VERSION,
            "pg_config": pg_config,
            "comm_lib_version": NCCL_VERSION,
            "pg_status": status,
            "entries": out,
        }

    def _build(self, pos: RankPos) -> _Template:
        strings = {slot: _sentinel(slot) for slot in _SLOTS}
        d = self.dump_dict(pos, strings)
        if self.tail_context:
            d = frtail.tail_dump(d, context=self.tail_context, max_members=frtail.AGENT_MAX_MEMBERS)
        blob = pickle.dumps(d, protocol=2)
        marks = sorted(
            (i, slot) for slot in _SLOTS for i in _find_all(blob, _pickled_str(strings[slot]))
        )
        # A tail drops big groups' member lists; a full dump has every slot.
        if not self.tail_context and {slot for _, slot in marks} != set(_SLOTS):
            raise AssertionError("a per-rank string is missing from the dump template")
        segments, slots, at = [], [], 0
        for i, slot in marks:
            segments.append(blob[at:i])
            slots.append(slot)
            at = i + len(_pickled_str(strings[slot]))
        segments.append(blob[at:])
        return _Template(tuple(segments), tuple(slots))


@lru_cache(maxsize=8)
def _world_str(n: int) -> str:
    return str(list(range(n)))


def _find_all(blob: bytes, pat: bytes) -> Iterable[int]:
    i = blob.find(pat)
    while i >= 0:
        yield i
        i = blob.find(pat, i + len(pat))


def stacks_text(rank: int, pos: RankPos, pid: int) -> str:
    """py-spy-style stacks: a blocked rank waits in its collective, the lagging one computes."""
    if pos.started is None:
        top = [
            ("_bias_dropout_add", "/workspace/megatron/core/fusions/fused_bias_dropout.py", 44),
            ("forward", "/workspace/megatron/core/transformer/transformer_layer.py", 712),
            (
                "_call_impl",
                "/usr/local/lib/python3.11/site-packages/torch/nn/modules/module.py",
                1790,
            ),
        ]
    else:
        kind, op = op_at(pos.started)
        top = [(n, f, ln) for n, f, ln in _frames(kind, op)[: -len(_TRAIN)]]
        top.insert(0, ("wait", _C10D, 2811))
    lines = [f"Process {pid}: python pretrain_gpt.py", f'Thread {pid} (active): "MainThread"']
    lines += [f"    {n} ({f}:{ln})" for n, f, ln in [*top, *_TRAIN]]
    lines.append(f'Thread {pid + 7} (idle): "pt_autograd_0"')
    lines.append("    wait (threading.py:327)")
    return "\n".join(lines) + "\n"


# ---- one simulated agent ---------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class FleetSpec:
    """What a fleet process needs to know; plain data, so it crosses `spawn`."""

    target: str
    job_id: str
    ranks: int
    pp: int = 4
    entries: int = 2000
    epoch: float
    op_s: float = 0.05
    report_interval_s: float = 1.0
    token: str | None = None
    stacks: bool = True
    entries_after_s: float = 2.0  # in flight this long: send the FR entry delta
    nodes: tuple[int, ...] = ()  # node indices this process simulates (empty: all)
    # Hash the full dumps ahead while the stall timeout runs. Off when the
    # coordinator will ask for tails: then it is CPU the fan-out needs.
    prehash_full: bool = True
    compress: bool = True  # gzip phase-one streams, as the real agent does
    # The fleet stands for hundreds of other machines. On a small benchmark
    # box a positive nice keeps it from taking the coordinator's core.
    nice: int = 0


@dataclass
class DumpRecord:
    incident_id: str
    command_at: float  # time.time() the DUMP command arrived
    done_at: float | None = None  # CompleteDump acknowledged
    ranks_dumped: int = 0
    files: int = 0
    bytes: int = 0
    accepted: bool | None = None
    error: str = ""
    tail_context: int = 0


@dataclass
class AgentStats:
    registered: int = 0
    register_retries: int = 0
    reports_sent: int = 0
    rank_reports_sent: int = 0
    reports_failed: int = 0
    reports_unknown: int = 0
    entry_batches: int = 0
    dumps: list[DumpRecord] = field(default_factory=list)
    full_uploads: list[int] = field(default_factory=list)  # ranks sent on UPLOAD_FULL
    errors: list[str] = field(default_factory=list)

    def error(self, text: str) -> None:
        if len(self.errors) < 50:
            self.errors.append(text)


_TRANSIENT: Final = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
)


class SimAgent:
    """One node: 8 ranks, one channel, the real protocol."""

    def __init__(self, fleet: FleetState, node: int) -> None:
        self.fleet = fleet
        self.spec = fleet.spec
        self.node = node
        self.agent_id = f"sim-node-{node:05d}"
        self.host = f"sim-host-{node:05d}"
        self.ranks = list(range(node * RANKS_PER_AGENT, (node + 1) * RANKS_PER_AGENT))
        self.pids = {r: 10_000 + r for r in self.ranks}
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {self.spec.token}"),) if self.spec.token else ()
        )
        self.channel = grpc.aio.insecure_channel(
            self.spec.target,
            options=[
                ("grpc.max_send_message_length", 8 * 1024 * 1024),
                ("grpc.max_receive_message_length", 8 * 1024 * 1024),
                # Each agent is its own node: its own TCP connection, not one
                # shared subchannel for the whole process.
                ("grpc.use_local_subchannel_pool", 1),
                ("grpc.keepalive_time_ms", 20_000),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.enable_retries", 0),
            ],
        )
        self.stub = rpc.CoordinatorStub(self.channel)
        self.session_id = ""
        self.report_seq = 0
        self.stats = AgentStats()
        self.sent_entries: dict[int, int] = {}  # rank -> last record_id sent
        self._handled: set[tuple[str, int]] = set()
        self.delta = DeltaReporter()

    def register_request(self) -> pb.RegisterRequest:
        topo = self.fleet.topo
        return pb.RegisterRequest(
            job_id=self.spec.job_id,
            agent_id=self.agent_id,
            host=self.host,
            agent_version="sim",
            ranks=[
                pb.RankInfo(
                    rank=r,
                    local_rank=r % RANKS_PER_AGENT,
                    world_size=topo.ranks,
                    pid=self.pids[r],
                    backend="nccl",
                    torch_version=TORCH_VERSION,
                    fr_source="worker-server",
                    groups=[
                        pb.GroupInfo(
                            name=topo.group_name(k, r),
                            desc=DESC[k],
                            pg_id=PG_ID[k],
                            ranks=topo.group_members(k, r),
                        )
                        for k in KINDS
                    ],
                )
                for r in self.ranks
            ],
        )

    async def register(self, attempts: int = 5) -> None:
        """Register, retrying transient failures with backoff as the real agent does."""
        for attempt in range(attempts):
            try:
                resp = await self.stub.Register(
                    self.register_request(), timeout=UNARY_TIMEOUT_S, metadata=self.metadata
                )
                break
            except grpc.aio.AioRpcError as e:
                if e.code() not in _TRANSIENT or attempt == attempts - 1:
                    raise
                self.stats.register_retries += 1
                self.stats.error(f"Register: {e.code().name}: {e.details()} (retrying)")
                await asyncio.sleep(0.2 * 2**attempt)
        self.session_id = resp.session_id
        self.stats.registered += 1
        self.delta.reset(resp.heartbeat_s)

    def progress_report(self, now: float) -> pb.ProgressReport:
        clock, hang = self.fleet.clock, self.fleet.hang
        idx = clock.index(now)
        self.report_seq += 1
        ranks = []
        for r in self.ranks:
            pos = rank_pos(r, idx, hang)
            groups = []
            for k in KINDS:
                comp, enq = last_seq(k, pos.completed), last_seq(k, pos.enqueued)
                started = last_seq(k, pos.started) if pos.started is not None else comp
                comp_idx = index_of(k, comp) if comp > 0 else -1
                gp = pb.GroupProgress(
                    group=self.fleet.names[k][r],
                    last_enqueued=enq,
                    last_completed=comp,
                    last_started=started,
                    completed_unchanged_s=max(0.0, now - clock.time_of(comp_idx + 1)),
                )
                if enq > comp:
                    in_idx = index_of(k, comp + 1)
                    gp.oldest_in_flight.CopyFrom(
                        pb.InFlight(
                            seq=comp + 1,
                            op=op_at(in_idx)[1],
                            age_s=max(0.0, now - clock.time_of(in_idx)),
                        )
                    )
                groups.append(gp)
            ranks.append(
                pb.RankProgress(rank=r, state=pb.PROCESS_STATE_RUNNING, groups=groups, fr_age_s=0.0)
            )
        return pb.ProgressReport(
            job_id=self.spec.job_id,
            agent_id=self.agent_id,
            session_id=self.session_id,
            report_seq=self.report_seq,
            ranks=ranks,
        )

    async def progress_loop(self, phase: float) -> None:
        await asyncio.sleep(phase)
        interval = self.spec.report_interval_s
        next_at = time.monotonic()
        while True:
            now = time.time()
            try:
                report = self.progress_report(now)
                # Changed ranks only, all of them every few seconds: as the real agent.
                pick = self.delta.select(report.ranks, time.monotonic())
                if pick is not None:
                    del report.ranks[:]
                    report.ranks.extend(pick[0])
                    ack = await self.stub.ReportProgress(
                        report, timeout=UNARY_TIMEOUT_S, metadata=self.metadata
                    )
                    self.stats.reports_sent += 1
                    self.stats.rank_reports_sent += len(pick[0])
                    if ack.known:
                        self.delta.commit(pick[0], pick[1], time.monotonic())
                    else:
                        self.stats.reports_unknown += 1
                        await self.register()
                await self._maybe_entries(now)
            except grpc.aio.AioRpcError as e:
                self.stats.reports_failed += 1
                self.stats.error(f"ReportProgress: {e.code().name}: {e.details()}")
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def _maybe_entries(self, now: float) -> None:
        """Like the real agent: once something has been in flight too long, send
        the FR entries not sent before (the newest few per rank)."""
        hang = self.fleet.hang
        if hang is None:
            return
        idx = self.fleet.clock.index(now)
        entries = []
        for r in self.ranks:
            pos = rank_pos(r, idx, hang)
            oldest = pos.started if pos.started is not None else pos.completed + 1
            if now - self.fleet.clock.time_of(oldest) < self.spec.entries_after_s:
                continue
            first = max(self.sent_entries.get(r, -1) + 1, pos.enqueued - 15)
            for i in range(first, pos.enqueued + 1):
                kind, op = op_at(i)
                state = (
                    "completed"
                    if i <= pos.completed
                    else "started"
                    if i == pos.started
                    else "scheduled"
                )
                ins, _, dtype = self.fleet.dumps.sizes[(kind, op)]
                entries.append(
                    pb.FrEntry(
                        rank=r,
                        record_id=i,
                        group=self.fleet.names[kind][r],
                        collective_seq=last_seq(kind, i),
                        profiling_name="nccl:" + op,
                        state=state,
                        retired=i <= pos.completed,
                        age_s=max(0.0, now - self.fleet.clock.time_of(i)),
                        input_sizes_json=json.dumps(ins),
                        input_dtypes_json=json.dumps([dtype]),
                    )
                )
            self.sent_entries[r] = max(self.sent_entries.get(r, -1), pos.enqueued)
        if not entries:
            return
        ack = await self.stub.ReportEntries(
            pb.EntryBatch(
                job_id=self.spec.job_id,
                agent_id=self.agent_id,
                session_id=self.session_id,
                entries=entries,
            ),
            timeout=UNARY_TIMEOUT_S,
            metadata=self.metadata,
        )
        self.stats.entry_batches += 1
        if not ack.known:
            await self.register()

    async def watch_loop(self) -> None:
        while True:
            call = self.stub.WatchCommands(
                pb.WatchRequest(
                    job_id=self.spec.job_id, agent_id=self.agent_id, session_id=self.session_id
                ),
                metadata=self.metadata,
            )
            try:
                async for cmd in call:
                    key = (cmd.incident_id, cmd.kind)
                    if key in self._handled:
                        continue
                    self._handled.add(key)
                    if cmd.kind == pb.COMMAND_KIND_DUMP:
                        self.fleet.spawn(self.dump(cmd.incident_id, time.time(), cmd.tail_context))
                    elif cmd.kind == pb.COMMAND_KIND_UPLOAD_FULL:
                        self.fleet.spawn(self.upload_full(cmd.incident_id, list(cmd.ranks)))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED:
                    raise
                self.stats.error(f"WatchCommands: {e.code().name}: {e.details()}")
            await asyncio.sleep(0.2)  # the stream ended (re-register or restart): reopen

    def bundle_files(self, rank: int, pos: RankPos) -> list[tuple[str, bytes, str]]:
        """(name, bytes, sha256 hex) of one rank's bundle."""
        fr = self.fleet.dump_with_digest(rank, pos)
        files = [(f"{formats.FR_FILE_PREFIX}{rank}", *fr)]
        files.append((formats.META_FILE, *self.fleet.meta_with_digest(rank)))
        if self.spec.stacks:
            st = stacks_text(rank, pos, self.pids[rank]).encode()
            files.append((formats.STACKS_FILE, st, hashlib.sha256(st).hexdigest()))
        return files

    def tail_files(self, rank: int, pos: RankPos, context: int) -> list[tuple[str, bytes, str]]:
        """(name, bytes, sha256 hex) of one rank's phase-one files."""
        return self.fleet.phase_one_files(rank, pos, context, self.pids[rank])

    async def _upload_tails(
        self, rec: DumpRecord, incident_id: str, idx: int, context: int
    ) -> tuple[list[int], list[pb.RankFailure]]:
        files: list[tuple[int, str, bytes, str]] = []
        for r in self.ranks:
            pos = rank_pos(r, idx, self.fleet.hang)
            files.extend((r, *f) for f in self.tail_files(r, pos, context))

        async def chunks() -> AsyncIterator[pb.BundleChunks]:
            # Packed by the real agent's own packer.
            every = (
                c
                for r, name, data, digest in files
                for c in _chunk_list(self, incident_id, r, name, data, digest)
            )
            for msg in pack_chunks(every, CHUNK_BYTES):
                yield msg

        try:
            ack = await self.stub.UploadFiles(
                chunks(),
                timeout=UPLOAD_TIMEOUT_S,
                metadata=self.metadata,
                compression=grpc.Compression.Gzip if self.spec.compress else None,
            )
        except grpc.aio.AioRpcError as e:
            why = f"upload failed: {e.code().name}: {e.details()}"
            self.stats.error(f"UploadFiles: {why}")
            return [], [pb.RankFailure(rank=r, reason=why) for r in self.ranks]
        if len(ack.files) != len(files) or not all(a.complete for a in ack.files):
            why = f"coordinator acked {len(ack.files)} of {len(files)} files"
            self.stats.error(why)
            return [], [pb.RankFailure(rank=r, reason=why) for r in self.ranks]
        rec.files += len(files)
        rec.bytes += sum(len(f[2]) for f in files)
        return list(self.ranks), []

    async def upload_full(self, incident_id: str, ranks: list[int]) -> None:
        """Phase two: full dumps of the ranks asked for, as the real agent does."""
        idx = self.fleet.clock.index(time.time())
        for r in ranks:
            if r not in self.ranks:
                continue
            data, digest = self.fleet.dump_with_digest(r, rank_pos(r, idx, self.fleet.hang))
            try:
                await self.stub.UploadBundle(
                    _chunks(self, incident_id, r, f"{formats.FR_FILE_PREFIX}{r}", data, digest),
                    timeout=UPLOAD_TIMEOUT_S,
                    metadata=self.metadata,
                )
                self.stats.full_uploads.append(r)
            except grpc.aio.AioRpcError as e:
                self.stats.error(f"UploadBundle (full) rank {r}: {e.code().name}: {e.details()}")

    async def dump(self, incident_id: str, command_at: float, tail_context: int = 0) -> None:
        rec = DumpRecord(incident_id=incident_id, command_at=command_at, tail_context=tail_context)
        self.stats.dumps.append(rec)
        idx = self.fleet.clock.index(time.time())
        dumped: list[int] = []
        failures: list[pb.RankFailure] = []
        try:
            if tail_context:
                dumped, failures = await self._upload_tails(rec, incident_id, idx, tail_context)
            for r in self.ranks if not tail_context else ():
                pos = rank_pos(r, idx, self.fleet.hang)
                try:
                    # Serial, as the real agent uploads: one file stream at a time.
                    for name, data, digest in self.bundle_files(r, pos):
                        ack = await self.stub.UploadBundle(
                            _chunks(self, incident_id, r, name, data, digest),
                            timeout=UPLOAD_TIMEOUT_S,
                            metadata=self.metadata,
                        )
                        if not ack.complete:
                            raise RuntimeError(
                                f"{name}: stored {ack.bytes_stored} bytes, not complete"
                            )
                        rec.files += 1
                        rec.bytes += len(data)
                    dumped.append(r)
                except (grpc.aio.AioRpcError, RuntimeError) as e:
                    why = (
                        f"{e.code().name}: {e.details()}"
                        if isinstance(e, grpc.aio.AioRpcError)
                        else str(e)
                    )
                    failures.append(pb.RankFailure(rank=r, reason=f"upload failed: {why}"))
                    self.stats.error(f"UploadBundle rank {r}: {why}")
            res = await self.stub.CompleteDump(
                pb.DumpResult(
                    job_id=self.spec.job_id,
                    agent_id=self.agent_id,
                    incident_id=incident_id,
                    ranks_dumped=dumped,
                    failures=failures,
                ),
                timeout=UNARY_TIMEOUT_S,
                metadata=self.metadata,
            )
            rec.accepted = res.accepted
        except grpc.aio.AioRpcError as e:
            rec.error = f"CompleteDump: {e.code().name}: {e.details()}"
            self.stats.error(rec.error)
        rec.ranks_dumped = len(dumped)
        rec.done_at = time.time()


async def _chunks(
    agent: SimAgent, incident_id: str, rank: int, name: str, data: bytes, digest: str
) -> AsyncIterator[pb.BundleChunk]:
    for c in _chunk_list(agent, incident_id, rank, name, data, digest):
        yield c


def _chunk_list(
    agent: SimAgent, incident_id: str, rank: int, name: str, data: bytes, digest: str
) -> Iterable[pb.BundleChunk]:
    total = len(data)
    offset = 0
    while True:
        piece = data[offset : offset + CHUNK_BYTES]
        last = offset + len(piece) >= total
        chunk = pb.BundleChunk(
            job_id=agent.spec.job_id,
            agent_id=agent.agent_id,
            incident_id=incident_id,
            rank=rank,
            file_name=name,
            offset=offset,
            data=piece,
            last=last,
        )
        if offset == 0:
            chunk.total_size = total
        if last:
            chunk.sha256 = digest
        yield chunk
        offset += len(piece)
        if last:
            return


# ---- a fleet of agents in one process -----------------------------------------------------


class FleetState:
    """Agents of one process, the job's clock and the hang, once there is one."""

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self.topo = Topology(ranks=spec.ranks, pp=spec.pp)
        self.clock = Clock(epoch=spec.epoch, op_s=spec.op_s)
        self.dumps = DumpFactory(self.topo, self.clock, entries=spec.entries)
        self._tails: dict[int, DumpFactory] = {}  # context -> factory
        self.hang: Hang | None = None
        nodes = spec.nodes or tuple(range(self.topo.nodes))
        self.names = {
            k: {r: self.topo.group_name(k, r) for n in nodes for r in _node_ranks(n)} for k in KINDS
        }
        self.agents = [SimAgent(self, n) for n in nodes]
        self.tasks: set[asyncio.Task[None]] = set()
        self._digests: dict[tuple[int, RankPos], str] = {}
        self._metas: dict[int, tuple[bytes, str]] = {}
        self._phase_one: dict[tuple[int, RankPos, int], list[tuple[str, bytes, str]]] = {}
        self._hasher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sim-sha")

    def spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.agents[0].stats.error(f"task failed: {type(exc).__name__}: {exc}")

    def dump_with_digest(self, rank: int, pos: RankPos) -> tuple[bytes, str]:
        data = self.dumps.dump_bytes(rank, pos)
        digest = self._digests.pop((rank, pos), None)
        return data, digest or hashlib.sha256(data).hexdigest()

    def tail_factory(self, context: int) -> DumpFactory:
        f = self._tails.get(context)
        if f is None:
            f = self._tails[context] = DumpFactory(
                self.topo, self.clock, entries=self.spec.entries, tail_context=context
            )
        return f

    def tail_with_digest(self, rank: int, pos: RankPos, context: int) -> tuple[bytes, str]:
        data = self.tail_factory(context).dump_bytes(rank, pos)
        return data, hashlib.sha256(data).hexdigest()

    def meta_bytes(self, rank: int, *, stacks: str | None = None) -> bytes:
        """meta.json as the real agent writes it (compact, every group's members)."""
        topo = self.topo
        node = rank // RANKS_PER_AGENT
        meta = {
            "schema": formats.RANKMETA,
            "rank": rank,
            "host": f"sim-host-{node:05d}",
            "pid": 10_000 + rank,
            "process_state": "running",
            "reachable": True,
            "groups": [
                {
                    "name": topo.group_name(k, rank),
                    "desc": DESC[k],
                    "pg_id": PG_ID[k],
                    "ranks": formats.compact_ranks(topo.group_members(k, rank)),
                }
                for k in KINDS
            ],
            "sources": {
                "fr": "worker-server",
                "stacks": "py-spy",
                "gpu": "none",
                "process": "procfs",
            },
            "gpu": {"available": False, "reason": "simulated agent"},
            "errors": {},
        }
        if stacks is not None:
            meta["stacks"] = stacks
        return json.dumps(meta, separators=(",", ":")).encode()

    def meta_with_digest(self, rank: int) -> tuple[bytes, str]:
        got = self._metas.pop(rank, None)
        if got is not None:
            return got
        data = self.meta_bytes(rank)
        return data, hashlib.sha256(data).hexdigest()

    def stall(self, lagging: int, hang_index: int) -> None:
        self.hang = Hang(
            lagging=lagging, hang_index=hang_index, blocked=sweep(self.topo, lagging, hang_index)
        )
        # On real nodes each agent hashes its own 8 dumps in parallel with the
        # others; here the final (frozen) dumps are known now, so hash them and
        # build meta.json ahead, during the stall timeout, and keep the
        # fan-out's CPU for the wire.
        hang = self.hang
        mine = [r for a in self.agents for r in a.ranks]
        final = {r: rank_pos(r, 1 << 62, hang) for r in mine}
        self._hasher.submit(self._prehash, final)

    def phase_one_files(
        self, rank: int, pos: RankPos, context: int, pid: int
    ) -> list[tuple[str, bytes, str]]:
        got = self._phase_one.pop((rank, pos, context), None)
        if got is not None:
            return got
        fr = self.tail_with_digest(rank, pos, context)
        # Stacks ride inside meta.json, as the real agent sends them here.
        st = stacks_text(rank, pos, pid) if self.spec.stacks else None
        meta = self.meta_bytes(rank, stacks=st)
        return [
            (f"{formats.FR_TAIL_PREFIX}{rank}", *fr),
            (formats.META_FILE, meta, hashlib.sha256(meta).hexdigest()),
        ]

    def _prehash(self, final: dict[int, RankPos]) -> None:
        # What the DUMP will send, built while the stall timeout runs: real
        # agents build theirs on 512 machines at once, not on one event loop.
        for r, pos in final.items():
            if self.spec.prehash_full:
                data = self.dumps.dump_bytes(r, pos)
                self._digests[(r, pos)] = hashlib.sha256(data).hexdigest()
                meta = self.meta_bytes(r)
                self._metas[r] = (meta, hashlib.sha256(meta).hexdigest())
            else:
                key = (r, pos, frtail.DEFAULT_CONTEXT)
                self._phase_one[key] = self.phase_one_files(r, pos, key[2], 10_000 + r)

    def stats(self) -> dict[str, Any]:
        return merge_stats([asdict(a.stats) for a in self.agents])

    def close(self) -> None:
        self._hasher.shutdown(wait=False, cancel_futures=True)


def _node_ranks(node: int) -> range:
    return range(node * RANKS_PER_AGENT, (node + 1) * RANKS_PER_AGENT)


def merge_stats(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Fleet-wide numbers from per-agent AgentStats dicts."""
    dumps = [d for p in parts for d in p["dumps"]]
    done = [d["done_at"] for d in dumps if d["done_at"] is not None]
    cmds = [d["command_at"] for d in dumps]
    return {
        "agents": len(parts),
        "registered": sum(1 for p in parts if p["registered"]),
        "register_retries": sum(p["register_retries"] for p in parts),
        "reports_sent": sum(p["reports_sent"] for p in parts),
        "rank_reports_sent": sum(p["rank_reports_sent"] for p in parts),
        "reports_failed": sum(p["reports_failed"] for p in parts),
        "reports_unknown": sum(p["reports_unknown"] for p in parts),
        "entry_batches": sum(p["entry_batches"] for p in parts),
        "dump_commands": len(dumps),
        "incidents": sorted({d["incident_id"] for d in dumps}),
        "first_command_at": min(cmds, default=None),
        "last_command_at": max(cmds, default=None),
        "last_done_at": max(done, default=None),
        "dumps_done": len(done),
        "ranks_dumped": sum(d["ranks_dumped"] for d in dumps),
        "files_uploaded": sum(d["files"] for d in dumps),
        "bytes_uploaded": sum(d["bytes"] for d in dumps),
        "dumps_rejected": sum(1 for d in dumps if d["accepted"] is False),
        "tail_dumps": sum(1 for d in dumps if d["tail_context"]),
        "full_uploads": sorted(r for p in parts for r in p["full_uploads"]),
        "errors": [e for p in parts for e in p["errors"]][:50],
    }


async def _run_fleet(spec: FleetSpec, conn: multiprocessing.connection.Connection) -> None:
    fleet = FleetState(spec)
    loop = asyncio.get_running_loop()
    try:
        sem = asyncio.Semaphore(64)

        async def reg(a: SimAgent) -> None:
            async with sem:
                await a.register()

        await asyncio.gather(*(reg(a) for a in fleet.agents))
        n = len(fleet.agents)
        for i, a in enumerate(fleet.agents):
            # Real agents are not synchronized: spread reports over the interval.
            fleet.spawn(a.progress_loop(spec.report_interval_s * i / max(1, n)))
            fleet.spawn(a.watch_loop())
        conn.send({"op": "ready", "agents": n})
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg["op"] == "stall":
                fleet.stall(int(msg["rank"]), int(msg["hang_index"]))
                conn.send({"op": "ok"})
            elif msg["op"] == "stats":
                conn.send({"op": "stats", "stats": fleet.stats()})
            elif msg["op"] == "stop":
                break
    finally:
        for t in list(fleet.tasks):
            t.cancel()
        await asyncio.gather(*fleet.tasks, return_exceptions=True)
        await asyncio.gather(*(a.channel.close() for a in fleet.agents), return_exceptions=True)
        fleet.close()
    conn.send({"op": "stats", "stats": fleet.stats()})


def _fleet_main(spec: FleetSpec, conn: multiprocessing.connection.Connection) -> None:
    if spec.nice:
        os.nice(spec.nice)
    try:
        asyncio.run(_run_fleet(spec, conn))
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send({"op": "error", "traceback": traceback.format_exc()})
        raise


# ---- driving fleets from a test or benchmark -----------------------------------------------


class FleetError(RuntimeError):
    pass


class Fleet:
    """Simulated agents for a whole job, in `procs` child processes.

    with Fleet(target="127.0.0.1:PORT", job_id="j", ranks=512) as fleet:
        fleet.wait_ready()
        hang = fleet.stall(rank=77)
        ...
        stats = fleet.stats()
    """

    def __init__(
        self,
        *,
        target: str,
        job_id: str,
        ranks: int,
        pp: int = 4,
        entries: int = 2000,
        procs: int = 1,
        op_s: float = 0.05,
        report_interval_s: float = 1.0,
        token: str | None = None,
        stacks: bool = True,
        prehash_full: bool = True,
        compress: bool = True,
        nice: int = 0,
    ) -> None:
        self.topo = Topology(ranks=ranks, pp=pp)
        self.clock = Clock(epoch=time.time(), op_s=op_s)
        nodes = list(range(self.topo.nodes))
        procs = max(1, min(procs, len(nodes)))
        self.specs = [
            FleetSpec(
                target=target,
                job_id=job_id,
                ranks=ranks,
                pp=pp,
                entries=entries,
                epoch=self.clock.epoch,
                op_s=op_s,
                report_interval_s=report_interval_s,
                token=token,
                stacks=stacks,
                nodes=tuple(nodes[i::procs]),
                prehash_full=prehash_full,
                compress=compress,
                nice=nice,
            )
            for i in range(procs)
        ]
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self.hang: Hang | None = None
        self.final_stats: dict[str, Any] | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def start(self) -> Fleet:
        for spec in self.specs:
            parent, child = self._ctx.Pipe()
            p = self._ctx.Process(target=_fleet_main, args=(spec, child), daemon=True)
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        return self

    def _recv(self, i: int, timeout: float) -> dict[str, Any]:
        conn, proc = self._conns[i], self._procs[i]
        if not conn.poll(timeout):
            raise FleetError(
                f"fleet process {proc.pid} did not answer in {timeout:.0f}s (exit code {proc.exitcode})"
            )
        try:
            msg: dict[str, Any] = conn.recv()
        except EOFError as e:
            proc.join(5)
            raise FleetError(f"fleet process {proc.pid} exited with code {proc.exitcode}") from e
        if msg.get("op") == "error":
            raise FleetError(f"fleet process {proc.pid} failed:\n{msg['traceback']}")
        return msg

    def wait_ready(self, timeout: float = 60.0) -> int:
        """Block until every agent registered; returns the number of agents."""
        end = time.monotonic() + timeout
        return sum(
            int(self._recv(i, max(0.1, end - time.monotonic()))["agents"])
            for i in range(len(self._procs))
        )

    def stall(self, rank: int, margin_s: float = 0.5) -> Hang:
        """Make `rank` stop before the next TP collective at least `margin_s` ahead."""
        if not 0 <= rank < self.topo.ranks:
            raise ValueError(f"rank {rank} is not in [0, {self.topo.ranks})")
        h = self.clock.hang_index_after(time.time(), margin_s)
        for c in self._conns:
            c.send({"op": "stall", "rank": rank, "hang_index": h})
        for i in range(len(self._conns)):
            self._recv(i, 30.0)
        self.hang = Hang(lagging=rank, hang_index=h, blocked=sweep(self.topo, rank, h))
        return self.hang

    def stall_time(self) -> float:
        """time.time() at which the lagging rank failed to enter its collective."""
        if self.hang is None:
            raise FleetError("no stall yet")
        return self.clock.time_of(self.hang.hang_index)

    def stats(self, timeout: float = 30.0) -> dict[str, Any]:
        if self.final_stats is not None:
            return self.final_stats
        parts = []
        for i, c in enumerate(self._conns):
            c.send({"op": "stats"})
            parts.append(self._recv(i, timeout)["stats"])
        return _merge_fleet(parts)

    def stop(self, timeout: float = 30.0) -> dict[str, Any]:
        if self.final_stats is not None:
            return self.final_stats
        parts, problems = [], []
        for i, c in enumerate(self._conns):
            try:
                c.send({"op": "stop"})
                parts.append(self._recv(i, timeout)["stats"])
            except (FleetError, OSError) as e:
                problems.append(str(e))
        for p in self._procs:
            p.join(timeout)
            if p.exitcode is None:
                p.kill()
                p.join(5)
                problems.append(f"fleet process {p.pid} did not exit; killed")
            elif p.exitcode != 0:
                problems.append(f"fleet process {p.pid} exited with code {p.exitcode}")
        for c in self._conns:
            c.close()
        self.final_stats = _merge_fleet(parts)
        if problems:
            raise FleetError("; ".join(problems))
        return self.final_stats

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        except FleetError:
            if exc[0] is None:
                raise


def _merge_fleet(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in parts:
        for k, v in p.items():
            if k in ("first_command_at",):
                out[k] = v if out.get(k) is None else (min(out[k], v) if v is not None else out[k])
            elif k in ("last_command_at", "last_done_at"):
                out[k] = v if out.get(k) is None else (max(out[k], v) if v is not None else out[k])
            elif k in ("incidents", "full_uploads"):
                out[k] = sorted(set(out.get(k, [])) | set(v))
            elif k == "errors":
                out[k] = (out.get(k, []) + v)[:50]
            else:
                out[k] = out.get(k, 0) + v
    return out


# ---- ingest probe: progress reports as fast as the coordinator acks them ---------------------


@dataclass(frozen=True, kw_only=True)
class IngestSpec:
    target: str
    job_id: str
    ranks: int
    pp: int = 4
    seconds: float = 5.0
    in_flight: int = 128  # concurrent ReportProgress calls
    token: str | None = None


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


async def _ingest(spec: IngestSpec) -> dict[str, Any]:
    fspec = FleetSpec(
        target=spec.target,
        job_id=spec.job_id,
        ranks=spec.ranks,
        pp=spec.pp,
        epoch=time.time(),
        token=spec.token,
    )
    fleet = FleetState(fspec)
    sem = asyncio.Semaphore(64)

    async def reg(a: SimAgent) -> None:
        async with sem:
            await a.register()

    await asyncio.gather(*(reg(a) for a in fleet.agents))
    # Two serialized reports per agent, one step apart, so every report moves
    # last_completed (the coordinator's full update path); report_seq goes at
    # the end (field 4, varint): protobuf takes fields in any order.
    now = time.time()
    bases: list[tuple[bytes, bytes]] = []
    for a in fleet.agents:
        r0 = a.progress_report(now)
        r1 = a.progress_report(now + OPS_PER_STEP * fspec.op_s)
        r0.ClearField("report_seq")
        r1.ClearField("report_seq")
        bases.append((r0.SerializeToString(), r1.SerializeToString()))
    call = {
        a.agent_id: a.channel.unary_unary(
            "/hangwatch.v1.Coordinator/ReportProgress",
            request_serializer=None,
            response_deserializer=pb.ProgressAck.FromString,
        )
        for a in fleet.agents
    }
    acks = unknown = failed = 0
    deadline = time.monotonic() + spec.seconds
    agents = fleet.agents
    lanes = max(1, min(spec.in_flight, len(agents)))

    async def lane(i: int) -> None:
        nonlocal acks, unknown, failed
        mine = agents[i::lanes]
        seqs = [0] * len(mine)
        j = 0
        while time.monotonic() < deadline:
            k = j % len(mine)
            a = mine[k]
            seqs[k] += 1
            body = bases[a.node - agents[0].node][seqs[k] % 2] + b"\x20" + _varint(seqs[k])
            try:
                ack = await call[a.agent_id](body, timeout=UNARY_TIMEOUT_S, metadata=a.metadata)
                if ack.known:
                    acks += 1
                else:
                    unknown += 1
            except grpc.aio.AioRpcError:
                failed += 1
            j += 1

    t0, wall0 = time.monotonic(), time.time()
    await asyncio.gather(*(lane(i) for i in range(lanes)))
    elapsed = time.monotonic() - t0
    wall1 = time.time()
    await asyncio.gather(*(a.channel.close() for a in agents), return_exceptions=True)
    fleet.close()
    return {
        "agent_reports": acks,
        "rank_reports": acks * RANKS_PER_AGENT,
        "groups_per_rank": len(KINDS),
        "unknown": unknown,
        "failed": failed,
        "seconds": elapsed,
        "agent_reports_per_s": acks / elapsed,
        "rank_reports_per_s": acks * RANKS_PER_AGENT / elapsed,
        "in_flight": lanes,
        "report_bytes": len(bases[0][0]),
        "flood_start": wall0,
        "flood_end": wall1,
    }


def _ingest_main(spec: IngestSpec, conn: multiprocessing.connection.Connection) -> None:
    try:
        conn.send({"op": "result", "result": asyncio.run(_ingest(spec))})
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send({"op": "error", "traceback": traceback.format_exc()})
        raise


class IngestProbe:
    """Run the ingest probe in its own process; `wait()` returns its numbers."""

    def __init__(self, spec: IngestSpec) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_ingest_main, args=(spec, child), daemon=True)
        self._proc.start()
        child.close()
        self.spec = spec

    def wait(self, timeout: float) -> dict[str, Any]:
        if not self._conn.poll(timeout):
            self._proc.kill()
            self._proc.join(5)
            raise FleetError(f"ingest probe did not finish in {timeout:.0f}s")
        try:
            msg = self._conn.recv()
        except EOFError as e:
            self._proc.join(5)
            raise FleetError(f"ingest probe exited with code {self._proc.exitcode}") from e
        self._proc.join(10)
        if msg["op"] == "error":
            raise FleetError(f"ingest probe failed:\n{msg['traceback']}")
        if self._proc.exitcode not in (0, None):
            raise FleetError(f"ingest probe exited with code {self._proc.exitcode}")
        result: dict[str, Any] = msg["result"]
        return result


# ---- the coordinator under test, as its own process ------------------------------------------


CLK_TCK: Final = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_status_kb(pid: int, key: str) -> int:
    """A /proc/<pid>/status field in kB (VmRSS, VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


class CoordinatorProcess:
    """`python -m hangwatch server` on loopback ports 0, its log in `<data_dir>/coordinator.log`."""

    def __init__(
        self,
        data_dir: Path,
        *,
        stall_timeout: float,
        dump_deadline: float = 60.0,
        agent_lost_timeout: float = 30.0,
        extra_args: Sequence[str] = (),
        start_timeout: float = 60.0,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.log_path = self.data_dir / "coordinator.log"
        cmd = [
            sys.executable,
            "-m",
            "hangwatch",
            "server",
            "--host",
            "127.0.0.1",
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--data-dir",
            str(self.data_dir),
            "--stall-timeout",
            str(stall_timeout),
            "--dump-deadline",
            str(dump_deadline),
            "--agent-lost-timeout",
            str(agent_lost_timeout),
            *extra_args,
        ]
        # The caller's hangwatch settings (token, ports) must not leak in.
        env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.info = self._wait_info(start_timeout)
        self.pid = int(self.info["pid"])
        self.grpc: str = self.info["grpc"]
        self.http: str = self.info["http"]

    def _wait_info(self, timeout: float) -> dict[str, Any]:
        path = self.data_dir / "server.json"
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise FleetError(
                    f"coordinator exited with {self.proc.returncode}:\n{self.log()[-4000:]}"
                )
            if path.exists():
                with contextlib.suppress(json.JSONDecodeError):
                    info: dict[str, Any] = json.loads(path.read_text())
                    return info
            time.sleep(0.05)
        self.proc.kill()
        self.proc.wait(10)
        raise FleetError(
            f"coordinator wrote no server.json in {timeout:.0f}s:\n{self.log()[-4000:]}"
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def get(self, path: str, timeout: float = 30.0) -> Any:
        with urllib.request.urlopen(self.http + path, timeout=timeout) as r:
            return json.loads(r.read())

    def wait_incident(self, job_id: str, timeout: float) -> dict[str, Any]:
        """The job's first incident once it is no longer collecting (detail form),
        plus `incidents_for_job`: how many the job has."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise FleetError(
                    f"coordinator exited with {self.proc.returncode}:\n{self.log()[-4000:]}"
                )
            rows = self.get(f"/api/incidents?job={urllib.parse.quote(job_id)}")
            done = [r for r in rows if r["status"] != "collecting"]
            if done:
                detail: dict[str, Any] = self.get(f"/api/incidents/{done[0]['id']}")
                detail["incidents_for_job"] = len(rows)
                return detail
            time.sleep(0.1)
        raise TimeoutError(f"no analysed incident for job {job_id} within {timeout:.0f}s")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit code (killed after `timeout`: -9)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                return -9
        return self.proc.returncode

    def __enter__(self) -> CoordinatorProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = [
    "Clock",
    "CoordinatorProcess",
    "DumpFactory",
    "Fleet",
    "FleetError",
    "Hang",
    "IngestProbe",
    "IngestSpec",
    "RankPos",
    "Topology",
    "last_seq",
    "rank_pos",
    "sweep",
]

if __name__ == "__main__":  # pragma: no cover - not a CLI
    sys.exit("import tests.support.simagents; see benchmarks/coordinator_load.py")
