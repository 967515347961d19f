"""Fallback FR endpoint: a daemon thread serving the worker-server handlers over a Unix socket.

Used only where torch lacks the C++ `_WorkerServer` (or when forced for tests).
It speaks just enough HTTP/1.1 for the agent's client: one POST per connection,
`Content-Length` on every answer, connection closed afterwards. Every handler
needs the GIL here, which is the price of having no C++ server: a rank that
holds the GIL in C answers nothing, and the agent falls back to py-spy.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import urllib.parse
from collections.abc import Callable

log = logging.getLogger("hangwatch.hook")

# Called with the request's query parameters (torch's handlers take e.g. ?backend=).
Handler = Callable[[dict[str, str]], tuple[int, bytes, str]]

# Bounded request size: the agent sends empty POST bodies.
_MAX_HEADER_BYTES = 16 * 1024
_CONN_TIMEOUT_S = 2.0


def dump_traceback_text() -> bytes:
    """All threads' Python stacks, as faulthandler prints them."""
    with tempfile.TemporaryFile() as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


def pyspy_dump_text(pyspy: str = "py-spy", timeout_s: float = 5.0) -> tuple[int, bytes]:
    exe = shutil.which(pyspy)
    if exe is None:
        return 500, f"{pyspy}: not found\n".encode()
    try:
        out = subprocess.run(
            [exe, "dump", "--pid", str(os.getpid())],
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return 504, b"py-spy timed out\n"
    return (200 if out.returncode == 0 else 500), out.stdout + out.stderr


class ThreadServer:
    """Serves `POST /handler/<name>` on a Unix socket from one daemon thread."""

    def __init__(self, path: str, handlers: dict[str, Handler]) -> None:
        self.path = path
        self._handlers = dict(handlers)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if os.path.exists(path):
            os.unlink(path)
        self._sock.bind(path)
        self._sock.listen(16)
        self._sock.settimeout(0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name="hangwatch-fr-endpoint", daemon=True
        )
        self._thread.start()

    def add_handler(self, name: str, handler: Handler) -> None:
        self._handlers[name] = handler

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                conn.settimeout(_CONN_TIMEOUT_S)
                self._answer(conn)
            except Exception as e:  # a bad client must never kill the endpoint
                log.debug("fallback endpoint: request failed: %s", e)
            finally:
                conn.close()

    def _answer(self, conn: socket.socket) -> None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = conn.recv(4096)
            if not chunk:
                return
            buf += chunk
            if len(buf) > _MAX_HEADER_BYTES:
                self._send(conn, 431, b"headers too large\n", "text/plain")
                return
        request_line = buf.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split()
        if len(parts) < 2:
            self._send(conn, 400, b"bad request\n", "text/plain")
            return
        method, _, query = parts[1].partition("?")
        method, target = parts[0], method
        params = {k: v[-1] for k, v in urllib.parse.parse_qs(query).items()}
        prefix = "/handler/"
        name = target[len(prefix) :] if target.startswith(prefix) else None
        if method != "POST" or name is None or name not in self._handlers:
            self._send(conn, 404, b"not found\n", "text/plain")
            return
        try:
            status, body, ctype = self._handlers[name](params)
        except Exception as e:
            status, body, ctype = 500, f"{type(e).__name__}: {e}\n".encode(), "text/plain"
        self._send(conn, status, body, ctype)

    @staticmethod
    def _send(conn: socket.socket, status: int, body: bytes, ctype: str) -> None:
        head = (
            f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        conn.sendall(head + body)
