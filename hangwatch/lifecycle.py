"""Process lifecycle shared by `hangwatch server` and `hangwatch agent` (the uvicorn way).

* `configure_logging`: the one logging setup of every hangwatch process.
* `subcommand_main`: a subcommand run as its own module (`python -m
  hangwatch.runner`), through the same parser as `hangwatch <command>`.
* `ShutdownSignals`: SIGINT/SIGTERM handlers that only flag the stop (a
  byte to a thread that sets the Event: no lock taken inside a handler); the
  process's own loop notices it and shuts down within its bound. A second
  signal means the operator wants out now: the handler restores the signal's
  default action and re-raises it, so the process dies of that signal
  (exit status 128+N in a shell), even if a shutdown step is stuck.
* `exit_if_stuck`: once a stop is under way, a bound on the whole of it,
  interpreter exit included, that leaves every thread's stack behind.
  `ShutdownSignals(..., exit_bound_s=B).stopping()` arms it once with the
  role's own bound: called when the first signal comes, and by a role whose
  stop began otherwise (its loop or HTTP server ended on its own).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def configure_logging(level: str) -> None:
    """One format, on stderr, at `level` (debug, info, warning, error)."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=LOG_FORMAT,
        stream=sys.stderr,
        force=True,
    )


class ShutdownSignals:
    """`with ShutdownSignals("hangwatch server") as stop: ... stop.wait(...)`.

    Must be entered on the main thread (Python delivers signals only there).
    The previous handlers come back on exit.

    The handler does not set `stop` itself. It runs on the main thread between
    two bytecodes, and that thread spends part of every `stop.wait(1.0)`
    holding the Event's own lock (a plain Lock): a handler that ran there and
    called `stop.set()` would wait on that lock for ever, the process deaf to
    the signal and every later one until SIGKILL. (A relay once sat 15 s past
    its test's SIGTERM with nothing in its log, which this fits.) It writes a
    byte to a pipe instead, and a thread of this object's sets the Event.

    `exit_bound_s`: the role's bound on its whole stop (`stopping`), armed
    by that thread first, so a stop that a signal began ends within it,
    stuck or not.
    """

    def __init__(
        self,
        name: str,
        stop: threading.Event | None = None,
        *,
        exit_bound_s: float | None = None,
    ) -> None:
        self.name = name
        self.stop = stop if stop is not None else threading.Event()
        self.exit_bound_s = exit_bound_s
        self._armed = False
        self._previous: dict[int, object] = {}
        self._signalled = False
        self._pipe: tuple[int, int] | None = None
        self._watcher: threading.Thread | None = None

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        # Reads and writes of plain attributes and os calls only: no lock.
        if self._signalled or self.stop.is_set():
            # os.write: no buffered I/O inside a signal handler.
            os.write(2, f"{self.name}: second signal, exiting now\n".encode())
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._signalled = True
        if self._pipe is not None:
            os.write(self._pipe[1], b"s")

    def _watch(self, r: int) -> None:
        # One byte per first signal; b"" once __exit__ closed the write end.
        while os.read(r, 1):
            self.stopping()
            self.stop.set()

    def stopping(self) -> None:
        """The stop is under way: bound it by `exit_bound_s` (exit_if_stuck),
        once. Two callers at once arm it twice, which only restarts the bound."""
        if self.exit_bound_s is not None and not self._armed:
            self._armed = True
            exit_if_stuck(self.name, self.exit_bound_s)

    def __enter__(self) -> threading.Event:
        r, w = os.pipe()
        self._pipe = (r, w)
        self._watcher = threading.Thread(
            target=self._watch, args=(r,), name=f"{self.name} signals", daemon=True
        )
        self._watcher.start()
        for s in _SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self.stop

    def __exit__(self, *exc_info: object) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)  # type: ignore[arg-type]
        if self._pipe is not None:
            r, w = self._pipe
            self._pipe = None
            os.close(w)
            if self._watcher is not None:
                # Bounded: a child forked meanwhile may hold the write end open.
                self._watcher.join(1.0)
            if self._watcher is None or not self._watcher.is_alive():
                os.close(r)


def exit_if_stuck(name: str, bound_s: float) -> None:
    """Call once the process is stopping: if it has not exited `bound_s`
    from now, every thread's Python stack goes to stderr and it exits 1.
    faulthandler's watchdog is a C thread, so it fires wherever the stop is
    stuck: a join, a loop that did not end, or the interpreter's own exit
    (waiting on a thread no stop reached). A relay once sat past its test's
    15 s SIGTERM grace with nothing in its log to say where (the likeliest
    cause, a handler waiting on a lock its own thread held, is mended in
    ShutdownSignals; this bounds whatever else)."""
    sys.stderr.write(f"{name}: stopping (bound {bound_s:.0f} s)\n")
    sys.stderr.flush()
    faulthandler.dump_traceback_later(bound_s, exit=True)


def subcommand_main(
    command: str, add_parser: Callable[[Any], None], argv: list[str] | None = None
) -> int:
    """`python -m MODULE [OPTIONS]`, the same as `hangwatch COMMAND [OPTIONS]`:
    the subcommand's own parser, so the two can never disagree."""
    parser = argparse.ArgumentParser(prog="hangwatch")
    add_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    return int(ns.func(ns))
