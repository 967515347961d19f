"""The coordinator's threads: started in a declared order, stopped in reverse under one bound.

A `Worker` is one concern that runs on threads of its own (the gRPC loop, the
detector, the notifier, ...): how to start it, how to stop it within the seconds
left, and which threads it runs. `Workers` starts them in the order declared,
undoes a half-done start (a port that cannot be bound stops what already runs),
and stops them in reverse, so the intake that was started last is the first to
stop taking work. One deadline covers the whole stop: a worker that overruns
shortens what the next ones get, never the bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field

log = logging.getLogger("hangwatch.server")


def executor_threads(pool: Executor | None) -> list[threading.Thread]:
    """The threads a stdlib pool runs in this process: a thread pool's workers, a
    process pool's manager and its call queue's feeder. The stdlib offers no
    public accessor; these attributes are stable across 3.9-3.13 and a test
    (tests/server/test_runtime_threads.py) fails if one moves."""
    if isinstance(pool, ThreadPoolExecutor):
        return list(pool._threads)
    if isinstance(pool, ProcessPoolExecutor):
        out = [pool._executor_manager_thread]
        feeder = getattr(getattr(pool, "_call_queue", None), "_thread", None)
        return [t for t in (*out, feeder) if isinstance(t, threading.Thread)]
    return []


def _no_threads() -> list[threading.Thread]:
    return []


@dataclass(frozen=True, kw_only=True)
class Worker:
    name: str
    start: Callable[[], None]
    # Given the seconds left of the shutdown bound; must return within them.
    stop: Callable[[float], None]
    # The threads it runs now (pools grow on demand, so this is asked, not fixed).
    threads: Callable[[], list[threading.Thread]] = field(default=_no_threads)


class Workers:
    def __init__(self, workers: Sequence[Worker], *, clock: Callable[[], float] = time.monotonic):
        names = [w.name for w in workers]
        if len(set(names)) != len(names):
            raise ValueError(f"worker names repeat: {names}")
        self.declared: tuple[Worker, ...] = tuple(workers)
        self._clock = clock
        self._started: list[Worker] = []
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return [w.name for w in self.declared]

    def start(self) -> None:
        """Start each worker in order; if one fails, stop those already started
        (in reverse, 5 s in all) and raise its error."""
        for w in self.declared:
            try:
                w.start()
            except BaseException:
                self.stop(5.0)
                raise
            with self._lock:
                self._started.append(w)

    def stop(self, bound_s: float) -> None:
        """Stop what was started, last first, all within `bound_s` seconds. A
        worker's failure to stop is logged and the next one still stops."""
        deadline = self._clock() + bound_s
        with self._lock:
            todo, self._started = self._started[::-1], []
        for w in todo:
            left = max(0.0, deadline - self._clock())
            try:
                w.stop(left)
            except Exception:
                log.exception("stopping %s failed", w.name)
        overrun = self._clock() - deadline
        if overrun > 0:
            log.warning("shutdown overran its %.1fs bound by %.1fs", bound_s, overrun)

    def threads(self) -> list[threading.Thread]:
        """Every thread the declared workers run now."""
        return [t for w in self.declared for t in w.threads()]
