"""The relay's HTTP port: /metrics for Prometheus, /healthz and /readyz for probes.

The coordinator counts what arrives from each relay (`hangwatch_relay_*`
there); only the relay knows what it took and never sent on: reports it
turned away because the coordinator read too slowly, reports it held when
its stream to the coordinator broke, agents it turned away while it had no
coordinator. "No report dropped" is checked here, not guessed.

- /metrics: the Prometheus text format, behind the token when the relay has
  one (as the coordinator's /metrics is): `Authorization: Bearer TOKEN`.
- /healthz: 200 while the relay's loop answers (a liveness probe).
- /readyz: 200 while its stream to the coordinator is up, 503 without it
  (agents are turned away then, and report to the coordinator directly).

Plain HTTP on the relay's `--host`, as the coordinator's dashboard port is:
put TLS in front of it where scrapes cross an untrusted network. The
counts are read on the relay's loop for each request (`Relay.stats`), so a
scrape never races the loop; the server runs on threads of its own, so a
slow scraper never holds the loop up.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Final

import prometheus_client
from hangwatch.server.relay_calls import CARRIED
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hangwatch.addresses import hostport

if TYPE_CHECKING:
    from hangwatch.server.relay import RelayStats

log = logging.getLogger("hangwatch.relay")

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
# Every family the relay exposes, once: (name, type, help, label).
FAMILIES: Final = (
    (
        "hangwatch_relay_connected",
        "gauge",
        "1 while the relay's stream to the coordinator is up.",
        "",
    ),
    ("hangwatch_relay_agent_streams", "gauge", "Agents' progress streams open at the relay.", ""),
    (
        "hangwatch_relay_pending_reports",
        "gauge",
        "Reports held for the next batch to the coordinator.",
        "",
    ),
    ("hangwatch_relay_reports_received", "counter", "Progress reports agents sent the relay.", ""),
    (
        "hangwatch_relay_reports_forwarded",
        "counter",
        "Progress reports the relay sent on to the coordinator.",
        "",
    ),
    (
        "hangwatch_relay_batches_forwarded",
        "counter",
        "ProgressBatch messages the relay sent to the coordinator.",
        "",
    ),
    (
        "hangwatch_relay_reports_not_forwarded",
        "counter",
        "Reports taken but never sent on, by reason: backlog (the coordinator read too"
        " slowly), upstream_lost (held when the stream to it broke), stopping. Their agents"
        " send in full on their next stream.",
        "reason",
    ),
    (
        "hangwatch_relay_agent_streams_ended",
        "counter",
        "Agents' streams the relay ended, by reason: no_coordinator, upstream_lost,"
        " backlog, stopping, unknown_session, invalid.",
        "reason",
    ),
    (
        "hangwatch_relay_upstream_failures",
        "counter",
        "Streams to the coordinator that failed to open or broke.",
        "",
    ),
    (
        "hangwatch_relay_command_watches",
        "gauge",
        "Agents' WatchCommands calls the relay holds.",
        "",
    ),
    (
        "hangwatch_relay_commands_forwarded",
        "counter",
        "Commands (dump requests) the relay passed to its agents.",
        "",
    ),
    (
        "hangwatch_relay_calls_carried",
        "counter",
        "Agents' calls other than progress and commands (Register, events, uploads,"
        " CompleteDump, clock exchanges) the relay carried to the coordinator, by method.",
        "method",
    ),
    (
        "hangwatch_relay_calls_failed",
        "counter",
        "Carried calls that failed at the coordinator or on the way, by gRPC status code."
        " After an UNAVAILABLE, UNIMPLEMENTED or DEADLINE_EXCEEDED one the agent calls"
        " the coordinator straight for a minute.",
        "code",
    ),
)
CARRIED_METHODS: Final = (*CARRIED, "Health")
# Codes shown from the start: those a relay's own trouble gives.
FAILED_CODES: Final = ("UNAVAILABLE", "DEADLINE_EXCEEDED")
NOT_FORWARDED_REASONS: Final = ("backlog", "upstream_lost", "stopping")
ENDED_REASONS: Final = (
    "no_coordinator",
    "upstream_lost",
    "backlog",
    "stopping",
    "unknown_session",
    "invalid",
)


class _Collector(Collector):
    def __init__(self, stats: Callable[[], RelayStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        single = {
            "hangwatch_relay_connected": float(s.connected),
            "hangwatch_relay_agent_streams": s.agent_streams,
            "hangwatch_relay_pending_reports": s.pending_reports,
            "hangwatch_relay_reports_received": s.reports_received,
            "hangwatch_relay_reports_forwarded": s.reports_forwarded,
            "hangwatch_relay_batches_forwarded": s.batches_forwarded,
            "hangwatch_relay_upstream_failures": s.upstream_failures,
            "hangwatch_relay_command_watches": s.command_watches,
            "hangwatch_relay_commands_forwarded": s.commands_forwarded,
        }
        # Every reason from the start, at 0: increase() over a series that
        # appears only with its first count misses that count.
        by_reason = {
            "hangwatch_relay_reports_not_forwarded": (NOT_FORWARDED_REASONS, s.not_forwarded),
            "hangwatch_relay_agent_streams_ended": (ENDED_REASONS, s.streams_ended),
            "hangwatch_relay_calls_carried": (CARRIED_METHODS, s.calls_carried),
            "hangwatch_relay_calls_failed": (FAILED_CODES, s.calls_failed),
        }
        for name, kind, help_text, label in FAMILIES:
            family: GaugeMetricFamily | CounterMetricFamily
            if kind == "gauge":
                family = GaugeMetricFamily(name, help_text, labels=[label] if label else None)
            else:
                family = CounterMetricFamily(name, help_text, labels=[label] if label else None)
            if label:
                reasons, counts = by_reason[name]
                for reason in (*reasons, *sorted(set(counts) - set(reasons))):
                    family.add_metric([reason], counts.get(reason, 0))
            else:
                family.add_metric([], single[name])
            yield family


class RelayHttp:
    """The relay's HTTP server on threads of its own (`start`, `stop`)."""

    def __init__(
        self, stats: Callable[[], RelayStats], *, host: str, port: int, token: str | None
    ) -> None:
        self._stats = stats
        self._host, self._port = host, port
        self._token = token
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_Collector(stats))
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        """Bind and serve; returns HOST:PORT. OSError when the port cannot be bound."""
        http = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                code, body, ctype = http._answer(self.path, self.headers.get("Authorization"))
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("http: " + format, *args)

        server = ThreadingHTTPServer((self._host, self._port), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name="hangwatch-relay-http", daemon=True
        )
        self._thread.start()
        return hostport(self._host, int(server.server_address[1]))

    def _answer(self, path: str, authorization: str | None) -> tuple[int, str, str]:
        path = path.split("?", 1)[0]
        text = "text/plain; charset=utf-8"
        if path == "/metrics":
            if self._token and not _bearer_ok(authorization, self._token):
                return 401, "missing or wrong bearer token\n", text
            try:
                body = prometheus_client.generate_latest(self._registry).decode()
            except RuntimeError as e:
                return 503, f"{e}\n", text
            return 200, body, CONTENT_TYPE
        if path in ("/healthz", "/readyz"):
            try:
                s = self._stats()
            except RuntimeError as e:
                return 503, f"{e}\n", text
            if path == "/readyz" and not s.connected:
                return 503, "no stream to the coordinator\n", text
            return 200, "ok\n", text
        return 404, "not found\n", text

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(5.0)


def _bearer_ok(header: str | None, token: str) -> bool:
    scheme, _, value = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        value.strip().encode(), token.encode()
    )
