"""Fixtures for dashboard tests: a real store on disk, a fed registry, uvicorn on port 0."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from hangwatch.server.app_state import ServerContext
from hangwatch.server.web.app import create_app

from tests.web import harness

TOKEN = "s3cret-token-for-tests"
JOB = "llama-70b"
WORLD = 64
STUCK = 37


@dataclass
class Served:
    base: str
    ctx: ServerContext
    incident: str
    sessions: dict[int, tuple[str, str]]
    client: httpx.Client


def _served(tmp: Path, *, token: str | None, hostile: bool) -> Iterator[Served]:
    ctx = harness.make_context(tmp, token=token)
    sessions = harness.feed_job(
        ctx.registry,
        job=JOB,
        world=WORLD,
        stuck=STUCK,
        group_desc=harness.HOSTILE_DESC if hostile else "default_pg",
    )
    report = harness.hang_report(world=WORLD, stuck=STUCK, hostile=hostile)
    incident = harness.insert_incident(ctx, job=JOB, report=report)
    try:
        with harness.serve(create_app(ctx)) as base, httpx.Client(base_url=base, timeout=10) as c:
            yield Served(base=base, ctx=ctx, incident=incident, sessions=sessions, client=c)
    finally:
        ctx.store.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    yield from _served(tmp_path, token=None, hostile=False)


@pytest.fixture
def served_hostile(tmp_path: Path) -> Iterator[Served]:
    yield from _served(tmp_path, token=None, hostile=True)


@pytest.fixture
def served_auth(tmp_path: Path) -> Iterator[Served]:
    yield from _served(tmp_path, token=TOKEN, hostile=False)
