"""Waiting for a `python -m hangwatch server` child to serve, read from its server.json."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from hangwatch.formats import ServerInfo


def wait_serving(
    proc: subprocess.Popen[bytes],
    data_dir: Path,
    timeout: float,
    log_tail: Callable[[], str],
    error: Callable[[str], Exception],
) -> ServerInfo:
    """The server.json that the coordinator `proc` writes once it serves. Only the one
    naming its own pid counts: a SIGKILLed earlier start leaves its own behind. If `proc`
    exits first, or `timeout` passes (it is killed then), raises `error` with the log tail."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise error(f"coordinator exited with {proc.returncode}:\n{log_tail()}")
        info = ServerInfo.read(data_dir)
        if info is not None and info.pid == proc.pid:
            return info
        time.sleep(0.02)
    proc.kill()
    proc.wait(10)
    raise error(f"coordinator did not serve within {timeout:.0f}s:\n{log_tail()}")
