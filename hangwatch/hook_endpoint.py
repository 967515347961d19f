"""The rank's FR endpoint: torch's C++ worker server plus hangwatch's handlers.

Handlers (names in hangwatch.hook_protocol): `hangwatch_status` answers every
recorder instance's status-only dump (FRSTATUS, microseconds of C++ each);
`hangwatch_fr_pickle?instance=NAME` one instance's pickle with call-site
frames. torch's own `fr_trace_json[?backend=NAME]`, `dump_nccl_trace_json`,
`dump_traceback` and `c10d_health_check` are served by the C++ server itself.

Calling the C++ server's shutdown() from atexit hangs or aborts the
interpreter in torch 2.13 (measured: it releases the GIL during finalization),
so the server is left to the process teardown; the hook removes the socket file.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from hangwatch import hook_protocol
from hangwatch import recorders as recorders_mod

log = logging.getLogger("hangwatch.hook")


def _no_recorders() -> Sequence[recorders_mod.Recorder]:
    return ()


# Set by start(): the handlers registered with torch live as long as the
# process, so they read the hook's current recorders through this.
_recorders: Callable[[], Sequence[recorders_mod.Recorder]] = _no_recorders


def _recorder(params: dict[str, str]) -> recorders_mod.Recorder:
    rec = recorders_mod.find(_recorders(), params.get(hook_protocol.INSTANCE_PARAM))
    if rec is None:
        raise LookupError(f"no flight recorder instance {params.get('instance')!r}")
    return rec


def _status_json(params: dict[str, str]) -> bytes:
    return recorders_mod.status_doc(_recorders())


def _fr_pickle(params: dict[str, str]) -> bytes:
    return recorders_mod.dump_pickle(_recorder(params))


def _fr_json(params: dict[str, str]) -> bytes:
    # The thread endpoint stands in for torch's C++ fr_trace_json, which takes ?backend=.
    name = params.get("backend") or params.get(hook_protocol.INSTANCE_PARAM)
    return recorders_mod.dump_json(_recorder({hook_protocol.INSTANCE_PARAM: name or ""}))


def start(
    path: str, *, force_thread: bool, recorders: Callable[[], Sequence[recorders_mod.Recorder]]
) -> tuple[Any, str]:
    """Serve the rank's FR on the Unix socket `path`: (server, "worker-server" | "thread").

    torch's C++ worker server where it exists (its handlers answer while the
    GIL is held), with hangwatch's Python handlers added; a daemon thread
    serving the same handlers elsewhere. `recorders` returns the current
    instances (they change as groups are created).
    """
    global _recorders
    _recorders = recorders
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.exists(path):
        os.unlink(path)
    c: Any = None
    with contextlib.suppress(ImportError):
        c = recorders_mod.c10d_ext()
    if not force_thread and c is not None and hasattr(c, "_WorkerServer"):
        try:
            _register_python_handlers(c)
            server = c._WorkerServer(path, -1)
            _keep_forever(server)
            return server, "worker-server"
        except Exception as e:
            log.warning("hangwatch: C++ worker server failed (%s); using the thread endpoint", e)
    from hangwatch import hook_server

    server = hook_server.ThreadServer(
        path,
        {
            hook_protocol.PING: lambda p: (200, b"pong", "text/plain"),
            hook_protocol.FR_TRACE_JSON: lambda p: (200, _fr_json(p), "application/json"),
            hook_protocol.DUMP_TRACEBACK: lambda p: (
                200,
                hook_server.dump_traceback_text(),
                "text/plain",
            ),
            hook_protocol.PYSPY_DUMP: lambda p: (*hook_server.pyspy_dump_text(), "text/plain"),
            hook_protocol.STATUS: lambda p: (200, _status_json(p), "application/json"),
            hook_protocol.FR_PICKLE: lambda p: (200, _fr_pickle(p), "application/octet-stream"),
        },
    )
    return server, "thread"


def _keep_forever(obj: object) -> None:
    """Never run this object's destructor.

    torch 2.13 holds the worker server and registered Python handlers in C++
    objects that are destroyed after the interpreter has finalized; freeing a
    Python object there has no GIL and aborts the process (measured on every
    clean exit of an attached rank). `shutdown()` from atexit hangs instead.
    An extra reference that is never dropped leaves them to die with the process.
    """
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _register_python_handlers(c: Any) -> None:
    def handler(fn: Callable[[dict[str, str]], bytes], ctype: str) -> Callable[[Any, Any], None]:
        def serve(req: Any, resp: Any) -> None:
            try:
                params = {
                    hook_protocol.INSTANCE_PARAM: str(req.get_param(hook_protocol.INSTANCE_PARAM))
                }
                resp.set_content(fn(params), ctype)
                resp.set_status(200)
            except Exception as e:
                resp.set_content(f"{type(e).__name__}: {e}\n".encode(), "text/plain")
                resp.set_status(500)

        return serve

    existing = set(c._get_handler_names())
    for name, fn, ctype in (
        (hook_protocol.STATUS, _status_json, "application/json"),
        (hook_protocol.FR_PICKLE, _fr_pickle, "application/octet-stream"),
    ):
        if name not in existing:
            serve = handler(fn, ctype)
            # torch's registry drops its reference after the interpreter is
            # gone; if that is the last one, deallocation without the GIL
            # crashes the exit (measured: SIGSEGV/SIGABRT with a closure).
            _keep_forever(serve)
            c._register_handler(name, serve)
