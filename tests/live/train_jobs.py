"""Small real training jobs for the live tests: launched by torchrun under
`hangwatch run`, they know nothing of hangwatch.

    python train_jobs.py JOB   (healthy, ddp-uneven, crash, loader, slow-eval, pipeline)

Every job prints "DONE" and exits 0 when it finishes; the hanging ones never do
(the test ends them). Sleeps stand in for the work a step does, so that the
coordinator sees steady progress before the fault.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

STEP_S = 0.1


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def train(net: nn.Module, batches: int, fail_at: int | None = None) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for i in range(batches):
        if i == fail_at:
            raise RuntimeError(f"rank {dist.get_rank()}: corrupt sample in batch {i}")
        loss = net(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # DDP and FSDP2 communicate here
        opt.step()
        time.sleep(STEP_S)


def ddp(rank: int, batches: int, fail_at: int | None = None) -> None:
    net = nn.parallel.DistributedDataParallel(model())
    train(net, batches, fail_at)


def fsdp2(checkpoint_dir: str) -> None:
    """FSDP2 training, then a sharded checkpoint (torch.distributed.checkpoint):
    every rank writes its shards and the ranks agree on the metadata, through
    the same process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    net = model()
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    train(net, 20)
    dcp.save({"model": net.state_dict()}, checkpoint_id=checkpoint_dir)
    train(net, 5)


def loader(rank: int) -> None:
    """Rank 1's data-loader thread dies; its main thread waits in queue.get() forever."""
    batches: queue.Queue[torch.Tensor] = queue.Queue(maxsize=4)

    def produce() -> None:
        for i in range(1000):
            if rank == 1 and i == 12:
                raise ValueError(f"corrupt record {i} in shard-0003.bin")
            batches.put(torch.randn(8, 16))

    threading.Thread(target=produce, name="data-loader", daemon=True).start()
    net = nn.parallel.DistributedDataParallel(model())
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for _ in range(1000):
        loss = net(batches.get()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(STEP_S)


def slow_eval(rank: int) -> None:
    """Rank 0 evaluates for EVAL_S while the others wait in a barrier; then training goes on."""
    net = nn.parallel.DistributedDataParallel(model())
    train(net, 20)
    if rank == 0:
        # Forward passes back to back, as an evaluation loop runs: busy on a CPU.
        with torch.no_grad():
            deadline = time.monotonic() + float(os.environ.get("EVAL_S", "12"))
            while time.monotonic() < deadline:
                net.module(torch.randn(64, 16))
    dist.barrier()
    train(net, 20)


def pipeline(rank: int) -> None:
    """Hand-written pipeline stages: activations go forward by send/recv, then
    every stage all_reduces; the middle stages do twice the p2p of the ends."""
    world = dist.get_world_size()
    for _ in range(int(os.environ.get("STEPS", "60"))):
        x = torch.randn(8, 16)
        if rank > 0:
            dist.recv(x, rank - 1)
        if rank < world - 1:
            dist.send(x * 2, rank + 1)
        dist.all_reduce(torch.ones(4))
        time.sleep(STEP_S)


def main(job: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if job == "healthy":
        # One launch, three things a healthy job does: DDP, then FSDP2, then a
        # sharded checkpoint, then training on.
        ddp(rank, 20)
        fsdp2(os.environ["CHECKPOINT_DIR"])
    elif job == "ddp-uneven":
        # Rank 1's shard has fewer batches: it leaves the loop and waits at the
        # final barrier while rank 0 is in its next step's gradient all_reduce.
        ddp(rank, 30 if rank == 1 else 40)
        dist.barrier()
    elif job == "crash":
        ddp(rank, 30, fail_at=10 if rank == 1 else None)
    elif job == "loader":
        loader(rank)
    elif job == "slow-eval":
        slow_eval(rank)
    elif job == "pipeline":
        pipeline(rank)
    else:
        raise SystemExit(f"unknown job {job!r}")
    dist.destroy_process_group()
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
