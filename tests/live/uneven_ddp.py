"""DDP with uneven batches, the classic way to hang a job.

Rank 1's shard is shorter: it leaves the loop and waits in the end-of-epoch
barrier while the other ranks wait in DDP's gradient all_reduce for a batch
rank 1 never runs. Nothing times out for ten minutes. When torchrun restarts
the job (TORCHELASTIC_RESTART_COUNT > 0) the shards are even, as after fixing
the sampler, and the job finishes. Each attempt leaves `<dir>/attempt<N>.rank<R>`
holding its pid. Run by torchrun under `hangwatch run`; it knows nothing of hangwatch.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

BATCHES = 6


def _init(attempt: int) -> None:
    """init_process_group on torchrun's store, under a prefix of the attempt's
    own: a restarted attempt on the same store can otherwise read a dead
    peer's gloo address from the attempt before and fail to connect."""
    timeout = datetime.timedelta(seconds=600)
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        and os.environ["RANK"] == "0",
        timeout=timeout,
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"uneven-ddp/attempt{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=world,
        timeout=timeout,
    )


def main(marks: Path) -> int:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _init(attempt)
    rank = dist.get_rank()
    (marks / f"attempt{attempt}.rank{rank}").write_text(str(os.getpid()))
    torch.manual_seed(rank)
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = BATCHES - 2 if attempt == 0 and rank == 1 else BATCHES
    for _ in range(batches):
        opt.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
