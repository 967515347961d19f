"""`hangwatch server` as a real process: addresses, Health, HTTP, SIGTERM, refusals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from hangwatch.config import env_var
from hangwatch.wire import pb, rpc

LINE = re.compile(r"^hangwatch server: grpc=(\S+) http=(http://\S+)$")


def _env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    e["PYTHONUNBUFFERED"] = "1"
    return e


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    out: list[str] = []
    t = threading.Thread(
        target=lambda: out.append(proc.stdout.readline() if proc.stdout else ""), daemon=True
    )
    t.start()
    t.join(timeout)
    if not out:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"no address line within {timeout}s; stderr:\n{err}")
    return out[0]


@pytest.mark.timeout(60)
def test_serves_grpc_and_http_and_exits_on_sigterm(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hangwatch",
            "server",
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--data-dir",
            str(data),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        line = _readline(proc, 30).strip()
        m = LINE.match(line)
        assert m, line
        grpc_addr, http_addr = m.groups()
        info = json.loads((data / "server.json").read_text())
        assert (info["grpc"], info["http"], info["pid"]) == (grpc_addr, http_addr, proc.pid)
        assert grpc_addr.startswith("127.0.0.1:") and not grpc_addr.endswith(":0")
        with grpc.insecure_channel(grpc_addr) as ch:
            health = rpc.CoordinatorStub(ch).Health(pb.HealthRequest(), timeout=10)
        assert health.serving and health.version
        with urllib.request.urlopen(http_addr + "/", timeout=10) as resp:
            assert resp.status == 200
        assert (data / "hangwatch.db").is_file()

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=10)
        took = time.monotonic() - t0
        err = proc.stderr.read() if proc.stderr else ""
        assert code == 0, err
        assert took < 5.0, took
        # The heap's policy (server.heap), said once the coordinator serves.
        assert "heap: free pages given back after each straggler tick" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for f in (proc.stdout, proc.stderr):
            if f:
                f.close()


@pytest.mark.timeout(30)
def test_refuses_non_loopback_without_token(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "hangwatch", "server", "--host", "0.0.0.0", "--grpc-port", "0", "--http-port", "0",
         "--data-dir", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=25,
    )  # fmt: skip
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "refusing to bind non-loopback host 0.0.0.0 without a token" in lines[0]
    assert env_var("token") in lines[0] and "--insecure" in lines[0]
    assert res.stdout == ""
    assert not (tmp_path / "d").exists()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("which", ["grpc", "http"])
def test_a_taken_port_is_one_line_and_no_data_dir(tmp_path: Path, which: str) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ports = {"grpc": "0", "http": "0", which: str(port)}
        res = subprocess.run(
            [sys.executable, "-m", "hangwatch", "server", "--grpc-port", ports["grpc"],
             "--http-port", ports["http"], "--data-dir", str(tmp_path / "d")],
            capture_output=True, text=True, env=_env(), timeout=25,
        )  # fmt: skip
    assert res.returncode == 2, res
    # One line of ours: nothing from gRPC's core logger before it.
    lines = res.stderr.strip().splitlines()
    assert lines == [
        f"hangwatch server: cannot bind {'gRPC' if which == 'grpc' else 'HTTP'} on "
        f"127.0.0.1:{port}: [Errno 98] Address already in use"
    ], res.stderr
    assert not (tmp_path / "d").exists()
