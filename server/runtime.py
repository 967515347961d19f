"""The coordinator process: gRPC and HTTP started, served and shut down as one.

`ServerRuntime(conf).start()` binds both ports (0 picks free ones), starts the
gRPC coordinator and the dashboard (uvicorn on its own thread, which installs
no signal handlers there: signals belong to the process's main loop), and
writes `<data_dir>/server.json`. `serve(stop)` returns when `stop` is set or
the HTTP server died; `shutdown()` is bounded: gRPC gets `GRPC_GRACE_S` to
finish calls in flight, HTTP `HTTP_GRACE_S` to close.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Final

from hangwatch.server.coordinator import Coordinator, hostport

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
    def __init__(self, conf: Config) -> None:
        self.conf = conf
        self.coord: Coordinator | None = None
        self.info: ServerInfo | None = None
        self._http_sock: socket.socket | None = None
        self._uv: Any = None
        self._http_thread: threading.Thread | None = None

    def start(self) -> ServerInfo:
        conf = self.conf
        try:
            self._http_sock = bind_http(conf.host, conf.http_port)
        except OSError as e:
            raise StartError(
                f"cannot bind HTTP on {hostport(conf.host, conf.http_port)}: {e}"
            ) from e
        if conf.grpc_port:
            # Probe the gRPC port the way the HTTP one is bound: taken, it is one
            # clean line, before gRPC's core logs its own and before the data
            # directory is created for a server that never ran.
            try:
                bind_http(conf.host, conf.grpc_port).close()
            except OSError as e:
                self._http_sock.close()
                raise StartError(
                    f"cannot bind gRPC on {hostport(conf.host, conf.grpc_port)}: {e}"
                ) from e
        coord = Coordinator(conf)
        try:
            coord.start()
        except Exception as e:
            self._http_sock.close()
            raise StartError(
                f"cannot start gRPC on {hostport(conf.host, conf.grpc_port)}: {e}"
            ) from e
        self.coord = coord

        import uvicorn
        from hangwatch.server.web.app import create_app

        http_address = "http://" + hostport(conf.host, self._http_sock.getsockname()[1])
        coord.context.http_address = http_address
        coord.service.dashboard_url = http_address
        self._uv = uvicorn.Server(
            uvicorn.Config(
                create_app(coord.context),
                log_level=conf.log_level.lower(),
                access_log=False,
                lifespan="on",
            )
        )
        self._http_thread = threading.Thread(
            target=self._uv.run,
            kwargs={"sockets": [self._http_sock]},
            name="hangwatch-http",
            daemon=True,
        )
        self._http_thread.start()
        self.info = ServerInfo(
            grpc=coord.grpc_address, http=http_address, pid=os.getpid(), started_unix=time.time()
        )
        self.info.write(coord.data_dir)
        return self.info

    def serve(self, stop: threading.Event) -> int:
        """Block until `stop` is set (0) or the HTTP server stopped by itself (1)."""
        assert self._http_thread is not None, "start() first"
        while not stop.wait(0.5):
            if not self._http_thread.is_alive():
                log.error("HTTP server stopped unexpectedly; shutting down")
                return 1
        return 0

    def shutdown(self) -> None:
        log.info("shutting down")
        if self._uv is not None:
            self._uv.should_exit = True
        if self.coord is not None:
            self.coord.stop(grace=GRPC_GRACE_S)
        if self._http_thread is not None:
            self._http_thread.join(HTTP_GRACE_S)
        if self._http_sock is not None:
            self._http_sock.close()
