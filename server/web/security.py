"""Bearer-token auth and the security headers every response carries.

With a token configured, every page and API route needs either
`Authorization: Bearer <token>` or the session cookie that the login form sets.
The cookie holds an HMAC of the token, not the token itself, so a leaked
browser profile does not hand out the credential agents use for gRPC.
Liveness/readiness probes and the static assets stay open: they reveal nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from http.cookies import SimpleCookie
from typing import Any

COOKIE = "hangwatch_session"
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/login"})
OPEN_PREFIXES = ("/static/",)

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-opener-policy", b"same-origin"),
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def session_value(token: str) -> str:
    return hmac.new(token.encode(), b"hangwatch.web.session/1", hashlib.sha256).hexdigest()


class TokenCheck:
    """Constant-time checks of a presented bearer token or session cookie."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        self._token_b = token.encode() if token else b""
        self._session_b = session_value(token).encode() if token else b""

    @property
    def enabled(self) -> bool:
        return self.token is not None

    def bearer_ok(self, presented: str) -> bool:
        return bool(self._token_b) and hmac.compare_digest(presented.encode(), self._token_b)

    def session_ok(self, presented: str) -> bool:
        return bool(self._session_b) and hmac.compare_digest(presented.encode(), self._session_b)

    def request_ok(self, headers: dict[bytes, bytes]) -> tuple[bool, bool]:
        """(authorised, by_cookie)."""
        if not self.enabled:
            return True, False
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and self.bearer_ok(value.strip()):
            return True, False
        cookie = headers.get(b"cookie", b"").decode("latin-1")
        if cookie:
            jar: SimpleCookie = SimpleCookie()
            try:
                jar.load(cookie)
            except Exception:  # malformed cookie header: treat as absent
                return False, False
            morsel = jar.get(COOKIE)
            if morsel is not None and self.session_ok(morsel.value):
                return True, True
        return False, False


def safe_next(path: str | None) -> str:
    """Only same-site absolute paths: never `//host` or a scheme (open redirect)."""
    if not path or not path.startswith("/") or path.startswith("//") or "\\" in path:
        return "/"
    return path


def _is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


def _wants_html(path: str, headers: dict[bytes, bytes]) -> bool:
    if path.startswith("/api/") or path in ("/metrics", "/openapi.json"):
        return False
    return b"text/html" in headers.get(b"accept", b"")


class SecurityMiddleware:
    """Pure ASGI (no buffering of streamed bundles): auth gate plus headers."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        check: TokenCheck,
        login_page: Callable[[str, str], str],
    ) -> None:
        self.app = app
        self.check = check
        self.login_page = login_page

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {k.lower() for k, _ in headers}
                headers.extend(h for h in SECURITY_HEADERS if h[0] not in present)
                message["headers"] = headers
            await send(message)

        path: str = scope.get("path", "/")
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        ok, by_cookie = self.check.request_ok(headers)
        scope.setdefault("state", {})["hangwatch_cookie_auth"] = by_cookie
        if ok or _is_open(path):
            await self.app(scope, receive, send_with_headers)
            return

        if _wants_html(path, headers):
            query = scope.get("query_string", b"").decode("latin-1")
            target = path + (f"?{query}" if query else "")
            body = self.login_page(safe_next(target), "Log in to see this page.").encode()
            ctype = b"text/html; charset=utf-8"
        else:
            body = json.dumps({"detail": "missing or invalid bearer token"}).encode()
            ctype = b"application/json"
        await send_with_headers(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", ctype),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b'Bearer realm="hangwatch"'),
                    (b"cache-control", b"no-store"),
                ],
            }
        )
        await send_with_headers({"type": "http.response.body", "body": body})
