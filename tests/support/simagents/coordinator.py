"""The coordinator under test as its own process (`python -m hangwatch server`), and
its CPU and memory from /proc."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from tests.support.serving import wait_serving
from tests.support.simagents.fleet import FleetError

CLK_TCK: Final = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_status_kb(pid: int, key: str) -> int:
    """A /proc/<pid>/status field in kB (VmRSS, VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


class CoordinatorProcess:
    """`python -m hangwatch server` on loopback ports 0, its log in `<data_dir>/coordinator.log`."""

    def __init__(
        self,
        data_dir: Path,
        *,
        stall_timeout: float,
        dump_deadline: float = 60.0,
        agent_lost_timeout: float = 30.0,
        extra_args: Sequence[str] = (),
        start_timeout: float = 60.0,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.log_path = self.data_dir / "coordinator.log"
        cmd = [
            sys.executable,
            "-m",
            "hangwatch",
            "server",
            "--host",
            "127.0.0.1",
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--data-dir",
            str(self.data_dir),
            "--stall-timeout",
            str(stall_timeout),
            "--dump-deadline",
            str(dump_deadline),
            "--agent-lost-timeout",
            str(agent_lost_timeout),
            *extra_args,
        ]
        # The caller's hangwatch settings (token, ports) must not leak in.
        env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
        env.update(extra_env or {})  # the coordinator's alone (an allocator's settings, say)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.info = wait_serving(
            self.proc, self.data_dir, start_timeout, lambda: self.log()[-4000:], FleetError
        )
        self.pid = self.info.pid
        self.grpc: str = self.info.grpc
        self.http: str = self.info.http

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def get(self, path: str, timeout: float = 30.0) -> Any:
        with urllib.request.urlopen(self.http + path, timeout=timeout) as r:
            return json.loads(r.read())

    def wait_incident(self, job_id: str, timeout: float) -> dict[str, Any]:
        """The job's first incident once it is no longer collecting (detail form),
        plus `incidents_for_job`: how many the job has."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise FleetError(
                    f"coordinator exited with {self.proc.returncode}:\n{self.log()[-4000:]}"
                )
            rows = self.get(f"/api/incidents?job={urllib.parse.quote(job_id)}")
            done = [r for r in rows if r["status"] != "collecting"]
            if done:
                detail: dict[str, Any] = self.get(f"/api/incidents/{done[0]['id']}")
                detail["incidents_for_job"] = len(rows)
                return detail
            time.sleep(0.1)
        raise TimeoutError(f"no analysed incident for job {job_id} within {timeout:.0f}s")

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit code (killed after `timeout`: -9)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                return -9
        return self.proc.returncode

    def __enter__(self) -> CoordinatorProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
