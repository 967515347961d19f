"""The coordinator process: gRPC and HTTP started, served and shut down as one.

`ServerRuntime(conf, stop)` binds the HTTP port (0 picks a free one) and builds
the coordinator whole; `start()` starts the coordinator's workers, then the
dashboard (uvicorn on its own thread, which installs no signal handlers there:
signals belong to the process's main thread), and writes
`<data_dir>/server.json`. `serve()` returns when `stop` is set, by a signal
handler or by the HTTP server ending on its own; `shutdown()` stops everything
in reverse within `SHUTDOWN_BOUND_S`: gRPC gets `GRPC_GRACE_S` to finish calls
in flight, HTTP what is left.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Final

from hangwatch.server.app_state import ServerContext
from hangwatch.server.coordinator import Coordinator
from hangwatch.server.incidents.store import StoreOpenError
from hangwatch.server.workers import Worker, Workers

from hangwatch.addresses import hostport
from hangwatch.config import Config
from hangwatch.formats import ServerInfo

log = logging.getLogger("hangwatch.server")

GRPC_GRACE_S: Final = 3.0
HTTP_GRACE_S: Final = 5.0


class StartError(Exception):
    """A port could not be bound or a server not started: a one-line reason."""


def bind_http(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets it knows
    # are TCP, and without it every response waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class ServerRuntime:
    """Both servers of one coordinator process, as two workers: the coordinator
    (its own workers: analyzer, notifier, actions, incidents, stragglers, gRPC)
    then HTTP, stopped in reverse under `SHUTDOWN_BOUND_S`.

    gRPC and HTTP keep an event loop each: grpc.aio and uvicorn each want to own
    theirs, and a handler stuck on one (a slow SQLite write in an API call) must
    not stall agents' reports on the other (docs/ARCHITECTURE.md)."""

    SHUTDOWN_BOUND_S: Final = GRPC_GRACE_S + 5.0 + HTTP_GRACE_S
    # The whole stop, the interpreter's exit included:
    # SHUTDOWN_BOUND_S and 7 s to exit; past it the process leaves every
    # thread's stack and exits 1 (lifecycle.exit_if_stuck). Under the systemd
    # unit's 30 s TimeoutStopSec. Measured: 0.52 s from SIGTERM to exit
    # (median of 5, an idle coordinator).
    EXIT_BOUND_S: Final = SHUTDOWN_BOUND_S + 7.0

    def __init__(self, conf: Config, stop: threading.Event) -> None:
        """`stop`: set by the signal handlers; the HTTP server's own end sets it too."""
        self.conf = conf
        self.stop = stop
        self.http_died = threading.Event()
        self.info: ServerInfo | None = None
        # Bound first: the coordinator is built knowing the dashboard's address.
        try:
            self._http_sock = bind_http(conf.serve.host, conf.serve.http_port)
        except OSError as e:
            raise StartError(
                f"cannot bind HTTP on {hostport(conf.serve.host, conf.serve.http_port)}: {e}"
            ) from e
        self.http_address = "http://" + hostport(conf.serve.host, self._http_sock.getsockname()[1])
        if conf.serve.grpc_port:
            # Probe the gRPC port the way the HTTP one is bound: taken, it is one
            # clean line, before gRPC's core logs its own and before the data
            # directory is created for a server that never ran.
            try:
                bind_http(conf.serve.host, conf.serve.grpc_port).close()
            except OSError as e:
                self._http_sock.close()
                raise StartError(
                    f"cannot bind gRPC on {hostport(conf.serve.host, conf.serve.grpc_port)}: {e}"
                ) from e
        try:
            self.coordinator = Coordinator(conf, http_address=self.http_address)
        except StoreOpenError as e:
            self._http_sock.close()
            raise StartError(str(e)) from e
        except BaseException:
            self._http_sock.close()
            raise
        self._uv: Any = None
        self._http_thread = threading.Thread(
            target=self._serve_http, name="hangwatch-http", daemon=True
        )
        self.workers = Workers(
            [
                Worker(
                    name="coordinator",
                    start=self._start_coordinator,
                    stop=lambda left: self.coordinator.stop(
                        grace=min(GRPC_GRACE_S, left), bound_s=left
                    ),
                    threads=self.coordinator.workers.threads,
                ),
                Worker(
                    name="http",
                    start=self._start_http,
                    stop=self._stop_http,
                    threads=lambda: [self._http_thread],
                ),
            ]
        )

    def threads(self) -> list[threading.Thread]:
        """Every thread this process's servers run now."""
        return self.workers.threads()

    def start(self) -> ServerInfo:
        try:
            self.workers.start()
        except StartError:
            self._http_sock.close()
            raise
        except Exception as e:
            self._http_sock.close()
            raise StartError(f"cannot start: {e}") from e
        coord = self.coordinator
        self.info = ServerInfo(
            grpc=coord.grpc_address,
            http=self.http_address,
            pid=os.getpid(),
            started_unix=time.time(),
        )
        self.info.write(coord.data_dir)
        return self.info

    def _start_coordinator(self) -> None:
        conf = self.conf
        try:
            self.coordinator.start()
        except Exception as e:
            raise StartError(
                f"cannot start gRPC on {hostport(conf.serve.host, conf.serve.grpc_port)}: {e}"
            ) from e

    def _start_http(self) -> None:
        import uvicorn
        from hangwatch.server.web.app import create_app

        coord = self.coordinator
        context = ServerContext(
            config=self.conf,
            store=coord.store,
            registry=coord.registry,
            data_dir=coord.data_dir,
            metrics=coord.metrics,
            grpc_address=coord.grpc_address,
            http_address=self.http_address,
            stragglers=coord.stragglers,
            trace=coord.trace,
        )
        self._uv = uvicorn.Server(
            uvicorn.Config(
                create_app(context),
                log_level=self.conf.job.log_level.lower(),
                access_log=False,
                lifespan="on",
            )
        )
        self._http_thread.start()

    def _serve_http(self) -> None:
        try:
            self._uv.run(sockets=[self._http_sock])
        finally:
            # Its own end, or the shutdown's: either way the process is done serving.
            if not self.stop.is_set():
                self.http_died.set()
                self.stop.set()

    def _stop_http(self, left: float) -> None:
        if self._uv is not None:
            self._uv.should_exit = True
        if self._http_thread.is_alive():
            self._http_thread.join(left)
        self._http_sock.close()

    def serve(self) -> int:
        """Block until `stop` is set: 0, or 1 when the HTTP server ended by itself."""
        self.stop.wait()
        if self.http_died.is_set():
            log.error("HTTP server stopped unexpectedly; shutting down")
            return 1
        return 0

    def shutdown(self) -> None:
        log.info("shutting down")
        self.stop.set()
        self.workers.stop(self.SHUTDOWN_BOUND_S)
