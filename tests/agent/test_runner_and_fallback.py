"""`hangwatch run` auto-attach, the fallback thread endpoint and collective-timeout events."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hangwatch.agent import endpoint
from hangwatch.agent.ranks import RankTracker, poll_rank, read_hook_events

from hangwatch import formats, hook_protocol
from hangwatch.formats import RankInfo
from hangwatch.wire import pb
from tests.agent.live_ranks import socket_of, start_job

pytestmark = pytest.mark.torch
HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(60)
def test_run_attaches_without_script_edit_and_exits_cleanly(tmp_path: Path) -> None:
    # Someone else's sitecustomize must still run after ours.
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text(
        "import os\nos.environ['CHAINED_SITECUSTOMIZE'] = 'yes'\n"
    )
    run_dir = tmp_path / "run"
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(other),
        # The job's own value is kept (and logged); the rank-info file records
        # it, so the agent watches there too.
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "elsewhere_"),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hangwatch.runner",
            "--run-dir",
            str(run_dir),
            "--fr-buffer-size",
            "5",
            "--",
            sys.executable,
            str(HERE / "plain_train.py"),
            str(tmp_path / "store"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
        cwd=str(HERE.parents[1]),
    )
    out = proc.stdout + proc.stderr
    # A clean exit: torch's worker server and handlers must not crash finalization.
    assert proc.returncode == 0, out
    assert "ENTRIES 5" in out, out  # the buffer size took effect (12 collectives, 5 kept)
    assert "CHAINED yes" in out, out
    assert "set TORCH_FR_BUFFER_SIZE=5" in out, out
    assert "keeping the job's TORCH_FR_DUMP_TEMP_FILE" in out, out
    assert "set TORCH_FR_DUMP_ON_TIMEOUT=1 and TORCH_NCCL_DUMP_ON_TIMEOUT=1" in out, out
    infos = [json.loads(p.read_text()) for p in (run_dir / "hook").glob("*.json")]
    assert len(infos) == 1 and infos[0]["schema"] == formats.RANKINFO
    assert infos[0]["dump_prefixes"] == {"watchdog": str(tmp_path / "elsewhere_")}
    assert [r["instance"] for r in infos[0]["recorders"]] == ["gloo"]
    assert infos[0]["groups"] == [{"name": "0", "desc": "default_pg", "pg_id": 0, "ranks": [0]}]
    assert not Path(infos[0]["socket"]).exists()  # removed at exit
    # What a real rank's hook wrote reads back through the format's one reader.
    typed = RankInfo.from_json(infos[0])
    assert typed.watchdog_prefix == str(tmp_path / "elsewhere_") and typed.pid > 0


@pytest.mark.timeout(90)
def test_thread_endpoint_and_collective_timeout_event(tmp_path: Path) -> None:
    job = start_job(tmp_path, mode="timeout", attach="thread", extra=("--pg-timeout", "4"))
    try:
        job.wait_ready()
        infos = job.rankinfo()
        info0 = infos[0]
        assert info0["fr_source"] == "thread"
        sock = socket_of(info0)
        # Rank 0 is blocked in all_reduce (GIL released): the thread answers everything.
        assert endpoint.call(sock, hook_protocol.PING, timeout=2) == b"pong"
        status = json.loads(endpoint.call(sock, hook_protocol.STATUS, timeout=2))
        assert status["recorders"][0]["dump"]["pg_status"]["0"]["last_enqueued_collective"] == "6"
        full = json.loads(endpoint.call(sock, hook_protocol.FR_TRACE_JSON, timeout=5))
        assert full["entries"]
        stacks = endpoint.call(sock, hook_protocol.DUMP_TRACEBACK, timeout=2).decode()
        assert "all_reduce" in stacks and "rankjob.py" in stacks
        with pytest.raises(endpoint.EndpointError, match="404"):
            endpoint.call(sock, "no_such_handler", timeout=2)

        t = RankTracker(info=RankInfo.from_json(info0), rankinfo_path="", rankinfo_mtime=0.0)
        assert job.procs[0].wait(30) != 0, job.output()  # the timeout killed it
        events = read_hook_events(t, str(job.run_dir))
        assert [(k, r) for k, r, _ in events] == [(pb.EVENT_KIND_COLLECTIVE_TIMEOUT, 0)], (
            job.output()
        )
        assert "timed out" in events[0][2].lower() or "timeout" in events[0][2].lower()
        assert read_hook_events(t, str(job.run_dir)) == []  # each line reported once
        res = poll_rank(t, time.monotonic(), entries_after_s=1.0)
        assert [k for k, _, _ in res.events] == [pb.EVENT_KIND_RANK_EXITED]
        assert t.state == pb.PROCESS_STATE_GONE
        assert poll_rank(t, time.monotonic(), entries_after_s=1.0).events == []
    finally:
        job.close()
    assert job.procs[1].returncode == 0, job.output()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "make,rc,why",
    [
        (lambda d: "no-such-command-here", 127, "No such file or directory"),
        (lambda d: str(d / "not-executable"), 126, "Permission denied"),
    ],
)
def test_a_command_that_cannot_run_is_one_plain_line(
    tmp_path: Path, make: Any, rc: int, why: str
) -> None:
    (tmp_path / "not-executable").write_text("#!/bin/sh\n")
    cmd = make(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "hangwatch", "run", "--run-dir", str(tmp_path / "run"), "--", cmd],
        capture_output=True, text=True, timeout=25,
    )  # fmt: skip
    assert r.returncode == rc, r.stderr
    # What the user typed and why, as a shell would say it; no bytes repr.
    assert r.stderr == f"hangwatch run: cannot run {cmd}: {why}\n"
