"""Addresses a setting names are checked where they are read: one line, exit 2, nothing dialled."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hangwatch.addresses import check_hostport


@pytest.mark.timeout(10)
def test_hostport_forms() -> None:
    for good in ("127.0.0.1:7451", "coord.example.org:1", "[::1]:7451", "dns:///coord:7451",
                 "unix:/run/hangwatch.sock", "ipv4:10.0.0.1:7451"):  # fmt: skip
        check_hostport(good, "--coordinator")
    for bad in ("nohostport", ":7451", "host:", "host:0", "host:65536", "host:port", "::1:7451"):
        with pytest.raises(ValueError, match="--coordinator"):
            check_hostport(bad, "--coordinator")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["agent", "run", "demo"])
def test_a_coordinator_without_a_port_is_refused_at_once(command: str, tmp_path: object) -> None:
    args = ["--coordinator", "nohostport"] + (["--", "true"] if command == "run" else [])
    r = subprocess.run(
        [sys.executable, "-m", "hangwatch", command, *args],
        capture_output=True, text=True, timeout=50, cwd=str(tmp_path),
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().endswith("--coordinator: expected HOST:PORT, got 'nohostport'")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
