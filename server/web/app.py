"""The dashboard and HTTP API of the coordinator: `create_app(ctx)`.

Served by `hangwatch server` next to the gRPC endpoint. Everything the
browser loads comes from this app (/static), nothing from the internet, so
the dashboard works in an air-gapped cluster.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from hangwatch.server.app_state import ServerContext
from hangwatch.server.web import api, pages, security
from hangwatch.server.web.templating import STATIC

from hangwatch import __version__


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
    app.add_middleware(security.SecurityMiddleware, check=check, login_page=pages.login_html)
    return app
