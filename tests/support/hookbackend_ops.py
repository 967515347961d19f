"""Every op of the hwhooks backend, checked on real ranks (run under torchrun).

Each rank checks its results, then torch's recorder for the backend: every
entry completed and retired with a duration, as on NCCL2. Prints one JSON
line with what it saw; exits non-zero on any mismatch.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from hangwatch.testing import backends


def main() -> None:
    dist.init_process_group(backends.register(backends.HWHOOKS))
    r, w = dist.get_rank(), dist.get_world_size()
    cpu = torch.device("cpu")
    b = dist.distributed_c10d._get_default_group()._get_backend(cpu)
    assert b.supports_completion_hooks, "hwhooks must have completion hooks"

    def full(v: float, n: int = 4) -> torch.Tensor:
        return torch.full((n,), float(v))

    t = full(r + 1)
    dist.all_reduce(t)
    assert t[0] == sum(range(1, w + 1)), t
    for op, want in (
        (dist.ReduceOp.MAX, w),
        (dist.ReduceOp.MIN, 1),
        (dist.ReduceOp.AVG, (w + 1) / 2),
    ):
        t = full(r + 1)
        dist.all_reduce(t, op=op)
        assert abs(float(t[0]) - want) < 1e-6, (op, t)
    t = full(r)
    dist.broadcast(t, 1)
    assert t[0] == 1, t
    outs = [torch.zeros(2) for _ in range(w)]
    dist.all_gather(outs, full(r, 2))
    assert [float(o[0]) for o in outs] == list(range(w)), outs
    o = torch.zeros(2 * w)
    dist.all_gather_into_tensor(o, full(r, 2))
    assert o.tolist() == [float(i) for i in range(w) for _ in range(2)], o
    o = torch.zeros(2)
    dist.reduce_scatter_tensor(o, torch.arange(2 * w, dtype=torch.float))
    assert o.tolist() == [w * 2.0 * r, w * (2.0 * r + 1)], o
    o = torch.zeros(2)
    dist.reduce_scatter(o, [full(i, 2) for i in range(w)])
    assert o.tolist() == [w * float(r)] * 2, o
    ts = [full(r + 1, 2), full(r + 1, 3)]
    dist.all_reduce_coalesced(ts)
    assert all(float(x[0]) == sum(range(1, w + 1)) for x in ts), ts
    dist.barrier()
    # A ring through batch_isend_irecv (coalesced), recv listed first.
    x = torch.zeros(1)
    ops = [
        dist.P2POp(dist.irecv, x, (r - 1) % w),
        dist.P2POp(dist.isend, torch.tensor([float(r)]), (r + 1) % w),
    ]
    for q in dist.batch_isend_irecv(ops):
        q.wait()
    assert x[0] == (r - 1) % w, x
    if r == 0:
        dist.send(torch.tensor([7.0]), 1)
    elif r == 1:
        y = torch.zeros(1)
        dist.recv(y, 0)
        assert y[0] == 7, y
    works = [dist.all_reduce(torch.ones(1), async_op=True) for _ in range(4)]
    works[-1].get_future().wait()
    for q in works:
        q.wait()
    dist.barrier()
    doc = json.loads(
        torch._C._distributed_c10d._dump_fr_trace_json(
            includeCollectives=True, backend=backends.HWHOOKS
        )
    )
    entries = doc["entries"]
    # The last barrier may still be retiring on this rank: its completion
    # hook fires right after the Work ends.
    settled = entries[:-1]
    bad = [e for e in settled if e["state"] != "completed" or not e["retired"]]
    assert not bad, bad[:3]
    assert all(float(e.get("duration_ms") or -1) >= 0 for e in settled), settled[:3]
    names = sorted({e["profiling_name"] for e in entries})
    # One write(2) of the whole line: the three ranks share the test's stdout
    # pipe, and print()'s text and newline went out apart often enough for two
    # ranks' lines to run together (seen once in the torch 2.15 matrix). A pipe
    # never splits a write of under PIPE_BUF (4,096) bytes; this line is ~300.
    line = json.dumps({"rank": r, "entries": len(entries), "names": names}) + "\n"
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
