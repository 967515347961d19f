"""Process lifecycle shared by `hangwatch server` and `hangwatch agent` (the uvicorn way).

* `configure_logging`: the one logging setup of every hangwatch process.
* `subcommand_main`: a subcommand run as its own module (`python -m
  hangwatch.runner`), through the same parser as `hangwatch <command>`.
* `ShutdownSignals`: SIGINT/SIGTERM handlers that only set a flag; the
  process's own loop notices it and shuts down within its bound. A second
  signal means the operator wants out now: the handler restores the signal's
  default action and re-raises it, so the process dies of that signal
  (exit status 128+N in a shell), even if a shutdown step is stuck.
* `exit_if_stuck`: once a stop is under way, a bound on the whole of it,
  interpreter exit included, that leaves every thread's stack behind.
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
    """

    def __init__(self, name: str, stop: threading.Event | None = None) -> None:
        self.name = name
        self.stop = stop if stop is not None else threading.Event()
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.stop.is_set():
            # os.write: no buffered I/O inside a signal handler.
            os.write(2, f"{self.name}: second signal, exiting now\n".encode())
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.stop.set()

    def __enter__(self) -> threading.Event:
        for s in _SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self.stop

    def __exit__(self, *exc_info: object) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)  # type: ignore[arg-type]


def exit_if_stuck(name: str, bound_s: float) -> None:
    """Call once the process is stopping: if it has not exited `bound_s`
    from now, every thread's Python stack goes to stderr and it exits 1.
    faulthandler's watchdog is a C thread, so it fires wherever the stop is
    stuck: a join, a loop that did not end, or the interpreter's own exit
    (waiting on a thread no stop reached). A relay once sat past its test's
    15 s SIGTERM grace with nothing in its log to say where."""
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
