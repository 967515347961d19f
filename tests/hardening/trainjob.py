"""Start `steady_train.py` ranks, read their step logs, make them hang, stop them."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SCRIPT = Path(__file__).with_name("steady_train.py")


@dataclass(frozen=True)
class Step:
    end: float  # CLOCK_MONOTONIC, system-wide
    duration: float
    index: int


class TrainJob:
    """`world` real gloo ranks; rank r's hook writes into `run_dirs[r]` (its "node")."""

    def __init__(
        self,
        workdir: Path,
        *,
        world: int,
        run_dirs: Sequence[Path],
        job_id: str,
        culprit: int = -1,
        step_time: float = 0.02,
        rank_env: Mapping[int, Mapping[str, str]] | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.world = world
        self.run_dirs = list(run_dirs)
        self.job_id = job_id
        self.culprit = culprit
        self.step_time = step_time
        self.rank_env = rank_env or {}
        self.out = self.workdir / "train"
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, ready_timeout: float = 90.0) -> TrainJob:
        self.out.mkdir(parents=True, exist_ok=True)
        store = self.workdir / "store"
        store.unlink(missing_ok=True)
        base = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
        for r in range(self.world):
            cmd = [
                sys.executable, "-u", str(SCRIPT), "--rank", str(r), "--world", str(self.world),
                "--store", str(store), "--run-dir", str(self.run_dirs[r]), "--job-id", self.job_id,
                "--out", str(self.out), "--culprit", str(self.culprit),
                "--step-time", str(self.step_time),
            ]  # fmt: skip
            with open(self.out / f"rank_{r}.log", "wb") as log:
                self.procs.append(
                    subprocess.Popen(
                        cmd,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env={**base, **self.rank_env.get(r, {})},
                    )
                )
        self.wait_steps(5, ready_timeout)
        return self

    def log(self, rank: int) -> str:
        return (self.out / f"rank_{rank}.log").read_text(errors="replace")[-3000:]

    def check(self) -> None:
        """Fail with the rank's output if any rank exited."""
        for r, p in enumerate(self.procs):
            if p.poll() is not None:
                raise AssertionError(f"rank {r} exited with {p.returncode}:\n{self.log(r)}")

    def steps(self, rank: int) -> list[Step]:
        path = self.out / f"steps_{rank}.txt"
        out: list[Step] = []
        if not path.exists():
            return out
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:  # the last line may be half written
                out.append(Step(float(parts[0]), float(parts[1]), int(parts[2])))
        return out

    def wait_steps(self, n: int, timeout: float) -> None:
        """Every rank has done at least `n` more steps than now."""
        base = [len(self.steps(r)) for r in range(self.world)]
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.check()
            if all(len(self.steps(r)) >= base[r] + n for r in range(self.world)):
                return
            time.sleep(0.05)
        raise AssertionError(f"ranks did not make {n} steps in {timeout:.0f}s")

    def hang(self) -> float:
        """Make the culprit stop calling collectives; returns when the others are blocked."""
        assert self.culprit >= 0
        (self.out / "hang").touch()
        t = time.monotonic()
        # Once nobody has logged a step for a while, everyone is stuck.
        while True:
            self.check()
            last = max((s[-1].end for r in range(self.world) if (s := self.steps(r))), default=0)
            if time.monotonic() - last > 0.5 + 5 * self.step_time:
                return t
            if time.monotonic() - t > 30:
                raise AssertionError("the job kept stepping after the hang was injected")
            time.sleep(0.05)

    def close(self) -> None:
        (self.out / "stop").touch()
        end = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                p.wait()

    def __enter__(self) -> TrainJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def median_in(steps: Sequence[Step], windows: Sequence[tuple[float, float]]) -> float | None:
    """Median duration of the steps that ended inside any of the windows."""
    picked = [s.duration for s in steps if any(a <= s.end <= b for a, b in windows)]
    return statistics.median(picked) if picked else None


# Step times on a shared 2-core CI box are noisy; training that a dead agent or
# coordinator blocked would show up as a multiple, not a few tens of percent.
MAX_STEP_RATIO = 1.5


def step_ratios(
    job: TrainJob,
    ranks: Sequence[int],
    down: Sequence[tuple[float, float]],
    up: Sequence[tuple[float, float]],
) -> dict[int, float]:
    """rank -> median step time in the `down` windows over that in the `up` windows."""
    ratios = {}
    for r in ranks:
        steps = job.steps(r)
        md, mu = median_in(steps, down), median_in(steps, up)
        assert md is not None and mu is not None, f"rank {r}: no steps in some window"
        ratios[r] = md / mu
    return ratios


def complement(
    windows: Sequence[tuple[float, float]], start: float, end: float
) -> list[tuple[float, float]]:
    """The parts of [start, end] outside every window (windows sorted, disjoint)."""
    out, t = [], start
    for a, b in windows:
        if a > t:
            out.append((t, a))
        t = max(t, b)
    if end > t:
        out.append((t, end))
    return out
