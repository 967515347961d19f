"""`hangwatch server`: the gRPC coordinator and the dashboard, one process.

On start it prints one machine-readable line,
    hangwatch server: grpc=HOST:PORT http=http://HOST:PORT
and writes the same addresses to `<data_dir>/server.json` (SERVER_INFO).
SIGINT/SIGTERM start a bounded shutdown; a second signal exits at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Final

from hangwatch import config as cfg
from hangwatch import env

SERVER_INFO: Final = "hangwatch.serverinfo/1"
# {"schema", "grpc": "HOST:PORT", "http": "http://HOST:PORT", "pid", "started_unix"}
SERVER_INFO_FILE: Final = "server.json"
EXIT_USAGE: Final = 2

log = logging.getLogger("hangwatch.server")


def add_parser(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        cfg.SERVER,
        help="Run the coordinator: gRPC for agents, HTTP dashboard for people.",
        description=(
            "Run the coordinator: agents stream progress to it over gRPC; it detects stalls, "
            "collects a dump from every rank, analyses them and serves the dashboard. "
            f"The token comes from {env.HANGWATCH_TOKEN} or --token-file; Health is served without it."
        ),
    )
    cfg.add_arguments(p, cfg.SERVER)
    p.set_defaults(func=run)


def _refuse(msg: str) -> int:
    print(f"hangwatch server: {msg}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def _bind_http(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets it knows
    # are TCP, and without it every response waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _write_info(data_dir: Path, info: dict[str, Any]) -> None:
    path = data_dir / SERVER_INFO_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def run(ns: argparse.Namespace) -> int:
    try:
        conf = cfg.from_sources(ns)
    except ValueError as e:
        return _refuse(f"bad setting: {e}")
    logging.basicConfig(
        level=getattr(logging, conf.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from hangwatch.server.coordinator import Coordinator, hostport, is_loopback

    try:
        token = conf.resolved_token()
    except (OSError, ValueError) as e:
        return _refuse(f"cannot read the token: {e}")
    if not is_loopback(conf.host) and not token and not conf.insecure:
        return _refuse(
            f"refusing to bind non-loopback host {conf.host} without a token "
            f"(set {env.HANGWATCH_TOKEN} or --token-file, or pass --insecure)"
        )
    for name in ("stall_timeout", "dump_deadline", "agent_lost_timeout"):
        if getattr(conf, name) <= 0:
            return _refuse(f"--{name.replace('_', '-')} must be positive")

    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():
            # Second signal: the operator wants out now, even if a shutdown
            # step (a long analysis, a stuck socket) is still running.
            os.write(2, b"hangwatch server: second signal, exiting now\n")
            os._exit(128 + signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    try:
        http_sock = _bind_http(conf.host, conf.http_port)
    except OSError as e:
        return _refuse(f"cannot bind HTTP on {hostport(conf.host, conf.http_port)}: {e}")
    coord = Coordinator(conf)
    try:
        coord.start()
    except Exception as e:
        http_sock.close()
        return _refuse(f"cannot start gRPC on {hostport(conf.host, conf.grpc_port)}: {e}")

    import uvicorn
    from hangwatch.server.web.app import create_app

    http_port = http_sock.getsockname()[1]
    http_address = "http://" + hostport(conf.host, http_port)
    coord.context.http_address = http_address
    coord.service.dashboard_url = http_address
    app = create_app(coord.context)
    uv = uvicorn.Server(
        uvicorn.Config(app, log_level=conf.log_level.lower(), access_log=False, lifespan="on")
    )
    # Not the main thread: uvicorn installs no signal handlers of its own there.
    http_thread = threading.Thread(
        target=uv.run, kwargs={"sockets": [http_sock]}, name="hangwatch-http", daemon=True
    )
    http_thread.start()

    info = {
        "schema": SERVER_INFO,
        "grpc": coord.grpc_address,
        "http": http_address,
        "pid": os.getpid(),
        "started_unix": time.time(),
    }
    _write_info(coord.data_dir, info)
    print(f"hangwatch server: grpc={coord.grpc_address} http={http_address}", flush=True)

    code = 0
    while not stop.wait(0.5):
        if not http_thread.is_alive():
            log.error("HTTP server stopped unexpectedly; shutting down")
            code = 1
            break
    log.info("shutting down")
    uv.should_exit = True
    coord.stop(grace=3.0)
    http_thread.join(5.0)
    http_sock.close()
    return code
