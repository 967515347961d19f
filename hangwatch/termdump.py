"""The survivors' flight recorder, written when the launcher terminates them.

When one rank dies, torchrun sends SIGTERM to the others and SIGKILL 30 s
later (torch.distributed.elastic's default). Those survivors know where the
job stopped (ranks 0 and 2 were in all_reduce #10 when rank 1 died), but the
crash incident's dump command reaches their agent after they are gone: their
FR went with them.

So the hook catches SIGTERM and writes every recorder's dump to the run
directory first, where the agent collects a gone rank's dumps from
(`hook.dump_all_to_files`, the file the abort hook writes too). A Python
signal handler runs only when the main thread next executes bytecode, and a
survivor's main thread is usually blocked in C++ (a collective waiting for
the dead rank), so the handler only sets a flag; the signal's wakeup fd
wakes a helper thread that dumps and then ends the process with SIGTERM's
default action, so the launcher sees the exit it asked for. The dump takes
milliseconds (a 2,000-entry ring, no stack traces: symbolizing them imports
torch's compiler stack, about 2 s and 70 MB); TERM_DUMP_S bounds it.

Installed only where it cannot take anything from the job: from the main
thread, when SIGTERM still has its default action (a job with its own
handler keeps it) and no wakeup fd is set (asyncio's loop uses one).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Final

log = logging.getLogger("hangwatch.hook")

# The longest the dump may delay the exit the launcher asked for; torchrun
# waits 30 s before SIGKILL.
TERM_DUMP_S: Final = 5.0

_installed: list[int] = []  # the pipe's read end, once installed in this process
_owner: list[int] = []  # the pid that installed it


def install(dump: Callable[[], list[str]]) -> bool:
    """Dump with `dump` when SIGTERM arrives, then die of it. False where it
    cannot be installed without taking something from the job."""
    if _installed or threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False  # the job handles SIGTERM itself
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:
        os.close(r)
        os.close(w)
        return False
    if previous != -1:
        signal.set_wakeup_fd(previous)  # someone else's (an event loop): leave it
        os.close(r)
        os.close(w)
        return False
    signal.signal(signal.SIGTERM, _flag)
    _installed.append(r)
    _owner.append(os.getpid())
    # A forked child (a DataLoader worker) has no helper thread: SIGTERM must end
    # it as before, or its parent's shutdown would wait on it.
    os.register_at_fork(after_in_child=_uninstall_in_child)
    threading.Thread(target=_watch, args=(r, dump), name="hangwatch-termdump", daemon=True).start()
    return True


def _flag(signum: int, frame: object) -> None:
    """The Python-level handler: nothing to do. The helper thread acts (the wakeup fd
    wakes it even while this thread is blocked in C++); a process that is not
    the installer's (forked before the reset ran) dies as it would have."""
    if _owner and os.getpid() != _owner[0]:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _uninstall_in_child() -> None:
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):
        pass  # not the main thread of the child: _flag still restores the default


def _watch(r: int, dump: Callable[[], list[str]]) -> None:
    while True:
        try:
            data = os.read(r, 64)
        except InterruptedError:
            continue
        except OSError as e:
            log.warning("hangwatch: SIGTERM watcher stopped (%s); no FR dump on SIGTERM", e)
            return
        if not data:
            return
        if signal.SIGTERM in data:
            if signal.getsignal(signal.SIGTERM) is not _flag:
                return  # the job installed its own handler since: it decides
            _dump_and_die(dump)
            return


def _dump_and_die(dump: Callable[[], list[str]]) -> None:
    started = time.monotonic()
    done = threading.Event()
    written: list[str] = []

    def run() -> None:
        try:
            written.extend(dump())
        except Exception:  # a dying process: the exit matters more than the dump
            log.exception("hangwatch: FR dump on SIGTERM failed")
        finally:
            done.set()

    threading.Thread(target=run, name="hangwatch-termdump-write", daemon=True).start()
    done.wait(TERM_DUMP_S)
    log.warning(
        "hangwatch: SIGTERM: wrote %d FR dump(s) in %.2fs; exiting",
        len(written),
        time.monotonic() - started,
    )
    _default_and_kill()


def _default_and_kill() -> None:
    """Die of SIGTERM as if nobody had caught it. Python's signal.signal works
    only on the main thread, which may be blocked for ever; libc's does not care."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(int(signal.SIGTERM), None)  # SIG_DFL is 0
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)  # delivery is asynchronous; it ends the process meanwhile
    except Exception:
        log.exception("hangwatch: could not end the process by SIGTERM; using SIGKILL")
    os.kill(os.getpid(), signal.SIGKILL)
