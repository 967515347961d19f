"""A pipeline-parallel training job, one stage per rank, with hand-written send/recv (gloo).

Each step: activations go forward stage to stage (recv from the previous,
send to the next), gradients go back the same way, then every rank
all_reduces its loss (the one collective a step makes, as real pipeline jobs
do for logging or gradient clipping). Gloo records no send/recv in FR.

Started under `torchrun`. Environment:
  PIPE_STEPS         steps to train (default 200)
  PIPE_STEP_S        seconds of fake compute per step (default 0.05)
  PIPE_STALL_RANK    the stage that stalls (default 1, the middle one)
  PIPE_STALL_AFTER   seconds of training before it stalls (default: never)
  PIPE_STALL_FILE    or it stalls at the first step after this file exists (a test
                     that needs the coordinator to have seen something first)
  PIPE_STALL_FOR     how long it stalls (default: forever)
  PIPE_STALL_HOW     "sleep" (time.sleep) or "spin" (pure-Python compute)
  PIPE_MARK_DIR      where the stalling rank writes `stalled` (unix time of the stall)
  PIPE_COMPILE       "1": every stage runs its forward through torch.compile
                     (inductor), compiled before its first step with no
                     collective in between, all stages on one cache (a job's
                     TORCHINDUCTOR_CACHE_DIR, else PIPE_MARK_DIR/inductor, new):
                     they wait on each other's builds. Each writes
                     `compiled_<rank>` (seconds it took) to PIPE_MARK_DIR
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

WIDTH = 16


def _mark(path: Path, text: str) -> None:
    """Write a marker the test polls for, whole or not at all: a plain write_text made
    the file exist empty for a moment, and a test that read it then failed (CI, stop 36)."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def stall(how: str, seconds: float) -> None:
    end = time.monotonic() + seconds
    if how == "spin":
        x = 0
        while time.monotonic() < end:
            for i in range(10_000):
                x = (x * 31 + i) % 1_000_003
    else:
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 3600.0))


def stage_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


def main() -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = int(os.environ.get("PIPE_STEPS", "200"))
    step_s = float(os.environ.get("PIPE_STEP_S", "0.05"))
    stall_rank = int(os.environ.get("PIPE_STALL_RANK", "1"))
    stall_after = float(os.environ.get("PIPE_STALL_AFTER", "inf"))
    stall_file = os.environ.get("PIPE_STALL_FILE")
    stall_for = float(os.environ.get("PIPE_STALL_FOR", "inf"))
    how = os.environ.get("PIPE_STALL_HOW", "sleep")
    torch.manual_seed(rank)
    w = torch.randn(WIDTH, WIDTH) / WIDTH
    forward = stage_forward
    mark = os.environ.get("PIPE_MARK_DIR")
    if os.environ.get("PIPE_COMPILE") == "1":
        if mark:
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(mark) / "inductor"))
        t0 = time.monotonic()
        forward = torch.compile(stage_forward)
        forward(torch.randn(4, WIDTH), w)
        if mark:
            _mark(Path(mark) / f"compiled_{rank}", f"{time.monotonic() - t0:.3f}")
    start = time.monotonic()
    stalled = False
    for step in range(steps):
        if (
            rank == stall_rank
            and not stalled
            and (
                time.monotonic() - start >= stall_after
                or (stall_file is not None and os.path.exists(stall_file))
            )
        ):
            stalled = True
            if mark:
                _mark(Path(mark) / "stalled", f"{time.time():.3f} {step}")
            stall(how, stall_for)
        if rank == 0:
            x = torch.randn(4, WIDTH)
        else:
            x = torch.empty(4, WIDTH)
            dist.recv(x, src=rank - 1)
        y = forward(x, w)
        if rank < world - 1:
            dist.send(y, dst=rank + 1)
        if rank == world - 1:
            g = torch.ones(4, WIDTH)
        else:
            g = torch.empty(4, WIDTH)
            dist.recv(g, src=rank + 1)
        if rank > 0:
            dist.send(g @ w.T, dst=rank - 1)
        loss = torch.tensor([float(y.sum())])
        dist.all_reduce(loss)
        time.sleep(step_s)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
