"""Webhook notifications: every incident change, POSTed as JSON to each `--notify-url`.

    {"schema": "hangwatch.notification/1", "event": "incident.analyzed",
     "incident": {<an item of GET /api/incidents>, "url": "<its dashboard page>"},
     "text": "<one line for people>"}

`text` is what a Slack-style incoming webhook shows. The events are
`incident.opened`, `incident.analyzed`, `incident.resolved`, `incident.ended`
and `incident.failed` (`EVENTS`); other parts of the coordinator publish
their own with `Notifier.publish(event, item)`: `straggler`, `incident.action`,
`host.repeat-offender` (server/integrations/offenders.py).

Delivery never holds up detection or collection: `publish` only appends to a
bounded queue per webhook (the oldest is dropped, and counted, when one is
full), and each webhook has its own thread, so one that is down or slow
delays nobody else. A failed POST is retried with exponential back-off
(connection errors, timeouts, 408, 429 and 5xx); any other answer is final.
Redirects are not followed: the body would go to an address nobody
configured. Credentials in a URL (`https://user:secret@host/...`) are sent
as HTTP basic auth; logs name a webhook by number and scheme://host:port
only, since its path and query are often the secret itself (Slack's are).
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import random
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from hangwatch.server.incidents.store import IncidentRow, IncidentStatus
from hangwatch.server.integrations.metrics import Metrics

from hangwatch import __version__

log = logging.getLogger(__name__)

SCHEMA: Final = "hangwatch.notification/1"
# Incident status -> the event its change publishes.
EVENTS: Final = {
    IncidentStatus.COLLECTING: "incident.opened",
    IncidentStatus.ANALYZED: "incident.analyzed",
    IncidentStatus.RESOLVED: "incident.resolved",
    IncidentStatus.ENDED: "incident.ended",
    IncidentStatus.FAILED: "incident.failed",
}
MAX_TEXT: Final = 1000  # characters: chat webhooks truncate or refuse longer lines
RETRY_STATUSES: Final = frozenset({408, 429})


@dataclass(frozen=True, kw_only=True)
class Policy:
    max_queue: int = 1000  # per webhook; the oldest is dropped past it
    timeout_s: float = 5.0  # per POST: connect plus answer
    attempts: int = 6  # POSTs per notification, the first included
    backoff_s: float = 0.5  # before the first retry; doubled each time
    backoff_max_s: float = 30.0
    drain_s: float = 2.0  # at shutdown, for what is already queued


@dataclass(frozen=True, kw_only=True)
class Notification:
    event: str
    incident: dict[str, Any]
    text: str
    published: float  # time.monotonic() when it was published

    def body(self) -> bytes:
        doc = {"schema": SCHEMA, "event": self.event, "incident": self.incident, "text": self.text}
        return json.dumps(doc, sort_keys=True).encode("utf-8")


@dataclass(frozen=True, kw_only=True)
class Target:
    """A webhook as it is sent to (credentials split off) and as logs name it."""

    url: str  # without userinfo
    authorization: str | None  # "Basic ..." from the URL's userinfo
    label: str  # "#N scheme://host:port": never the path, query or credentials

    @classmethod
    def parse(cls, url: str, index: int) -> Target:
        p = urllib.parse.urlsplit(url)
        host = p.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        if p.port is not None:
            netloc += f":{p.port}"
        auth = None
        if p.username is not None or p.password is not None:
            user = urllib.parse.unquote(p.username or "")
            pw = urllib.parse.unquote(p.password or "")
            auth = "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode("ascii")
        bare = urllib.parse.urlunsplit((p.scheme, netloc, p.path or "/", p.query, ""))
        return cls(url=bare, authorization=auth, label=f"#{index} {p.scheme}://{netloc}")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urllib then raises the 3xx as an HTTPError


_OPENER: Final = urllib.request.build_opener(_NoRedirect)


class Notifier:
    """Fans notifications out to webhooks; `start`, `publish` from any thread, `stop`."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        metrics: Metrics,
        link: Callable[[str], str],
        policy: Policy | None = None,
    ) -> None:
        self.metrics = metrics
        self.link = link  # incident id -> its dashboard URL
        self.policy = policy or Policy()
        self._stop = threading.Event()
        self._workers = [_Worker(Target.parse(u, i), self) for i, u in enumerate(urls, start=1)]

    @property
    def targets(self) -> list[Target]:
        return [w.target for w in self._workers]

    def start(self) -> None:
        for w in self._workers:
            w.thread.start()

    def threads(self) -> list[threading.Thread]:
        """One delivery thread per webhook."""
        return [w.thread for w in self._workers]

    def stop(self, bound_s: float | None = None) -> None:
        """Give queued notifications `drain_s` in all (less when the caller's
        bound is shorter), then drop (and count) the rest."""
        drain = self.policy.drain_s if bound_s is None else min(self.policy.drain_s, bound_s)
        end = time.monotonic() + drain
        for w in self._workers:
            w.close()
        for w in self._workers:
            if w.thread.is_alive():
                w.thread.join(max(0.0, end - time.monotonic()))
        self._stop.set()  # cuts short a back-off or a drain past its time
        for w in self._workers:
            w.wake()
            # A POST in flight cannot be interrupted; its daemon thread ends with it.
            w.thread.join(0.5)
            w.drop_all()

    def publish(self, event: str, item: Mapping[str, Any], *, text: str | None = None) -> None:
        """Queue `event` about `item` (an incident as GET /api/incidents lists it,
        or any JSON object with an `id`). Never blocks on the network, never raises."""
        if not self._workers:
            return
        try:
            incident = dict(item)
            if "id" in incident and "url" not in incident:
                incident["url"] = self.link(str(incident["id"]))
            n = Notification(
                event=event,
                incident=incident,
                text=_clip(text or summary_line(event, incident)),
                published=time.monotonic(),
            )
            n.body()  # refuse what cannot be sent here, not on the worker
        except Exception:
            log.exception("notification %s could not be built", event)
            self.metrics.inc("hangwatch_notifications_total", labels=_outcome(event, "failed"))
            return
        for w in self._workers:
            w.put(n)

    def publish_incident(self, row: IncidentRow) -> None:
        """The store's status listener: one event per change of an incident's status."""
        event = EVENTS.get(row.status)
        if event is not None:
            item = row.summary_fields()
            self.publish(event, item, text=incident_line(event, row, self.link(row.id)))

    def queued(self) -> int:
        return sum(w.depth() for w in self._workers)

    def _gauge(self) -> None:
        self.metrics.set("hangwatch_notification_queue", self.queued())


class _Worker:
    """One webhook's queue and the thread that delivers it, in order."""

    def __init__(self, target: Target, owner: Notifier) -> None:
        self.target = target
        self.owner = owner
        self._cond = threading.Condition()
        self._queue: collections.deque[Notification] = collections.deque()
        self._closed = False
        self._inflight = False
        self.thread = threading.Thread(
            target=self._run, name=f"hangwatch-notify-{target.label.split()[0]}", daemon=True
        )

    def put(self, n: Notification) -> None:
        dropped: Notification | None = None
        with self._cond:
            if self._closed:
                dropped = n
            else:
                if len(self._queue) >= self.owner.policy.max_queue:
                    dropped = self._queue.popleft()
                self._queue.append(n)
                self._cond.notify()
        if dropped is not None:
            self._count(dropped, "dropped")
            log.warning(
                "notification %s to %s dropped: its queue is full or closed",
                dropped.event,
                self.target.label,
            )
        self.owner._gauge()

    def depth(self) -> int:
        """Waiting or being delivered."""
        with self._cond:
            return len(self._queue) + int(self._inflight)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def drop_all(self) -> None:
        with self._cond:
            left = list(self._queue)
            self._queue.clear()
        for n in left:
            self._count(n, "dropped")
        if left:
            log.warning(
                "%d notification(s) to %s dropped at shutdown", len(left), self.target.label
            )
        self.owner._gauge()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue or self.owner._stop.is_set():
                    return
                n = self._queue.popleft()
                self._inflight = True
            try:
                outcome = self._deliver(n)
            except Exception:  # a bug here must not kill the webhook's thread
                log.exception("notification %s to %s: delivery failed", n.event, self.target.label)
                outcome = "failed"
            with self._cond:
                self._inflight = False
            self._count(n, outcome)
            self.owner._gauge()

    def _deliver(self, n: Notification) -> str:
        policy = self.owner.policy
        body = n.body()
        delay = policy.backoff_s
        for attempt in range(1, policy.attempts + 1):
            status, why, retry_after = self._post(body)
            if status is not None and 200 <= status < 300:
                self.owner.metrics.observe(
                    "hangwatch_notification_delivery_seconds", time.monotonic() - n.published
                )
                return "delivered"
            transient = status is None or status in RETRY_STATUSES or status >= 500
            if not transient or attempt == policy.attempts:
                log.warning(
                    "notification %s to %s failed after %d attempt(s): %s",
                    n.event,
                    self.target.label,
                    attempt,
                    why,
                )
                return "failed"
            wait = min(policy.backoff_max_s, max(delay, retry_after or 0.0))
            log.info(
                "notification %s to %s: %s; retrying in %.1fs (attempt %d of %d)",
                n.event,
                self.target.label,
                why,
                wait,
                attempt + 1,
                policy.attempts,
            )
            self.owner.metrics.inc("hangwatch_notification_retries_total")
            # Jitter keeps many coordinators from retrying a shared receiver in step.
            if self.owner._stop.wait(wait * random.uniform(0.8, 1.0)):
                return "dropped"
            delay *= 2
        return "failed"

    def _post(self, body: bytes) -> tuple[int | None, str, float | None]:
        """(HTTP status or None, why it failed, Retry-After seconds): never raises."""
        headers = {
            "Content-Type": "application/json",
            "User-Agent": f"hangwatch/{__version__}",
        }
        if self.target.authorization:
            headers["Authorization"] = self.target.authorization
        req = urllib.request.Request(self.target.url, data=body, headers=headers, method="POST")
        try:
            with _OPENER.open(req, timeout=self.owner.policy.timeout_s) as resp:
                resp.read(65536)
                return int(resp.status), f"HTTP {resp.status}", None
        except urllib.error.HTTPError as e:
            with e:
                return e.code, f"HTTP {e.code}", _retry_after(e.headers.get("Retry-After"))
        except urllib.error.URLError as e:
            return None, _reason(e.reason), None
        except TimeoutError:
            return None, f"no answer within {self.owner.policy.timeout_s:g}s", None
        except (OSError, ValueError) as e:
            return None, _reason(e), None

    def _count(self, n: Notification, outcome: str) -> None:
        self.owner.metrics.inc("hangwatch_notifications_total", labels=_outcome(n.event, outcome))


def _outcome(event: str, outcome: str) -> dict[str, str]:
    return {"event": event, "outcome": outcome}


def _reason(e: object) -> str:
    """An error without any URL in it: only the exception's type and errno text."""
    if isinstance(e, OSError) and e.strerror:
        return f"{type(e).__name__}: {e.strerror}"
    if isinstance(e, TimeoutError | socket.timeout):
        return "timed out"
    return type(e).__name__


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None  # an HTTP date: the back-off applies


def _clip(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MAX_TEXT else line[: MAX_TEXT - 1] + "…"


def summary_line(event: str, item: Mapping[str, Any]) -> str:
    """A line for any published item: its event, its job and id, its summary."""
    job = item.get("job") or item.get("job_id") or "?"
    what = item.get("summary") or item.get("reason") or ""
    line = f"[hangwatch] {event} job {job}, incident {item.get('id', '?')}"
    line = f"{line}: {what}" if what else line
    url = item.get("url")
    return f"{line} {url}" if url else line


def incident_line(event: str, row: IncidentRow, url: str) -> str:
    """The one-line summary people read in chat, for an incident's own events."""
    head = f"[hangwatch] job {row.job_id}"
    if event == "incident.opened":
        body = f"incident opened ({row.trigger}): {row.reason}"
    elif event == "incident.analyzed":
        body = f"{row.verdict}: {row.summary or ''}".strip()
    elif event == "incident.resolved":
        body = f"resolved: {row.close_reason or 'progress resumed'}"
    elif event == "incident.ended":
        body = f"ended unresolved: {row.close_reason or 'the job stopped'}"
    else:
        body = "analysis failed; the bundle is kept for hangwatch analyze"
    return f"{head}: {body} {url}"


def dashboard_base(public_url: str | None, http_address: str) -> str:
    """Where people open the dashboard: --public-url, else the bound address,
    with this host's name for a wildcard bind (0.0.0.0 or ::)."""
    if public_url:
        return public_url.rstrip("/")
    p = urllib.parse.urlsplit(http_address)
    if p.hostname in ("0.0.0.0", "::"):
        port = f":{p.port}" if p.port else ""
        return f"{p.scheme}://{socket.getfqdn()}{port}"
    return http_address.rstrip("/")
