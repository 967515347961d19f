"""A gloo training loop that knows nothing of hangwatch, with one rank optionally slower.

    python straggler_job.py STORE RANK WORLD SECONDS SLOW_RANK [SLOWDOWN [spin|sleep]]

It stops after SECONDS, or as soon as the file STORE.stop exists.

Every step is two chunks of work, each followed by an all_reduce. A chunk is
`WORK_S` of waiting (the device time the host waits for on a real job) and,
on SLOW_RANK (-1: none), SLOWDOWN (default 0.5) as much again of real CPU
compute: a rank about 50% slower per step by default. With `sleep` the extra
time is spent waiting instead (a slow data path, a throttled device the host
waits on): it adds to the step exactly, with no CPU taken from the other
ranks of a small machine. The ranks agree when to stop, so none is left in a
collective; the script exits 0 and prints its median step time.
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

WORK_S = 0.04
store, rank, world, seconds, slow = (
    sys.argv[1],
    *map(int, sys.argv[2:4]),
    *map(float, sys.argv[4:6]),
)
slowdown = float(sys.argv[6]) if len(sys.argv) > 6 else 0.5
spin = (sys.argv[7] if len(sys.argv) > 7 else "spin") == "spin"
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
grad = torch.ones(4096)
go = torch.ones(1)
steps: list[float] = []
end = time.monotonic() + seconds
while True:
    go.fill_(1.0 if time.monotonic() < end and not os.path.exists(store + ".stop") else 0.0)
    dist.all_reduce(go, op=dist.ReduceOp.MIN)
    if go.item() == 0.0:
        break
    t0 = time.perf_counter()
    for _ in range(2):
        time.sleep(WORK_S)
        if rank == int(slow) and not spin:
            time.sleep(WORK_S * slowdown)
        elif rank == int(slow):
            spin_until = time.thread_time() + WORK_S * slowdown
            x = torch.ones(64, 64)
            while time.thread_time() < spin_until:
                x = x @ x / 64.0
        dist.all_reduce(grad)
    steps.append(time.perf_counter() - t0)
dist.destroy_process_group()
print(f"STEP_MEDIAN_MS {statistics.median(steps) * 1e3:.1f} STEPS {len(steps)}", flush=True)
