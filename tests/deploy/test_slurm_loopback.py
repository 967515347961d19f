"""The batch script's own command lines, run on loopback with a real 2-rank gloo job.

Slurm is not needed: the script's hw_*_cmd functions build the exact argv
that main() hands to srun, and here bash execs that argv directly. The
coordinator, the agent and `hangwatch run -- torchrun ...` are the real
programs; the test only picks free ports and local directories.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hangwatch.testing.ports import free_port

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "hangwatch.sbatch"
TRAIN = Path(__file__).resolve().parent / "loopback_train.py"


def _role(func: str, env: dict[str, str], log: Path, *args: str) -> subprocess.Popen[bytes]:
    script = (
        f"source {shlex.quote(str(SBATCH))}\n"
        "hw_defaults\nhw_make_token\n"
        f'{func} "$@"\nexec "${{HW_CMD[@]}}"\n'
    )
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            ["bash", "-c", script, "bash", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(p: subprocess.Popen[bytes], timeout: float = 15) -> int:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
    return p.returncode


def _job(env: dict[str, str], token: str) -> dict[str, object] | None:
    req = urllib.request.Request(
        f"http://127.0.0.1:{env['HANGWATCH_HTTP_PORT']}/api/jobs",
        headers={"Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        jobs = json.load(r)
    return next((j for j in jobs if j["job"] == env["HANGWATCH_JOB_ID"]), None)


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_sbatch_command_lines_run_a_job_on_loopback(tmp_path: Path) -> None:
    venv_bin = str(Path(sys.executable).parent)
    # The caller's environment minus anything that would steer the script.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HANGWATCH_", "HW_", "SLURM_"))}
    env |= {
        "PATH": f"{venv_bin}{os.pathsep}{os.environ['PATH']}",
        "HW_HEAD": "127.0.0.1",
        "HW_BIND": "127.0.0.1",
        "HW_NNODES": "1",
        "HW_NPROC_PER_NODE": "2",
        "HW_RDZV_PORT": str(free_port()),
        "HANGWATCH_JOB_ID": "sbatch-loopback",
        "HANGWATCH_GRPC_PORT": str(free_port()),
        "HANGWATCH_HTTP_PORT": str(free_port()),
        "HANGWATCH_DATA_DIR": str(tmp_path / "data"),
        "HANGWATCH_RUN_DIR": str(tmp_path / "run"),
        "HANGWATCH_POLL_INTERVAL": "0.2",
    }
    logs = {name: tmp_path / f"{name}.log" for name in ("coordinator", "agent", "train")}
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def logs_text() -> str:
        return "\n".join(
            f"--- {n}\n{p.read_text(errors='replace')[-3000:]}"
            for n, p in logs.items()
            if p.exists()
        )

    try:
        procs["coordinator"] = _role("hw_coordinator_cmd", env, logs["coordinator"])
        # The script's own readiness wait, against the real coordinator.
        ready = subprocess.run(
            ["bash", "-c", f"source {shlex.quote(str(SBATCH))}\nhw_defaults\nhw_wait_ready 30"],
            env=env,
            capture_output=True,
            text=True,
            timeout=40,
        )
        assert ready.returncode == 0, ready.stderr + logs_text()
        token = (tmp_path / "data" / "token").read_text().strip()
        assert oct((tmp_path / "data" / "token").stat().st_mode & 0o777) == "0o600"

        procs["agent"] = _role("hw_agent_cmd", env, logs["agent"])
        stop = tmp_path / "stop"
        procs["train"] = _role("hw_train_cmd", env, logs["train"], str(TRAIN), str(stop), "45")

        # Both ranks attached the hook and the agent registered them.
        deadline = time.monotonic() + 45
        job = None
        while time.monotonic() < deadline:
            for name, p in procs.items():
                assert p.poll() is None, f"{name} exited with {p.returncode}\n{logs_text()}"
            job = _job(env, token)
            if job and job["ranks_registered"] == 2 and job["agents_connected"] == 1:
                break
            time.sleep(0.3)
        assert job and job["ranks_registered"] == 2 and job["agents_connected"] == 1, (
            f"{job}\n{logs_text()}"
        )
        hook_files = sorted((tmp_path / "run" / "hook").glob("*.json"))
        assert len(hook_files) == 2, hook_files
        assert {json.loads(f.read_text())["rank"] for f in hook_files} == {0, 1}

        stop.touch()
        assert procs["train"].wait(30) == 0, logs_text()
    finally:
        for name in ("train", "agent", "coordinator"):
            if name in procs:
                _stop(procs[name])
    assert procs["agent"].returncode == 0, f"agent did not stop cleanly\n{logs_text()}"
    assert procs["coordinator"].returncode == 0, f"coordinator did not stop cleanly\n{logs_text()}"
