"""The two stores the contract tests run against: a real SQLite file and a
real PostgreSQL server (the session's `pg`, tests/conftest.py), one database
per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hangwatch.server.incidents.store import IncidentStore

from tests.support.pgserver import PgServer

OpenStore = Callable[[], IncidentStore]


@pytest.fixture(params=["sqlite", "postgresql"])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenStore]:
    """Opens the test's store (again, each call: a reopen sees what was
    committed); every store it opened is closed at the end."""
    opened: list[IncidentStore] = []
    pg: PgServer | None = None if request.param == "sqlite" else request.getfixturevalue("pg")
    url = pg.new_database() if pg else None

    def _open() -> IncidentStore:
        s = IncidentStore.open(url, tmp_path / "data")
        opened.append(s)
        return s

    yield _open
    for s in opened:
        s.close()
