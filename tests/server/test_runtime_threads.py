"""The server's runtime owns every thread it starts: declared, ordered, stopped under one bound.

A real `ServerRuntime` (gRPC, HTTP, SQLite) on port 0; agents register over
real gRPC and a stall opens an incident that is collected, analysed in the
capped analyzer process and published, so the lazily started pools exist too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from hangwatch.server.runtime import ServerRuntime
from hangwatch.server.workers import Worker, Workers

from hangwatch.wire import rpc

from .conftest import ProtocolAgent, make_config, wait_for

# Threads a library starts once per process and keeps: not the runtime's to stop.
LIBRARY_THREADS = {
    # grpc.aio's completion-queue poller (cygrpc PollerCompletionQueue), started
    # with the first aio server or channel of the process and shared by all.
    "_poll_wrapper": "grpc.aio",
}


def _library(t: threading.Thread) -> bool:
    return any(f"({target})" in t.name for target in LIBRARY_THREADS)


def _names(threads: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in threads)


@pytest.mark.timeout(60)
def test_every_thread_the_runtime_starts_is_declared_and_stopped(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    stop = threading.Event()
    rt = ServerRuntime(
        make_config(tmp_path, dump_deadline=0.5, notify_url=("http://127.0.0.1:9/hook",)), stop
    )
    info = rt.start()
    try:
        # Declared order: the coordinator's intake (gRPC) starts last of its
        # workers, and HTTP after the coordinator, so both stop first.
        assert rt.workers.names == ["coordinator", "http"]
        assert rt.coordinator.workers.names == [
            "analyzer",
            "notifier",
            "actions",
            "incidents",
            "stragglers",
            "grpc",
        ]
        with grpc.insecure_channel(info.grpc) as ch:
            stub = rpc.CoordinatorStub(ch)
            a = ProtocolAgent(stub, job_id="j", agent_id="a", ranks=[0, 1], world_size=2)
            a.register()
            a.watch()
            a.progress({0: (3, 2), 1: (2, 2)})
            cmd = a.next_command(timeout=10)
            wait_for(
                lambda: (
                    (row := rt.coordinator.store.get_incident(cmd.incident_id)) is not None
                    and row.status != "collecting"
                ),
                20,
                "the incident analysed",
            )
            a.close()
        started = {t for t in set(threading.enumerate()) - before if not _library(t)}
        owned = set(rt.threads())
        assert started, "the runtime started no thread?"
        assert started <= owned, f"threads nobody declared: {_names(started - owned)}"
    finally:
        t0 = time.monotonic()
        rt.shutdown()
        took = time.monotonic() - t0
    assert not [t for t in owned if t.is_alive()], _names({t for t in owned if t.is_alive()})
    assert took < rt.SHUTDOWN_BOUND_S + 1.0, took


def _recorder(log: list[str], name: str, fail: bool = False) -> Worker:
    def start() -> None:
        if fail:
            raise OSError(f"{name} cannot start")
        log.append(f"start {name}")

    return Worker(name=name, start=start, stop=lambda left: log.append(f"stop {name}"))


@pytest.mark.timeout(10)
def test_workers_stop_in_reverse_and_undo_a_failed_start() -> None:
    log: list[str] = []
    w = Workers([_recorder(log, "a"), _recorder(log, "b"), _recorder(log, "c")])
    w.start()
    w.stop(5.0)
    assert log == ["start a", "start b", "start c", "stop c", "stop b", "stop a"]
    log.clear()
    w.stop(5.0)  # twice: nothing left to stop
    assert log == []
    failing = Workers([_recorder(log, "a"), _recorder(log, "b", fail=True), _recorder(log, "c")])
    with pytest.raises(OSError, match="b cannot start"):
        failing.start()
    assert log == ["start a", "stop a"]


@pytest.mark.timeout(10)
def test_one_bound_covers_the_whole_stop() -> None:
    """A worker that overruns leaves the next ones less, never more: each is
    handed what is left of one deadline (a fake clock, moved by the workers)."""
    now = [100.0]
    handed: list[tuple[str, float]] = []

    def slow(name: str, takes: float) -> Worker:
        def stop(left: float) -> None:
            handed.append((name, left))
            now[0] += takes

        return Worker(name=name, start=lambda: None, stop=stop)

    clock: Callable[[], float] = lambda: now[0]  # noqa: E731
    w = Workers([slow("a", 0.0), slow("b", 1.0), slow("c", 4.0)], clock=clock)
    w.start()
    w.stop(3.0)
    assert handed == [("c", 3.0), ("b", 0.0), ("a", 0.0)]
