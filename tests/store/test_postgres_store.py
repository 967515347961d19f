"""The PostgreSQL store's own promises, against a real server: its password
never travels in the URL, and a database that refuses writes (read-only, a
restart) says so clearly, in a way the coordinator waits out, and loses nothing."""

from __future__ import annotations

import argparse
import os
import pwd
import secrets
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from hangwatch.server.incidents.store import IncidentStore, disk_full

from hangwatch.config import Config, add_arguments, for_command
from tests.hardening.util import tmpfs
from tests.support.pgserver import PG_USER, PgServer


def _args(*argv: str) -> argparse.Namespace:
    """The server's real flags, parsed."""
    p = argparse.ArgumentParser()
    add_arguments(p, "server")
    return p.parse_args(list(argv))


@pytest.mark.timeout(30)
def test_a_store_url_with_a_password_is_refused_without_repeating_it(tmp_path: Path) -> None:
    for url in ("postgresql://hw:s3cret@db:5432/hw", "postgresql://hw@db/hw?password=s3cret"):
        with pytest.raises(ValueError, match="must not carry a password") as e:
            Config.of(store=url).validate("server")
        assert "s3cret" not in str(e.value)
        with pytest.raises(ValueError, match="must not carry a password") as e:
            IncidentStore.open(url, tmp_path)
        assert "s3cret" not in str(e.value)
    with pytest.raises(ValueError, match="postgresql://"):
        Config.of(store="mysql://db/hw").validate("server")
    Config.of(store="postgresql://hw@db:5432/hw").validate("server")


@pytest.mark.timeout(60)
def test_the_password_comes_from_a_file_or_the_environment(pg: PgServer, tmp_path: Path) -> None:
    url = pg.new_database()
    db = url.rsplit("/", 1)[1]
    pg.sql("CREATE ROLE hw_pw LOGIN PASSWORD 'pw-from-file'")
    pg.sql(f"GRANT ALL ON DATABASE {db} TO hw_pw")
    pg.sql("GRANT ALL ON SCHEMA public TO hw_pw", db)
    # This role, and only it, must give its password over TCP.
    hba = pg.data / "pg_hba.conf"
    hba.write_text("host all hw_pw 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
    pg.pg_ctl("reload")
    role_url = url.replace(f"//{pg.user}@", "//hw_pw@")

    with pytest.raises(
        RuntimeError, match=r"cannot open the incident store .*: cannot reach it"
    ) as e:
        IncidentStore.open(role_url, tmp_path, password="wrong-one")
    assert "wrong-one" not in str(e.value)

    pw_file = tmp_path / "store-password"
    pw_file.write_text("pw-from-file\n")
    conf = for_command(
        "server", _args("--store", role_url, "--store-password-file", str(pw_file)), {}
    )
    store = IncidentStore.open(
        conf.serve.store, tmp_path, password=conf.serve.resolved_store_password()
    )
    store.create_incident(job_id="j", reason="r", trigger="stall", ranks_expected=[0])
    store.close()
    # The environment wins over the file, as for the token.
    pg.sql("ALTER ROLE hw_pw PASSWORD 'pw-from-env'")
    env = {"HANGWATCH_STORE": role_url, "HANGWATCH_STORE_PASSWORD": "pw-from-env"}
    conf = for_command("server", _args("--store-password-file", str(pw_file)), env)
    store = IncidentStore.open(
        conf.serve.store, tmp_path, password=conf.serve.resolved_store_password()
    )
    assert len(store.list_incidents()) == 1
    store.close()


@pytest.mark.realtime
@pytest.mark.timeout(60)
def test_a_read_only_database_refuses_clearly_and_loses_nothing(
    pg: PgServer, tmp_path: Path
) -> None:
    """As after a failover to a read-only standby: the sessions are cut, the new
    ones are read-only. A write fails with an error the coordinator waits out
    (`disk_full`), what was stored stays readable, and writes resume once the
    database takes them again."""
    url = pg.new_database()
    db = url.rsplit("/", 1)[1]
    store = IncidentStore.open(url, tmp_path)
    a = store.create_incident(job_id="j", reason="r", trigger="stall", ranks_expected=[0])

    def cut_sessions() -> None:
        pg.sql(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{db}' AND pid <> pg_backend_pid()"
        )

    pg.sql(f"ALTER DATABASE {db} SET default_transaction_read_only = on")
    cut_sessions()
    with pytest.raises(psycopg.errors.ReadOnlySqlTransaction) as e:
        store.create_incident(job_id="j", reason="r2", trigger="stall", ranks_expected=[0])
    assert disk_full(e.value)
    assert "read-only transaction" in str(e.value)
    with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        store.fail_incident(a.id, error="x")
    assert [r.id for r in store.list_incidents()] == [a.id]
    assert store.get_incident(a.id).status == "collecting"  # type: ignore[union-attr]

    pg.sql(f"ALTER DATABASE {db} SET default_transaction_read_only = off")
    cut_sessions()
    b = store.create_incident(job_id="j", reason="r2", trigger="stall", ranks_expected=[0])
    assert [r.id for r in store.list_incidents()] == [b.id, a.id]
    store.close()


@pytest.mark.realtime
@pytest.mark.timeout(90)
def test_a_server_restart_costs_no_store_and_no_row(pg: PgServer, tmp_path: Path) -> None:
    """The pool finds its dropped connections when it hands them out and
    reconnects (1 s back-off, doubling): the store object outlives a restart,
    and a write tried again, as the coordinator does, gets through."""
    url = pg.new_database()
    store = IncidentStore.open(url, tmp_path)
    a = store.create_incident(job_id="j", reason="r", trigger="stall", ranks_expected=[0])
    pg.stop()
    try:
        with pytest.raises(psycopg.OperationalError) as e:
            store.create_incident(job_id="j", reason="r", trigger="stall", ranks_expected=[0])
        assert disk_full(e.value)
    finally:
        pg.start()
    deadline = time.monotonic() + 60
    while True:
        try:
            b = store.create_incident(job_id="j", reason="r", trigger="stall", ranks_expected=[0])
            break
        except Exception as err:
            assert disk_full(err) and time.monotonic() < deadline, err
            time.sleep(0.5)
    assert [r.id for r in store.list_incidents()] == [b.id, a.id]
    store.close()


@pytest.mark.timeout(60)
def test_hangwatch_server_refuses_a_store_it_cannot_use_in_one_line(tmp_path: Path) -> None:
    """The real CLI: no traceback, exit 2, the password never printed."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = [sys.executable, "-m", "hangwatch", "server", "--grpc-port", "0", "--http-port", "0"]
    for url, said in (
        (f"postgresql://hw@127.0.0.1:{port}/hw", "cannot open the incident store"),
        (f"postgresql://hw:s3cret@127.0.0.1:{port}/hw", "must not carry a password"),
    ):
        p = subprocess.run(
            [*base, "--data-dir", str(tmp_path / "data"), "--store", url],
            capture_output=True,
            text=True,
            timeout=50,
            check=False,
        )
        assert p.returncode == 2, p.stderr
        assert p.stderr.startswith("hangwatch server: ") and said in p.stderr, p.stderr
        assert "Traceback" not in p.stderr and "s3cret" not in p.stderr + p.stdout


@pytest.mark.realtime
@pytest.mark.timeout(120)
def test_a_full_database_refuses_clearly_and_loses_nothing(pg: PgServer, tmp_path: Path) -> None:
    """The database's tablespace on a small tmpfs, filled to the last byte: a
    write fails with PostgreSQL's disk-full error (SQLSTATE 53100), which the
    coordinator waits out (`disk_full`); what was stored stays readable; room
    made, writes go through again."""
    tag = uuid.uuid4().hex[:12]
    # Under the server's own directory: the postgres user cannot reach tmp_path.
    mnt = tmpfs(pg.root / f"ts-{tag}", 32 << 20)
    db = f"t_full_{tag}"
    store: IncidentStore | None = None
    try:
        space = mnt.path / "pg"
        space.mkdir()
        if os.geteuid() == 0:
            owner = pwd.getpwnam(PG_USER)
            os.chown(space, owner.pw_uid, owner.pw_gid)
        pg.sql(f"CREATE TABLESPACE ts_{tag} LOCATION '{space}'")
        pg.sql(f"CREATE DATABASE {db} TABLESPACE ts_{tag}")
        store = IncidentStore.open(pg.url(db), tmp_path / "data")
        kept = store.create_incident(job_id="j", reason="r", trigger="stall", ranks_expected=[0])
        mnt.fill(leave_bytes=0)
        with pytest.raises(psycopg.OperationalError) as e:
            for _ in range(10_000):  # each row a few KB that do not compress
                row = store.create_incident(
                    job_id="j", reason=secrets.token_hex(4096), trigger="stall", ranks_expected=[0]
                )
        assert e.value.sqlstate == "53100", e.value
        assert disk_full(e.value)
        assert store.get_incident(kept.id) is not None
        stored = store.list_incidents(limit=100_000)
        assert kept.id in {r.id for r in stored}
        mnt.free()
        row = store.create_incident(job_id="j", reason="r", trigger="stall", ranks_expected=[0])
        assert len(store.list_incidents(limit=100_000)) == len(stored) + 1
        assert row.id == store.list_incidents(limit=1)[0].id
    finally:
        if store is not None:
            store.close()
        pg.sql(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        pg.sql(f"DROP TABLESPACE IF EXISTS ts_{tag}")
        mnt.unmount()
