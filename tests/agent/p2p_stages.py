"""Three pipeline stages on gloo, captured the way the agent reads them.

Four steps of recv-from-previous, send-to-next and an all_reduce; then rank 1
is late for all_reduce #5. While ranks 0 and 2 wait in it, a thread of each
writes its status-only and full FR dumps (what the agent's poll reads); rank 1
writes its own once theirs exist, then joins. Every rank exits 0.

    python p2p_stages.py STORE_FILE OUT_DIR RANK
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d_ext

WORLD = 3


def snapshot(out: Path, rank: int) -> None:
    doc = {
        "status": json.loads(c10d_ext._dump_fr_trace_json(includeCollectives=False)),
        "full": json.loads(c10d_ext._dump_fr_trace_json()),
    }
    tmp = out / f".rank{rank}.json"
    tmp.write_text(json.dumps(doc))
    tmp.rename(out / f"rank{rank}.json")


def snapshot_when_waiting(out: Path, rank: int) -> None:
    # By its entries: pg_status can lag behind a collective that has finished.
    for _ in range(600):
        entries = json.loads(c10d_ext._dump_fr_trace_json())["entries"]
        if any(e["collective_seq_id"] == 5 for e in entries):
            snapshot(out, rank)
            return
        time.sleep(0.05)
    raise SystemExit(f"rank {rank} never saw itself inside all_reduce #5")


def settle(rank: int) -> None:
    """Until this rank's pg_status counts every op it has returned from as
    completed: gloo marks completion from its own thread after the op returns,
    and on a loaded machine the last send's lagged (seen: completed 9 of 12)."""
    for _ in range(600):
        st = json.loads(c10d_ext._dump_fr_trace_json(includeCollectives=False))["pg_status"]["0"]
        if int(st["last_completed_collective"]) >= int(st["last_enqueued_collective"]):
            return
        time.sleep(0.05)
    raise SystemExit(f"rank {rank}: its pg_status never counted its own ops completed")


def main(store: str, out: Path, rank: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    for _ in range(4):
        x = torch.ones(2)
        if rank > 0:
            dist.recv(x, rank - 1)
        if rank < WORLD - 1:
            dist.send(x, rank + 1)
        dist.all_reduce(torch.ones(2))
    if rank == 1:
        for _ in range(600):
            if all((out / f"rank{r}.json").exists() for r in (0, 2)):
                break
            time.sleep(0.05)
        settle(rank)
        snapshot(out, rank)
    else:
        threading.Thread(target=snapshot_when_waiting, args=(out, rank), daemon=True).start()
    dist.all_reduce(torch.ones(2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
