"""A real webhook receiver for tests: `http.server` on a loopback port 0.

It records every POST (path, headers, parsed JSON, arrival time) and answers
with the statuses it is told, in order (the last one repeats). `hold` makes
it a slow receiver: each request waits on the event before answering.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    raw: bytes
    at: float  # time.time() when it arrived


@dataclass
class Receiver:
    url: str
    statuses: list[int]
    hold: threading.Event | None = None
    received: list[Received] = field(default_factory=list)
    arrived: int = 0  # requests read, answered or not
    answered: int = 0
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def next_status(self) -> int:
        with self._cond:
            i = min(self.answered, len(self.statuses) - 1)
            self.answered += 1
            return self.statuses[i]

    def arrive(self) -> None:
        with self._cond:
            self.arrived += 1
            self._cond.notify_all()

    def wait_arrived(self, n: int, timeout: float) -> None:
        end = time.monotonic() + timeout
        with self._cond:
            while self.arrived < n:
                left = end - time.monotonic()
                assert left > 0, f"webhook: {self.arrived} of {n} requests arrived in {timeout}s"
                self._cond.wait(left)

    def record(self, r: Received) -> None:
        with self._cond:
            self.received.append(r)
            self._cond.notify_all()

    def wait(self, pred: Callable[[list[Received]], bool], timeout: float) -> list[Received]:
        """Block until `pred(received)` holds; fail the test past `timeout`."""
        end = time.monotonic() + timeout
        with self._cond:
            while not pred(self.received):
                left = end - time.monotonic()
                assert left > 0, f"webhook: condition not met in {timeout}s; got {self.events()}"
                self._cond.wait(left)
            return list(self.received)

    def events(self) -> list[tuple[str, str]]:
        return [
            (r.body.get("event", ""), r.body.get("incident", {}).get("id", ""))
            for r in self.received
        ]


def _handler(rx: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n)
            rx.arrive()
            if rx.hold is not None:
                rx.hold.wait(60)
            status = rx.next_status()
            try:
                body = json.loads(raw)
            except ValueError:
                body = {}
            if 200 <= status < 300:
                rx.record(Received(self.path, dict(self.headers), body, raw, time.time()))
            self.send_response(status)
            if status == 429:
                self.send_header("Retry-After", "0")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the test reads `received`, not stderr

    return Handler


@contextlib.contextmanager
def receiver(
    statuses: Sequence[int] = (200,), *, hold: threading.Event | None = None, path: str = "/hook"
) -> Iterator[Receiver]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    server.daemon_threads = True
    rx = Receiver(
        url=f"http://127.0.0.1:{server.server_address[1]}{path}", statuses=list(statuses), hold=hold
    )
    server.RequestHandlerClass = _handler(rx)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield rx
    finally:
        if hold is not None:
            hold.set()
        server.shutdown()
        server.server_close()
        t.join(5)


def closed_port_url(path: str = "/hook") -> str:
    """A loopback URL nobody listens on: the port was bound, then released."""
    s = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = s.server_address[1]
    s.server_close()
    return f"http://127.0.0.1:{port}{path}"
