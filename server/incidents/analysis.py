"""The coordinator runs the analyzer in a separate, memory-capped process.

Bundles come from agents, so their FR pickles are untrusted. The safe
unpickler refuses every global, but CPython's C unpickler still trusts the
sizes a stream declares: a few KB with a huge memo index make it allocate and
zero gigabytes. In the coordinator that would be an OOM kill, and restart
recovery would re-analyse the same bundle into a crash loop. Here the
allocation fails against the child's address-space cap instead and becomes a
per-file error; a child that dies anyway fails only that incident.

One long-lived worker from a forkserver (never a fork of the threaded gRPC
process), warmed at start so the first incident does not pay the imports.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import resource
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from hangwatch.analyzer.report import Report
from hangwatch.server.workers import executor_threads

log = logging.getLogger("hangwatch.server")


def _init_child(limit_bytes: int) -> None:
    # The worker's parent is the forkserver; see orphan_guard for why a thread.
    from hangwatch.server.incidents.orphan_guard import watch_parent

    watch_parent()
    if limit_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    # Warm pandas and the loader once per child, not per incident.
    importlib.import_module("hangwatch.analyzer.loader")
    importlib.import_module("hangwatch.analyzer.diagnose")


def _warm() -> bool:
    return True


def _analyze_in_child(path: str, world_size: int | None) -> dict[str, Any]:
    from hangwatch.analyzer import analyze_path

    return analyze_path(Path(path), world_size=world_size).to_dict()


def _trace_in_child(path: str, report: dict[str, Any] | None) -> dict[str, Any]:
    from hangwatch.analyzer.trace import trace_path

    return trace_path(Path(path), Report.from_dict(report) if report is not None else None)


class IsolatedAnalyzer:
    """`analyze(path, world_size) -> Report`, run in the capped child."""

    def __init__(self, *, memory_limit_bytes: int) -> None:
        self.memory_limit_bytes = memory_limit_bytes
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None

    def _get_pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                ctx = multiprocessing.get_context("forkserver")
                # Imported by the forkserver at its start: it dies with us.
                ctx.set_forkserver_preload(["hangwatch.server.incidents.orphan_guard"])
                self._pool = ProcessPoolExecutor(
                    max_workers=1,
                    mp_context=ctx,
                    initializer=_init_child,
                    initargs=(self.memory_limit_bytes,),
                )
            return self._pool

    def warm(self) -> None:
        self._get_pool().submit(_warm)

    def __call__(self, path: Path, world_size: int | None) -> Report:
        pool = self._get_pool()
        try:
            doc = pool.submit(_analyze_in_child, str(path), world_size).result()
        except BrokenProcessPool as e:
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise RuntimeError(
                f"the analyzer process died on this bundle (memory cap "
                f"{self.memory_limit_bytes >> 20} MiB): {e}"
            ) from e
        return Report.from_dict(doc)

    def trace(self, path: Path, report: Report | None) -> dict[str, Any]:
        """The bundle's trace-event document (analyzer/trace.py), built in the
        same capped child: it reads the same untrusted dumps."""
        doc = None if report is None else report.to_dict()
        try:
            out: dict[str, Any] = self._get_pool().submit(_trace_in_child, str(path), doc).result()
        except BrokenProcessPool as e:
            with self._lock:
                self._pool = None
            raise RuntimeError(f"the analyzer process died building the trace: {e}") from e
        return out

    def threads(self) -> list[threading.Thread]:
        """The pool's threads in this process (its manager and its queue feeder)."""
        with self._lock:
            return executor_threads(self._pool)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
