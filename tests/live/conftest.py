"""A coordinator process shared by the live tests (real `hangwatch server`)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hangwatch.formats import ServerInfo

STALL_TIMEOUT = 2.0


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
         *extra],
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
