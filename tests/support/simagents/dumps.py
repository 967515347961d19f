"""Payload building: NCCL-shaped FR dumps pickled once per rank state as templates and
patched per rank, and py-spy-style stacks.txt."""

from __future__ import annotations

import pickle
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Final

from hangwatch import frtail
from tests.support.simagents.constants import DESC, FR_VERSION, KINDS, NCCL_VERSION, PG_ID, STEP
from tests.support.simagents.topology import Clock, RankPos, Topology, last_seq, op_at

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
