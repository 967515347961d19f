"""Real gloo ranks (spawned processes, FileStore rendezvous: no ports) and a real coordinator."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RANKJOB = HERE / "rankjob.py"
PYSPY = str(Path(sys.executable).parent / "py-spy")


@dataclass
class Job:
    run_dir: Path
    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]
    stopped: set[int] = field(default_factory=set)

    def output(self) -> str:
        return "\n".join(
            f"--- rank {i} (rc={p.poll()})\n{log.read_text(errors='replace')[-4000:]}"
            for i, (p, log) in enumerate(zip(self.procs, self.logs, strict=True))
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready = 0
            for p, log in zip(self.procs, self.logs, strict=True):
                text = log.read_text(errors="replace") if log.exists() else ""
                if "READY" in text:
                    ready += 1
                elif p.poll() is not None:
                    raise AssertionError(f"a rank exited before READY\n{self.output()}")
            if ready == len(self.procs):
                return
            time.sleep(0.1)
        raise AssertionError(f"ranks not ready after {timeout}s\n{self.output()}")

    def rankinfo(self) -> dict[int, dict[str, Any]]:
        out = {}
        for path in (self.run_dir / "hook").glob("*.json"):
            info = json.loads(path.read_text())
            out[int(info["rank"])] = info
        return out

    def trackers(self) -> dict[int, Any]:
        """A fresh agent-side `RankTracker` per rank, from the rank-info files the hook wrote."""
        from hangwatch.agent.ranks import RankTracker

        from hangwatch import hook_protocol
        from hangwatch.formats import RankInfo

        run = str(self.run_dir)
        return {
            rank: RankTracker(
                info=RankInfo.from_json(info),
                rankinfo_path=hook_protocol.rankinfo_path(run, info["pid"]),
                rankinfo_mtime=0,
                final_status_path=hook_protocol.final_status_path(run, info["pid"]),
            )
            for rank, info in self.rankinfo().items()
        }

    def pid(self, rank: int) -> int:
        return self.procs[rank].pid

    def sigstop(self, rank: int) -> None:
        """Stop the rank and return once the kernel shows it stopped (state T):
        signal delivery is asynchronous."""
        pid = self.pid(rank)
        os.kill(pid, signal.SIGSTOP)
        self.stopped.add(rank)
        stat = Path(f"/proc/{pid}/stat")
        deadline = time.monotonic() + 10
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline, f"rank {rank} (pid {pid}) not stopped in 10 s"
            time.sleep(0.005)

    def sigcont(self, rank: int) -> None:
        os.kill(self.pid(rank), signal.SIGCONT)
        self.stopped.discard(rank)

    def close(self) -> None:
        (self.run_dir / "stop").touch()
        for r in list(self.stopped):
            self.sigcont(r)
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def start_job(
    base: Path,
    *,
    world: int = 2,
    mode: str = "hang",
    attach: str = "call",
    extra: tuple[str, ...] = (),
    backend: str = "gloo",
) -> Job:
    run_dir = base / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for rank in range(world):
        log = base / f"rank{rank}.log"
        cmd = [
            sys.executable,
            str(RANKJOB),
            "--rank",
            str(rank),
            "--world",
            str(world),
            "--store",
            str(base / "store"),
            "--run-dir",
            str(run_dir),
            "--mode",
            mode,
            "--attach",
            attach,
            "--backend",
            backend,
            *extra,
        ]
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))
        logs.append(log)
    return Job(run_dir=run_dir, procs=procs, logs=logs)


def socket_of(info: dict[str, Any]) -> str:
    sock = info["socket"]
    assert sock and os.path.exists(sock), info
    return str(sock)
