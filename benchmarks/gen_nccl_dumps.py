"""Generate synthetic NCCL-style flight-recorder dumps of a hung TP x DP job.

The dumps follow torch 2.13's NCCL recorder (FR format "2.10"): one pickle per
rank named `<prefix><rank>` (torch's default prefix is `nccl_trace_rank_`),
with `version`, `pg_config` (this rank's groups, keyed by group name, ranks as
a string), `comm_lib_version`, `pg_status` (keyed by the local pg_id) and
`entries` carrying every key torch writes, call-site `frames` included. Torch's
own `python -m torch.distributed.flight_recorder.fr_trace DIR` reads them.

The job: `--ranks` ranks, the default group "0", tensor-parallel groups of
`--tp` consecutive ranks and data-parallel groups of ranks `j, j+tp, ...`. Each
training step is a fixed program of collectives (TP all-gathers and
reduce-scatters in forward and backward, then a DP gradient reduce-scatter and
parameter all-gather, then a loss all-reduce over the default group), so
`record_id` means the same program position on every rank.

The hang: the lagging rank finishes op H-1 and never enters op H (a TP op).
Everything else follows from NCCL semantics, computed by one forward sweep:
a collective completes only if every member's stream reached it; a member
whose stream reaches an incomplete collective blocks there (`started`), and
its CPU has already enqueued the next `--queue-depth` ops (`scheduled`). The
wave spreads to other groups exactly as in a real job, so innocent ranks end
up blocked in other collectives, some of them missing from collectives their
peers have entered. Only the last `--entries` records of each rank are kept
(a ring buffer), so record ids start high and differ by rank.

Usage:
    python benchmarks/gen_nccl_dumps.py --ranks 128 --entries 2000 --out DIR

The ground truth goes to DIR/generator.json (no trailing digits, so neither
torch's loader nor hangwatch's takes it for a rank's dump) and to stdout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pickle
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

FR_VERSION = "2.10"  # what torch 2.13's recorder writes
NCCL_VERSION = "2.27.3"
DEFAULT_PREFIX = "nccl_trace_rank_"  # torch's default TORCH_NCCL_DEBUG_INFO_TEMP_FILE basename
TRUTH_FILE = "generator.json"

# Local pg_id of each group kind: the order in which every rank creates the
# process groups it belongs to (NCCL numbers only the groups a rank is in).
PG_ID = {"default": 0, "tp": 1, "dp": 2}
DESC = {
    "default": "default_pg",
    "tp": "TENSOR_MODEL_PARALLEL_GROUP",
    "dp": "DATA_PARALLEL_GROUP",
}

# One training step: (group kind, op). The hang op index must land on a TP op.
STEP: tuple[tuple[str, str], ...] = (
    ("tp", "_all_gather_base"),  # forward: sequence-parallel gather
    ("tp", "_reduce_scatter_base"),
    ("tp", "_all_gather_base"),
    ("tp", "_reduce_scatter_base"),
    ("tp", "_all_gather_base"),  # backward
    ("tp", "_reduce_scatter_base"),
    ("tp", "_all_gather_base"),
    ("tp", "_reduce_scatter_base"),
    ("dp", "_reduce_scatter_base"),  # distributed optimizer: grads
    ("dp", "_all_gather_base"),  # ... and params
    ("default", "all_reduce"),  # loss / grad-norm
)
OPS_PER_STEP = len(STEP)
HANG_OP_IN_STEP = 2  # the lagging rank never enters this op of its step
STEP_NS = 850_000_000
SEQ_TOKENS = 4096
HIDDEN = 5120
DP_BUCKET = 40_000_000

# Frames as torch records them for a call site: innermost first. The shared
# tails are the user's code; the heads differ by op.
_TRAIN = [
    {"name": "train_step", "filename": "/workspace/megatron/training/training.py", "line": 1289},
    {"name": "train", "filename": "/workspace/megatron/training/training.py", "line": 2065},
    {"name": "pretrain", "filename": "/workspace/megatron/training/training.py", "line": 842},
    {"name": "<module>", "filename": "/workspace/pretrain_gpt.py", "line": 312},
]
_C10D = "/usr/local/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
_LOGGER = "/usr/local/lib/python3.11/site-packages/torch/distributed/c10d_logger.py"
_MAPPINGS = "/workspace/megatron/core/tensor_parallel/mappings.py"
_DDP = "/workspace/megatron/core/distributed/param_and_grad_buffer.py"
_HEADS: dict[str, list[dict[str, Any]]] = {
    "_all_gather_base": [
        {"name": "all_gather_into_tensor", "filename": _C10D, "line": 4021},
        {"name": "wrapper", "filename": _LOGGER, "line": 83},
        {"name": "_gather_along_first_dim", "filename": _MAPPINGS, "line": 120},
    ],
    "_reduce_scatter_base": [
        {"name": "reduce_scatter_tensor", "filename": _C10D, "line": 4512},
        {"name": "wrapper", "filename": _LOGGER, "line": 83},
        {"name": "_reduce_scatter_along_first_dim", "filename": _MAPPINGS, "line": 164},
    ],
    "all_reduce": [
        {"name": "all_reduce", "filename": _C10D, "line": 3245},
        {"name": "wrapper", "filename": _LOGGER, "line": 83},
        {"name": "reduce_loss", "filename": "/workspace/megatron/training/utils.py", "line": 211},
    ],
}
_DP_HEAD = {"name": "start_grad_sync", "filename": _DDP, "line": 402}


@dataclass(frozen=True, kw_only=True)
class Job:
    ranks: int
    tp: int
    entries: int
    lagging: int
    hang_index: int  # program position the lagging rank never enters
    queue_depth: int
    seed: int
    prefix: str
    fmt: str
    t0_ns: int


@dataclass(frozen=True, kw_only=True)
class Truth:
    """What an analyzer should conclude, and what the sweep decided."""

    lagging_rank: int
    hang_group: str
    hang_group_desc: str
    hang_seq: int
    hang_op: str
    blocked_at: dict[str, int]  # rank -> program index it blocks on
    ranks: int
    tp: int
    entries: int
    seed: int
    prefix: str
    format: str


def group_name(job: Job, kind: str, rank: int) -> str:
    """Group names follow torch's creation counter: default "0", then every TP
    group, then every DP group (all ranks call new_group for every group)."""
    dp = job.ranks // job.tp
    if kind == "default":
        return "0"
    if kind == "tp":
        return str(1 + rank // job.tp)
    return str(1 + dp + rank % job.tp)


def group_ranks(job: Job, kind: str, rank: int) -> list[int]:
    if kind == "default":
        return list(range(job.ranks))
    if kind == "tp":
        base = rank - rank % job.tp
        return list(range(base, base + job.tp))
    return list(range(rank % job.tp, job.ranks, job.tp))


def sweep(job: Job) -> dict[int, int]:
    """Program index each rank blocks at (its stream's first incomplete op).

    Ops before the hang index completed everywhere. From there, in program
    order, a group's op completes iff every member's stream reached it;
    otherwise the members that reached it block there for good.
    """
    blocked: dict[int, int] = {}
    i = job.hang_index
    while len(blocked) < job.ranks:
        if i > job.hang_index + 3 * OPS_PER_STEP:
            raise AssertionError("hang did not spread to every rank; check the program")
        kind = STEP[i % OPS_PER_STEP][0]
        seen: set[str] = set()
        for r in range(job.ranks):
            name = group_name(job, kind, r)
            if name in seen:
                continue
            seen.add(name)
            members = group_ranks(job, kind, r)
            arrived = [
                m
                for m in members
                if m not in blocked and not (m == job.lagging and i >= job.hang_index)
            ]
            if len(arrived) < len(members):
                for m in arrived:
                    blocked[m] = i
        if job.lagging not in blocked and i >= job.hang_index:
            # The lagging rank's last record is op H-1; it "blocks" before H.
            blocked[job.lagging] = job.hang_index
        i += 1
    return blocked


def seq_of(kind: str, index: int) -> int:
    """1-based collective_seq_id, within its group, of the op at `index`."""
    step, pos = divmod(index, OPS_PER_STEP)
    per_step = sum(1 for k, _ in STEP if k == kind)
    before = sum(1 for k, _ in STEP[: pos + 1] if k == kind)
    return step * per_step + before


def sizes(job: Job, kind: str, op: str) -> tuple[list[list[int]], list[list[int]], str]:
    n = job.tp if kind == "tp" else job.ranks // job.tp if kind == "dp" else job.ranks
    if kind == "default":
        return [[1]], [[1]], "Float"
    if kind == "tp":
        shard = [SEQ_TOKENS // n, 1, HIDDEN]
        full = [SEQ_TOKENS // n * n, 1, HIDDEN]
        if op == "_all_gather_base":
            return [shard], [full], "BFloat16"
        return [full], [shard], "BFloat16"
    shard_len = DP_BUCKET // n
    if op == "_all_gather_base":
        return [[shard_len]], [[shard_len * n]], "BFloat16"
    return [[shard_len * n]], [[shard_len]], "Float"


def frames_for(kind: str, op: str) -> list[dict[str, Any]]:
    head = _HEADS[op]
    mid = [_DP_HEAD] if kind == "dp" else []
    # Fresh dicts each time: torch's pickler shares strings, not frame dicts.
    return [dict(f) for f in (*head, *mid, *_TRAIN)]


def build_dump(job: Job, rank: int, blocked_at: int) -> dict[str, Any]:
    """One rank's FR dump: the last `job.entries` records of its program."""
    rng = random.Random(job.seed * 1_000_003 + rank)
    # The lagging rank completed H-1 and never entered H; a blocked rank's CPU
    # ran `queue_depth` ops past the one its stream is stuck in.
    last = blocked_at - 1 if rank == job.lagging else blocked_at + job.queue_depth
    first = max(0, last + 1 - job.entries)
    thread_id = str(139_800_000_000_000 + rank * 4096)
    pg_for = {kind: (group_name(job, kind, rank), DESC[kind]) for kind in PG_ID}
    sizes_for = {(k, op): sizes(job, k, op) for k, op in STEP}
    status = {
        str(pg): {
            "last_enqueued_collective": -1,
            "last_started_collective": -1,
            "last_completed_collective": -1,
        }
        for pg in PG_ID.values()
    }
    entries: list[dict[str, Any]] = []
    for idx in range(first, last + 1):
        kind, op = STEP[idx % OPS_PER_STEP]
        step = idx // OPS_PER_STEP
        seq = seq_of(kind, idx)
        created = (
            job.t0_ns
            + step * STEP_NS
            + (idx % OPS_PER_STEP) * (STEP_NS // OPS_PER_STEP)
            + rng.randrange(0, 2_000_000)
        )
        ins, outs, dtype = sizes_for[(kind, op)]
        entry: dict[str, Any] = {
            "frames": frames_for(kind, op),
            "record_id": idx,
            "pg_id": PG_ID[kind],
            "process_group": pg_for[kind],
            "thread_name": "pt_main_thread",
            "thread_id": thread_id,
            "collective_seq_id": seq,
            "p2p_seq_id": 0,
            "op_id": seq,
            "profiling_name": "nccl:" + op,
            "time_created_ns": created,
            "input_sizes": [list(s) for s in ins],
            "input_dtypes": [dtype],
            "output_sizes": [list(s) for s in outs],
            "output_dtypes": [dtype],
        }
        st = status[str(PG_ID[kind])]
        st["last_enqueued_collective"] = seq
        if idx < blocked_at:
            started = created + rng.randrange(20_000, 400_000)
            dur_ms = rng.uniform(0.2, 9.0)
            entry["state"] = "completed"
            entry["time_discovered_started_ns"] = started
            entry["time_discovered_completed_ns"] = started + int(dur_ms * 1e6)
            entry["retired"] = True
            entry["duration_ms"] = dur_ms
            st["last_started_collective"] = seq
            st["last_completed_collective"] = seq
        elif idx == blocked_at:
            entry["state"] = "started"
            entry["time_discovered_started_ns"] = created + rng.randrange(20_000, 400_000)
            entry["time_discovered_completed_ns"] = None
            entry["retired"] = False
            st["last_started_collective"] = seq
        else:
            entry["state"] = "scheduled"
            entry["time_discovered_started_ns"] = None
            entry["time_discovered_completed_ns"] = None
            entry["retired"] = False
        entry["timeout_ms"] = 600_000
        entry["is_p2p"] = False
        entries.append(entry)

    pg_config = {
        group_name(job, kind, rank): {
            "name": group_name(job, kind, rank),
            "desc": DESC[kind],
            "ranks": str(group_ranks(job, kind, rank)),
        }
        for kind in PG_ID
    }
    return {
        "version": FR_VERSION,
        "pg_config": pg_config,
        "comm_lib_version": NCCL_VERSION,
        "pg_status": status,
        "entries": entries,
    }


def to_json_form(dump: dict[str, Any]) -> bytes:
    """The shape `_dump_fr_trace_json` gives: pg_status values as strings,
    missing timestamps as 0, no frames."""
    out = dict(dump)
    out["pg_status"] = {
        pg: {k: str(v) for k, v in st.items()} for pg, st in dump["pg_status"].items()
    }
    entries = []
    for e in dump["entries"]:
        e = {k: v for k, v in e.items() if k != "frames"}
        e["process_group"] = list(e["process_group"])
        for k in ("time_discovered_started_ns", "time_discovered_completed_ns"):
            if e[k] is None:
                e[k] = 0
        entries.append(e)
    out["entries"] = entries
    return json.dumps(out).encode()


_JOB: Job | None = None
_BLOCKED: dict[int, int] = {}
_OUT = ""


def _init_worker(job: Job, blocked: dict[int, int], out: str) -> None:
    global _JOB, _BLOCKED, _OUT
    _JOB, _BLOCKED, _OUT = job, blocked, out


def _write_rank(rank: int) -> int:
    assert _JOB is not None
    dump = build_dump(_JOB, rank, _BLOCKED[rank])
    # Protocol 2, as torch's C++ pickler writes.
    data = pickle.dumps(dump, protocol=2) if _JOB.fmt == "pickle" else to_json_form(dump)
    path = os.path.join(_OUT, f"{_JOB.prefix}{rank}")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return len(data)


def make_job(
    *,
    ranks: int,
    entries: int = 2000,
    tp: int = 8,
    lagging: int | None = None,
    seed: int = 0,
    queue_depth: int = 1,
    prefix: str = DEFAULT_PREFIX,
    fmt: str = "pickle",
) -> Job:
    if ranks < 2:
        raise ValueError("need at least 2 ranks")
    if tp < 1 or ranks % tp:
        raise ValueError(f"--tp {tp} must divide --ranks {ranks}")
    if entries < 1:
        raise ValueError("--entries must be positive")
    if fmt not in ("pickle", "json"):
        raise ValueError(f"unknown --format {fmt!r}")
    rng = random.Random(seed)
    if lagging is None:
        lagging = rng.randrange(1, ranks)
    if not 0 <= lagging < ranks:
        raise ValueError(f"--lagging {lagging} is not a rank of {ranks}")
    # A long-running job: tens of thousands of steps before the hang, so the
    # ring buffer has wrapped many times and record ids start high.
    steps_before = 17_000 + rng.randrange(0, 1000)
    return Job(
        ranks=ranks,
        tp=tp,
        entries=entries,
        lagging=lagging,
        hang_index=steps_before * OPS_PER_STEP + HANG_OP_IN_STEP,
        queue_depth=queue_depth,
        seed=seed,
        prefix=prefix,
        fmt=fmt,
        t0_ns=1_764_460_800_000_000_000 + rng.randrange(0, 10**12),
    )


def generate(job: Job, out: str, *, workers: int | None = None) -> Truth:
    """Write every rank's dump into `out` (created if needed); return the truth."""
    os.makedirs(out, exist_ok=True)
    blocked = sweep(job)
    kind, op = STEP[job.hang_index % OPS_PER_STEP]
    truth = Truth(
        lagging_rank=job.lagging,
        hang_group=group_name(job, kind, job.lagging),
        hang_group_desc=DESC[kind],
        hang_seq=seq_of(kind, job.hang_index),
        hang_op=op,
        blocked_at={str(r): blocked[r] for r in sorted(blocked)},
        ranks=job.ranks,
        tp=job.tp,
        entries=job.entries,
        seed=job.seed,
        prefix=job.prefix,
        format=job.fmt,
    )
    nproc = workers or os.cpu_count() or 1
    ranks = range(job.ranks)
    if nproc <= 1 or job.ranks < 4:
        _init_worker(job, blocked, out)
        for r in ranks:
            _write_rank(r)
    else:
        # fork is fine here: the generator holds no threads or locks.
        ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        with ctx.Pool(nproc, initializer=_init_worker, initargs=(job, blocked, out)) as pool:
            for _ in pool.imap_unordered(_write_rank, ranks, chunksize=8):
                pass
    with open(os.path.join(out, TRUTH_FILE), "w") as f:
        json.dump(asdict(truth), f, indent=1)
    return truth


def read_truth(out: str) -> Truth:
    with open(os.path.join(out, TRUTH_FILE)) as f:
        return Truth(**json.load(f))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--entries", type=int, default=2000, help="records kept per rank (ring size)")
    p.add_argument("--out", required=True, help="directory to write the dumps into")
    p.add_argument(
        "--lagging", type=int, default=None, help="the rank that stops (default: from --seed)"
    )
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel group size")
    p.add_argument("--format", choices=("pickle", "json"), default="pickle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--queue-depth",
        type=int,
        default=1,
        help="ops a blocked rank has enqueued past its blocked one",
    )
    p.add_argument("--prefix", default=DEFAULT_PREFIX)
    p.add_argument("--workers", type=int, default=None)
    ns = p.parse_args(argv)
    try:
        job = make_job(
            ranks=ns.ranks,
            entries=ns.entries,
            tp=ns.tp,
            lagging=ns.lagging,
            seed=ns.seed,
            queue_depth=ns.queue_depth,
            prefix=ns.prefix,
            fmt=ns.format,
        )
    except ValueError as e:
        p.error(str(e))
    t = time.perf_counter()
    truth = generate(job, ns.out, workers=ns.workers)
    summary = {k: v for k, v in asdict(truth).items() if k != "blocked_at"}
    summary["seconds"] = round(time.perf_counter() - t, 2)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
