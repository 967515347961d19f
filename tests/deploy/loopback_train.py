"""A tiny gloo job for the Slurm loopback test: all_reduce until STOP_FILE exists.

Run by torchrun under `hangwatch run`; it knows nothing of hangwatch.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist


def main(stop_file: str, max_s: float) -> int:
    dist.init_process_group("gloo")
    t = torch.ones(4)
    deadline = time.monotonic() + max_s
    while True:
        dist.all_reduce(t)
        t.fill_(1.0)
        # Every rank must agree when to stop, or the last all_reduce hangs.
        flag = torch.tensor([1.0 if os.path.exists(stop_file) else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    dist.destroy_process_group()
    return 0 if flag.item() > 0 else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2])))
