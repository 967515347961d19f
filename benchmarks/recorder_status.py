"""What one status poll costs inside a rank, per flight-recorder instance.

Anchor: torch's status-only dump of the generic (gloo) instance, the one call
hangwatch's status poll made before it read every instance. Measured: the
hook's FRSTATUS answer (one status-only C++ call per instance, plus the JSON
around them) for the instances this process really has, and each instance's
status-only and full dumps alone. A world of one rank; on torch >= 2.15 the
default group runs on the hook-recorded `hwstore` backend and a second group on
gloo, so there are two instances; on older torch only gloo.

    python benchmarks/recorder_status.py [--collectives 2000] [--reps 200]

Prints medians and ratios to the anchor measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

from hangwatch.testing.ports import free_port


def _median_us(fn: Callable[[], bytes], reps: int) -> tuple[float, int]:
    times = []
    size = 0
    for _ in range(reps):
        t0 = time.perf_counter()
        size = len(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--collectives", type=int, default=2000, help="Collectives per group.")
    p.add_argument("--reps", type=int, default=200)
    a = p.parse_args()
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "TORCH_FR_BUFFER_SIZE": str(a.collectives),
        }
    )
    import torch
    import torch.distributed as dist

    from hangwatch import recorders
    from hangwatch.testing import storebackend

    torch.set_num_threads(1)
    hooked = storebackend.unsupported_reason() is None
    dist.init_process_group(storebackend.register() if hooked else "gloo")
    other = dist.new_group([0], backend="gloo") if hooked else None
    t = torch.ones(16)
    for _ in range(a.collectives):
        dist.all_reduce(t)
        if other is not None:
            dist.all_reduce(t, group=other)
    recs = recorders.discover()
    c = recorders.c10d_ext()
    print(f"torch {torch.__version__}; instances: {', '.join(r.instance for r in recs)}")
    anchor, asize = _median_us(
        lambda: bytes(c._dump_fr_trace_json(includeCollectives=False)), a.reps
    )
    print(f"anchor  generic status-only dump      {anchor:9.1f} us  {asize:8d} B  1.00x")
    rows: list[tuple[str, Callable[[], bytes]]] = [
        ("FRSTATUS (every instance)", lambda: recorders.status_doc(recs)),
    ]
    for r in recs:
        reader = recorders._reader(r.kind, r.instance, pickle=False)
        rows.append(
            (f"{r.instance} status-only", lambda reader=reader: reader(includeCollectives=False))
        )  # type: ignore[misc]
        rows.append((f"{r.instance} full JSON", lambda r=r: recorders.dump(r, pickle=False)))  # type: ignore[misc]
    for label, fn in rows:
        reps = a.reps if "full" not in label else max(5, a.reps // 20)
        us, size = _median_us(fn, reps)
        print(f"        {label:<30} {us:9.1f} us  {size:8d} B  {us / anchor:5.2f}x")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
