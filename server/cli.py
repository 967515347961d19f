"""`hangwatch server`: the gRPC coordinator and the dashboard, one process.

On start it prints one machine-readable line,
    hangwatch server: grpc=HOST:PORT http=http://HOST:PORT
and writes the same addresses to `<data_dir>/server.json` (formats.ServerInfo).
SIGINT/SIGTERM start a bounded shutdown (server.runtime); a second signal
exits at once (hangwatch.lifecycle).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Final

from hangwatch import config as cfg
from hangwatch.lifecycle import ShutdownSignals, configure_logging

EXIT_USAGE: Final = 2

log = logging.getLogger("hangwatch.server")


def add_parser(subparsers: Any) -> None:
    cfg.add_command(
        subparsers,
        cfg.SERVER,
        help="Run the coordinator: gRPC for agents, HTTP dashboard for people.",
        description=(
            "Run the coordinator: agents stream progress to it over gRPC; it detects stalls, "
            "collects a dump from every rank, analyses them and serves the dashboard. "
            f"The token comes from {cfg.env_var('token')} or --token-file; Health is served without it."
        ),
        func=run,
    )


def _refuse(msg: str) -> int:
    print(f"hangwatch server: {msg}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def run(ns: argparse.Namespace) -> int:
    try:
        conf = cfg.for_command(cfg.SERVER, ns)
    except ValueError as e:
        return _refuse(f"bad setting: {e}")
    configure_logging(conf.job.log_level)
    from hangwatch.server.runtime import ServerRuntime, StartError

    signals = ShutdownSignals("hangwatch server", exit_bound_s=ServerRuntime.EXIT_BOUND_S)
    with signals as stop:
        try:
            runtime = ServerRuntime(conf, stop)
            info = runtime.start()
        except StartError as e:
            return _refuse(str(e))
        print(f"hangwatch server: grpc={info.grpc} http={info.http}", flush=True)
        try:
            return runtime.serve()
        finally:
            signals.stopping()  # a signal armed it already; the HTTP server's own end did not
            runtime.shutdown()
