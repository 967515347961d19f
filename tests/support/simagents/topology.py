"""The simulated job: Megatron-style topology, its program of collectives, the clock,
and where a hang leaves every rank (one forward sweep of NCCL semantics)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tests.support.simagents.constants import (
    DESC,
    HANG_POS,
    KINDS,
    OPS_PER_STEP,
    PG_ID,
    RANKS_PER_AGENT,
    START_STEP,
    STEP,
)

G = TypeVar("G")

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

    def rank_groups(self, rank: int, make: Callable[..., G]) -> list[G]:
        """The groups `rank` is in, one `make(name=, desc=, pg_id=, ranks=)` each: the
        wire's GroupInfo for a registration, the file format's for a meta.json."""
        return [
            make(
                name=self.group_name(k, rank),
                desc=DESC[k],
                pg_id=PG_ID[k],
                ranks=self.group_members(k, rank),
            )
            for k in KINDS
        ]

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
