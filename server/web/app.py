"""The dashboard and HTTP API of the coordinator: `create_app(ctx)`.

Served by `hangwatch server` next to the gRPC endpoint. Everything the
browser loads comes from this app (/static), nothing from the internet, so
the dashboard works in an air-gapped cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from hangwatch.server.app_state import ServerContext
from hangwatch.server.incidents.store import disk_full, refusal
from hangwatch.server.web import api, pages, security
from hangwatch.server.web.templating import STATIC

from hangwatch import __version__

log = logging.getLogger(__name__)

# How soon a client may ask again when the store was out of reach: the
# coordinator retries its own writes this often (manager.DISK_FULL_RETRY_S).
RETRY_AFTER_S = 5


async def store_unavailable(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    """A read the incident store could not answer (a PostgreSQL restart, a
    failover) is a 503 that says so and when to ask again, not a 500."""
    try:
        return await call_next(request)
    except Exception as e:
        if not disk_full(e):
            raise
        log.warning("%s %s: %s: %s", request.method, request.url.path, refusal(e), e)
        return JSONResponse(
            {"detail": f"the incident store is unavailable, try again: {refusal(e)}"},
            status_code=503,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


def create_app(ctx: ServerContext) -> FastAPI:
    """Build the app. Resolves the token once, so a bad token file fails here, loudly."""
    check = security.TokenCheck(ctx.config.auth.resolved_token())
    app = FastAPI(
        title="hangwatch",
        version=__version__,
        description=(
            "Live progress of distributed PyTorch jobs and the incidents hangwatch "
            "diagnosed. With a token configured, send `Authorization: Bearer <token>`."
        ),
        # Swagger UI would fetch its assets from a CDN; /docs is rendered here instead.
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.ctx = ctx
    app.state.token_check = check
    app.include_router(api.router)
    app.include_router(pages.router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.middleware("http")(store_unavailable)
    app.add_middleware(security.SecurityMiddleware, check=check, login_page=pages.login_html)
    return app
