"""A coordinator process shared by the live tests (real `hangwatch server`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hangwatch.formats import ServerInfo

STALL_TIMEOUT = 2.0
# The live tests' agents poll every 0.5 s; the coordinator's straggler monitor
# scores one instant per poll interval, so it is told the same.
POLL_INTERVAL = 0.5


@pytest.fixture(scope="session")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with coordinator_process(tmp_path_factory.mktemp("coord")) as info:
        yield info


@contextlib.contextmanager
def coordinator_process(data: Path, *extra: str) -> Iterator[dict[str, str]]:
    """A real `hangwatch server` on port 0; fails the test if it exits badly."""
    log = (data / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hangwatch", "server", "--grpc-port", "0", "--http-port", "0",
         "--data-dir", str(data), "--stall-timeout", str(STALL_TIMEOUT), "--dump-deadline", "15",
         "--poll-interval", str(POLL_INTERVAL), *extra],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        for _ in range(600):
            if (info := ServerInfo.read(data)) is not None:
                break
            assert proc.poll() is None, (data / "server.log").read_text()
            time.sleep(0.1)
        assert info is not None, "no server.json within 60 s"
        yield {"grpc": info.grpc, "http": info.http, "data": str(data)}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        log.close()
    assert rc == 0, f"coordinator exited {rc}: {(data / 'server.log').read_text()[-3000:]}"


def _tree(pid: int) -> list[tuple[int, str]]:
    """Every process under `pid`, each with its start time (to skip a reused pid)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append((int(d.name), fields[19]))
    out: list[tuple[int, str]] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


def _started(pid: int) -> str | None:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def stop_job(p: subprocess.Popen[bytes], grace: float = 15.0) -> int:
    """Stop a launcher (`hangwatch run -- torchrun ...`, started in a session of its
    own) and every process under it: SIGTERM to its group, then after `grace` SIGKILL
    to the group and to each process found under it. torchrun starts every worker in a
    session of its own, so signalling the launcher's group alone leaves a stalled
    worker running once torchrun is killed."""
    tree = _tree(p.pid)
    if p.poll() is None and grace > 0:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(grace)
    tree += _tree(p.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    for pid, started in tree:
        if _started(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    p.wait(5)
    return p.returncode


def has_compiler_stack(pid: int) -> bool:
    """Whether torch's compiler stack is loaded in the process: torch._dynamo
    imports cProfile, whose C extension (_lsprof) then shows in its maps.
    Nothing else a plain gloo rank or hangwatch's hook imports loads it."""
    return "/_lsprof." in (Path("/proc") / str(pid) / "maps").read_text()
