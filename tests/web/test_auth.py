"""Token auth: every page and API route is closed without the token; probes stay open."""

from __future__ import annotations

import httpx
import pytest
from hangwatch.server.web import security

from tests.web.conftest import JOB, TOKEN, Served

pytestmark = pytest.mark.timeout(30)


def _closed_paths(s: Served) -> list[str]:
    return [
        "/",
        f"/jobs/{JOB}",
        "/incidents",
        f"/incidents/{s.incident}",
        f"/incidents/{s.incident}/report.html",
        "/docs",
        "/openapi.json",
        "/metrics",
        "/api/jobs",
        f"/api/jobs/{JOB}/ranks",
        "/api/incidents",
        f"/api/incidents/{s.incident}",
        f"/api/incidents/{s.incident}/bundle",
        "/api/incidents/does-not-exist",  # no existence oracle without the token
    ]


def test_no_token_is_401_everywhere(served_auth: Served) -> None:
    c = served_auth.client
    for path in _closed_paths(served_auth):
        r = c.get(path)
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert TOKEN not in r.text


def test_wrong_token_is_401(served_auth: Served) -> None:
    c = served_auth.client
    for value in (f"Bearer {TOKEN}x", "Bearer", f"Basic {TOKEN}", TOKEN, f"Bearer {TOKEN[:-1]}"):
        for path in _closed_paths(served_auth):
            assert c.get(path, headers={"Authorization": value}).status_code == 401, (path, value)
    bad_cookie = {"Cookie": f"{security.COOKIE}={TOKEN}"}  # the raw token is not a session
    assert c.get("/api/jobs", headers=bad_cookie).status_code == 401


def test_right_token_is_200(served_auth: Served) -> None:
    c = served_auth.client
    for scheme in ("Bearer", "bearer"):
        headers = {"Authorization": f"{scheme} {TOKEN}"}
        for path in _closed_paths(served_auth):
            r = c.get(path, headers=headers)
            expected = 404 if path.endswith("does-not-exist") else 200
            assert r.status_code == expected, path
            assert TOKEN not in r.text, f"token leaked into {path}"


def test_probes_and_static_stay_open(served_auth: Served) -> None:
    c = served_auth.client
    assert c.get("/healthz").status_code == 200
    assert c.get("/readyz").status_code == 200
    assert c.get("/static/app.css").status_code == 200
    assert c.get("/login").status_code == 200


def test_browser_gets_login_form_and_cookie(served_auth: Served) -> None:
    c = served_auth.client
    page = c.get(f"/incidents/{served_auth.incident}", headers={"Accept": "text/html"})
    assert page.status_code == 401
    assert '<form class="login" method="post" action="/login">' in page.text
    assert f'name="next" value="/incidents/{served_auth.incident}"' in page.text

    wrong = c.post("/login", data={"token": "nope", "next": "/"}, follow_redirects=False)
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers

    ok = c.post(
        "/login",
        data={"token": TOKEN, "next": f"/incidents/{served_auth.incident}"},
        follow_redirects=False,
    )
    assert ok.status_code == 303
    assert ok.headers["location"] == f"/incidents/{served_auth.incident}"
    cookie = ok.headers["set-cookie"]
    assert cookie.startswith(f"{security.COOKIE}=")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    assert TOKEN not in cookie  # an HMAC of the token, never the token
    value = cookie.split(";")[0].split("=", 1)[1]
    with httpx.Client(base_url=served_auth.base, cookies={security.COOKIE: value}) as b:
        r = b.get(f"/incidents/{served_auth.incident}")
        assert r.status_code == 200 and "never entered" in r.text
        assert 'action="/logout"' in r.text
        assert b.get("/api/jobs").status_code == 200  # the page's own polling works
        out = b.post("/logout", follow_redirects=False)
        assert out.status_code == 303 and f"{security.COOKIE}=" in out.headers["set-cookie"]


def test_login_never_redirects_off_site(served_auth: Served) -> None:
    c = served_auth.client
    for target in ("//evil.example/x", "https://evil.example/", "\\\\evil", "javascript:alert(1)"):
        r = c.post("/login", data={"token": TOKEN, "next": target}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/", target


def test_token_check_accepts_only_the_token_or_its_session() -> None:
    check = security.TokenCheck("abc")
    assert check.bearer_ok("abc") and not check.bearer_ok("abd") and not check.bearer_ok("")
    assert check.session_ok(security.session_value("abc"))
    assert not check.session_ok("abc")
    off = security.TokenCheck(None)
    assert not off.enabled and off.request_ok({}) == (True, False)
