"""Preloaded into the analyzer's forkserver: it, and the worker it forks, die with their parent.

`kill -9` of the coordinator (an OOM kill, say) used to leave its forkserver,
the analysis worker and the resource tracker running under init (measured:
five such sets after one test suite). Nothing in multiprocessing ties them to
the coordinator's life, and PR_SET_PDEATHSIG fires when the *thread* that
forked a child exits, not the process, so it would kill the forkserver
whenever the coordinator's starting thread ended. A thread that notices the
parent is gone (the process is reparented) is simple and exact.

Importing this module starts that watch, so only the forkserver imports it
(by name, through `set_forkserver_preload`); the worker starts its own watch
in its initializer. With both gone, the resource tracker sees its last pipe
close and exits by itself.
"""

from __future__ import annotations

import os
import signal
import threading
import time

POLL_S = 0.5


def watch_parent(poll_s: float = POLL_S) -> None:
    """Kill this process (SIGKILL) once its parent process has gone."""
    parent = os.getppid()

    def run() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=run, name="hangwatch-orphan-guard", daemon=True).start()


watch_parent()
