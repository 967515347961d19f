"""The per-rank hook: turn on the flight recorder and expose it to the node agent.

`hangwatch.attach()` (or `hangwatch run`, which attaches with no edit of the
script) does five things, none of them on the collective path:

1. Sets torch's FR environment defaults (`hangwatch.torchenv`: the job's own
   values win, and the decisions are logged only once the process is a rank).
   torch reads `TORCH_FR_BUFFER_SIZE` when the flight recorder is first
   touched, which is `init_process_group` (measured on 2.13: after init, or
   after any FR dump call, it is ignored). So attach must run before the
   process group exists; `hangwatch run` guarantees that.
2. Wraps the group-creation functions so that after every new group it
   rewrites `<run_dir>/hook/<pid>.json` (formats.RankInfo) with each group's name,
   desc, pg_id and global ranks, and every flight-recorder instance the
   groups write to (`hangwatch.recorders`: gloo's, legacy NCCL's, one per
   hook-recorded backend on 2.15), with the groups each instance numbers.
   FR's `pg_status` is keyed by that per-instance pg_id, which torch does
   not expose. The agent checks the mapping against the entries'
   `process_group` names whenever it has entries.
3. Serves the rank's FR on `<run_dir>/hook/<pid>.sock` (`hangwatch.hook_endpoint`:
   torch's C++ worker server plus hangwatch's status and pickle handlers).
4. Registers an abort hook on every group whose backend supports them (torch
   2.15): torch calls it before aborting a group on a timeout or error.
5. Chains `sys.excepthook`/`threading.excepthook` to append a line to
   `<pid>.events.jsonl` when a collective timeout escapes to the top. Blind
   spot: a timeout the script catches itself is not reported here; the agent
   still sees the stall in FR progress.

Importing this module does not import torch. attach() never raises.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.abc
import importlib.machinery
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType, TracebackType
from typing import Any

from hangwatch import config as config_mod
from hangwatch import env, formats, hook_endpoint, hook_protocol, termdump, torchenv
from hangwatch import recorders as recorders_mod

log = logging.getLogger("hangwatch.hook")

_C10D = "torch.distributed.distributed_c10d"
# Public functions that create groups. Internal callers (new_subgroups calls
# new_group, DeviceMesh calls new_group/split_group) look them up as module
# globals, so wrapping the module attribute catches those too.
_GROUP_FACTORIES = (
    "init_process_group",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
)
_WRAPPED_MARK = "_hangwatch_wrapped"
# At exit, after the socket is removed: how long requests already accepted get
# to finish (see _at_exit). The status handler answers in microseconds.
EXIT_DRAIN_S = 0.05
_TIMEOUT_RE = re.compile(r"timed out|timeout", re.IGNORECASE)


@dataclass(frozen=True, kw_only=True)
class AttachResult:
    """What attach() achieved. `ok` is False when something did not work; `reasons` says what."""

    ok: bool
    reasons: tuple[str, ...] = ()
    run_dir: str | None = None
    # The group-creation wrappers are waiting for torch.distributed to be imported.
    deferred: bool = False
    # Set once the default process group exists.
    rankinfo_path: str | None = None
    socket_path: str | None = None
    fr_source: str | None = None
    env_set: dict[str, str] = field(default_factory=dict)


@dataclass(kw_only=True)
class _State:
    run_dir: str
    job_id: str
    force_thread_server: bool
    owner_pid: int
    reasons: list[str] = field(default_factory=list)
    # What attach() decided about torch's env; logged once this process is a rank.
    env: torchenv.EnvDecisions = field(default_factory=torchenv.EnvDecisions)
    deferred: bool = False
    patched: bool = False
    server: Any = None
    fr_source: str | None = None
    socket_path: str | None = None
    rankinfo_path: str | None = None
    started_unix: float = field(default_factory=time.time)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Replaced whole (never mutated) on each group change: handler threads read it unlocked.
    recorders: tuple[recorders_mod.Recorder, ...] = ()
    # The launcher, data-loader and compile workers never become ranks: silent.
    announced: bool = False
    abort_hooked: set[int] = field(default_factory=set)
    # What recorders.discover learned of each group, asked of torch once.
    pg_instances: dict[tuple[int, str], recorders_mod.PgInstances] = field(default_factory=dict)


_state: _State | None = None
_attach_lock = threading.Lock()


def attach(
    *,
    run_dir: str | None = None,
    job_id: str | None = None,
    fr_buffer_size: int | None = None,
    force_thread_server: bool = False,
    environ: MutableMapping[str, str] | None = None,
) -> AttachResult:
    """Attach the hook to this process. Idempotent; never raises into the caller.

    Arguments override the HANGWATCH_* environment. `force_thread_server`
    uses the fallback thread endpoint even where torch has the C++ server.
    """
    global _state
    try:
        with _attach_lock:
            if _state is not None and _state.owner_pid == os.getpid():
                return _result(_state)
            environ = os.environ if environ is None else environ
            overrides: dict[str, Any] = {}
            if run_dir is not None:
                overrides["run_dir"] = run_dir
            if job_id is not None:
                overrides["job_id"] = job_id
            if fr_buffer_size is not None:
                overrides["fr_buffer_size"] = fr_buffer_size
            cfg = config_mod.from_sources(None, environ, **overrides)
            st = _State(
                run_dir=os.path.abspath(cfg.agent.run_dir),
                job_id=cfg.job.job_id,
                force_thread_server=force_thread_server,
                owner_pid=os.getpid(),
            )
            _state = st
            set_env_defaults(st, environ, cfg.hook.fr_buffer_size)
            _install_excepthooks()
            if _C10D in sys.modules:
                _patch_c10d(sys.modules[_C10D])
                _after_group_change()
            else:
                st.deferred = True
                _install_import_hook()
            return _result(st)
    except Exception as e:  # attach must never break training
        log.exception("hangwatch: attach failed; training continues without it")
        return AttachResult(ok=False, reasons=(f"attach failed: {type(e).__name__}: {e}",))


def status() -> AttachResult:
    """The current state of the hook in this process."""
    if _state is None or _state.owner_pid != os.getpid():
        return AttachResult(ok=False, reasons=("not attached",))
    return _result(_state)


def _result(st: _State) -> AttachResult:
    return AttachResult(
        ok=not st.reasons,
        reasons=tuple(st.reasons),
        run_dir=st.run_dir,
        deferred=st.deferred,
        rankinfo_path=st.rankinfo_path,
        socket_path=st.socket_path,
        fr_source=st.fr_source,
        env_set=dict(st.env.set),
    )


# --- 1. environment -------------------------------------------------------


def set_env_defaults(st: _State, environ: MutableMapping[str, str], buffer_size: int) -> None:
    if _C10D in sys.modules and _torch_pg_initialized():
        msg = (
            "attach() ran after init_process_group: the flight recorder already exists, so "
            f"{env.TORCH_FR_BUFFER_SIZE} and the dump-on-timeout settings may not take effect"
        )
        log.warning("hangwatch: %s", msg)
        st.reasons.append(msg)
    st.env = torchenv.apply_defaults(
        environ, dump_prefix=hook_protocol.fr_dump_prefix(st.run_dir), buffer_size=buffer_size
    )
    st.reasons.extend(st.env.reasons)


def announce(st: _State) -> None:
    """First group of a rank: now the env decisions are worth a log line and a directory."""
    if st.announced:
        return
    st.announced = True
    st.env.announce()
    os.makedirs(os.path.dirname(hook_protocol.fr_dump_prefix(st.run_dir)), exist_ok=True)


# --- 2. group discovery ---------------------------------------------------


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader for torch.distributed.distributed_c10d, then wraps its factories."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        try:
            _patch_c10d(module)
        except Exception:
            log.exception("hangwatch: could not wrap group creation")


class _C10dFinder(importlib.abc.MetaPathFinder):
    """Waits for torch.distributed to be imported so attach() need not import torch itself."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _C10D:
            return None
        _remove_import_hook()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchingLoader(spec.loader)  # type: ignore[arg-type]
        return spec


def _install_import_hook() -> None:
    if not any(isinstance(f, _C10dFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _C10dFinder())


def _remove_import_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _C10dFinder)]


def _patch_c10d(c10d: ModuleType) -> None:
    st = _state
    if st is None or st.patched:
        return
    dist = sys.modules.get("torch.distributed")
    for name in _GROUP_FACTORIES:
        orig = getattr(c10d, name, None)
        if orig is None or getattr(orig, _WRAPPED_MARK, False):
            continue
        wrapped = _wrap_factory(orig)
        setattr(c10d, name, wrapped)
        # torch.distributed re-exports these; when it is already imported its
        # copies are the originals and must be replaced too.
        if dist is not None and getattr(dist, name, None) is orig:
            setattr(dist, name, wrapped)
    st.patched = True
    st.deferred = False
    log.debug("hangwatch: wrapped %s", ", ".join(_GROUP_FACTORIES))


def _wrap_factory(orig: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        _after_group_change()
        return out

    wrapper.__name__ = getattr(orig, "__name__", "wrapper")
    wrapper.__qualname__ = getattr(orig, "__qualname__", wrapper.__name__)
    wrapper.__doc__ = orig.__doc__
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    setattr(wrapper, _WRAPPED_MARK, True)
    return wrapper


def _torch_pg_initialized() -> bool:
    c10d = sys.modules.get(_C10D)
    if c10d is None:
        return False
    try:
        return bool(c10d.is_initialized())
    except Exception:
        return False


def _after_group_change() -> None:
    """Called after every group-creation call returns. Never raises."""
    st = _state
    if st is None or st.owner_pid != os.getpid() or not _torch_pg_initialized():
        return
    try:
        with st.lock:
            announce(st)
            st.recorders = tuple(_discover_recorders(st))
            if st.server is None:
                _start_endpoint(st)
            _hook_aborts(st)
            # A process with a group is a rank: its FR is worth writing when the
            # launcher terminates it (a launcher never creates a group).
            termdump.install(lambda: dump_all_to_files(stacks=False, on_exit=True))
            _write_rankinfo(st)
    except Exception as e:
        msg = f"rank-info/endpoint update failed: {type(e).__name__}: {e}"
        log.exception("hangwatch: %s", msg)
        if msg not in st.reasons:
            st.reasons.append(msg)


def current_groups() -> list[formats.GroupInfo]:
    """The groups this process belongs to, in creation order, with their local FR pg_id."""
    c10d = sys.modules[_C10D]
    world = c10d._world
    return [
        formats.GroupInfo(
            name=str(name),
            desc=str(getattr(pg, "group_desc", "") or ""),
            pg_id=pg_id,
            ranks=sorted(int(r) for r in world.pg_group_ranks.get(pg, {})),
        )
        for pg_id, (pg, name) in enumerate(world.pg_names.items())
    ]


# Our abort hooks' ids: any int works, as long as it is ours and stable.
_ABORT_HOOK_ID = 0x6877


def _hook_aborts(st: _State) -> None:
    """Register an abort hook on every group whose backend supports them.

    torch 2.15 calls abort hooks from its watchdog just before it aborts a
    group on a timeout or error: the moment every recorder should be dumped
    and the coordinator told. gloo and the CPU test backends support none;
    see docs/compatibility.md for what has been tried.
    """
    c10d = sys.modules[_C10D]
    for pg, name in list(c10d._world.pg_names.items()):
        if id(pg) in st.abort_hooked or not getattr(pg, "supports_abort_hooks", False):
            continue
        try:
            pg.register_abort_hook(_ABORT_HOOK_ID, _abort_hook_for(str(name)))
            st.abort_hooked.add(id(pg))
        except Exception as e:
            log.warning("hangwatch: cannot register an abort hook on group %s: %s", name, e)


def _abort_hook_for(group: str) -> Callable[[], None]:
    def on_abort() -> None:
        record_event(
            formats.HookEventKind.BACKEND_ABORT,
            f"torch is aborting group {group} (timeout or error)",
        )
        dump_all_to_files()

    return on_abort


def dump_all_to_files(*, stacks: bool = True, on_exit: bool = False) -> list[str]:
    """Write every recorder instance's pickle next to torch's dump-on-timeout file.

    torch's own file holds one instance; the agent fans out on any of these.
    `stacks=False` leaves out the entries' stack traces, whose symbolization
    imports torch's compiler stack. `on_exit`: the process is dying, named so
    (formats.exit_dump_name). Never raises.
    """
    st = _state
    if st is None or st.owner_pid != os.getpid() or not _torch_pg_initialized():
        return []
    written = []
    rank = int(sys.modules[_C10D].get_rank())
    fr_dir = os.path.dirname(hook_protocol.fr_dump_prefix(st.run_dir))
    for rec in st.recorders:
        name = (
            formats.exit_dump_name(rec.instance, rank, os.getpid())
            if on_exit
            else formats.abort_dump_name(rec.instance, rank)
        )
        path = os.path.join(fr_dir, name)
        try:
            formats.atomic_write(path, recorders_mod.dump(rec, pickle=True, stacks=stacks))
            written.append(path)
        except Exception as e:
            log.warning("hangwatch: could not dump recorder %s: %s", rec.instance, e)
    return written


def _write_rankinfo(st: _State) -> None:
    import torch
    import torch.distributed as dist

    pid = os.getpid()
    local_rank = os.environ.get(env.LOCAL_RANK)
    info = formats.RankInfo(
        job_id=st.job_id,
        rank=dist.get_rank(),
        local_rank=int(local_rank) if local_rank and local_rank.isdigit() else -1,
        world_size=dist.get_world_size(),
        pid=pid,
        proc_starttime=hook_protocol.proc_starttime(pid),
        host=socket.gethostname(),
        backend=str(dist.get_backend()),
        torch_version=str(torch.__version__),
        socket=st.socket_path,
        fr_source=st.fr_source or "",
        started_unix=st.started_unix,
        groups=tuple(current_groups()),
        recorders=tuple(st.recorders),
        watchdog_prefix=st.env.watchdog_prefix,
    )
    path = hook_protocol.rankinfo_path(st.run_dir, pid)
    formats.atomic_write(path, info.to_bytes())
    st.rankinfo_path = path
    log.debug("hangwatch: wrote %s", path)


# --- 3. FR endpoint -------------------------------------------------------


def _discover_recorders(st: _State) -> list[recorders_mod.Recorder]:
    recs = recorders_mod.discover(st.pg_instances)
    known = {r.instance for r in st.recorders}
    for r in recs:
        if r.instance not in known:
            log.info(
                "hangwatch: flight recorder %r (%s, completion %s) records groups %s",
                r.instance,
                r.kind,
                r.completion,
                ",".join(r.groups),
            )
    return recs


def _current_recorders() -> tuple[recorders_mod.Recorder, ...]:
    st = _state
    return st.recorders if st is not None and st.owner_pid == os.getpid() else ()


def _start_endpoint(st: _State) -> None:
    path = hook_protocol.socket_path(st.run_dir, os.getpid())
    st.server, st.fr_source = hook_endpoint.start(
        path, force_thread=st.force_thread_server, recorders=_current_recorders
    )
    st.socket_path = path
    atexit.register(_at_exit)
    log.info("hangwatch: FR endpoint (%s) on %s", st.fr_source, path)


def _at_exit() -> None:
    """At exit: leave the recorders' last numbers for the agent, then remove the
    socket file (only that: see hook_endpoint.start).

    The agent polls every `poll_interval`; a rank that enters its last
    collective and exits between two polls would otherwise leave numbers one
    collective behind, and on a backend that records no completion every
    rank's last collective looks unfinished: a job ending normally read as
    one rank lost or one rank not entered (measured on the hwstore backend
    under load). A few microseconds of C++ per recorder (recorders.status_doc)."""
    st = _state
    # A forked child inherits the Python object but not the server's threads.
    if st is None or st.owner_pid != os.getpid() or not st.socket_path:
        return
    try:
        # Atomic: the agent never reads half of it.
        formats.atomic_write(
            hook_protocol.final_status_path(st.run_dir, os.getpid()),
            recorders_mod.status_doc(_current_recorders()),
        )
    except Exception:
        log.exception("hangwatch: could not write the final FR status")
    with contextlib.suppress(OSError):
        os.unlink(st.socket_path)
    # No new request can connect now, but one already accepted may be waiting
    # for the GIL on a worker-server thread. Once finalization starts, such a
    # thread is ended by pthread_exit, whose unwinding the server's C++
    # catch-all swallows: "FATAL: exception not rethrown", and a rank that
    # finished its job dies of SIGABRT (torchrun then fails the job). Seen in
    # a full test run; with 4 clients polling the status handler through the
    # exit, 5 and 11 of 20 exits aborted, 0 of 20 with this drain
    # (benchmarks/exit_race.py). Releasing the GIL this long lets them finish.
    time.sleep(EXIT_DRAIN_S)


# --- 4. timeout events ----------------------------------------------------

_prev_excepthook: Callable[..., Any] | None = None
_prev_threading_excepthook: Callable[..., Any] | None = None


def _install_excepthooks() -> None:
    global _prev_excepthook, _prev_threading_excepthook
    if getattr(sys.excepthook, _WRAPPED_MARK, False):
        return
    _prev_excepthook = sys.excepthook
    _prev_threading_excepthook = threading.excepthook
    setattr(_excepthook, _WRAPPED_MARK, True)
    setattr(_threading_excepthook, _WRAPPED_MARK, True)
    sys.excepthook = _excepthook
    threading.excepthook = _threading_excepthook


def _excepthook(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    record_exception(exc, thread=threading.current_thread().name)
    # The process is about to die of it: its FR says where it stopped (the
    # crashed rank's own, and a survivor's whose collective failed when that
    # peer went), and the agent collects a gone rank's dump from this file.
    # Milliseconds: no stack traces.
    dump_all_to_files(stacks=False, on_exit=True)
    prev = _prev_excepthook or sys.__excepthook__
    prev(exc_type, exc, tb)


def _threading_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is not None:
        record_exception(args.exc_value, thread=args.thread.name if args.thread else "?")
    prev = _prev_threading_excepthook or threading.__excepthook__
    prev(args)


def _is_collective_timeout(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and bool(_TIMEOUT_RE.search(str(exc)))


def record_exception(exc: BaseException, *, thread: str = "MainThread") -> None:
    """Append a HookEvent line for an uncaught exception. Never raises."""
    st = _state
    if st is None or st.owner_pid != os.getpid():
        return
    try:
        rank = -1
        if _torch_pg_initialized():
            rank = int(sys.modules[_C10D].get_rank())
        elif os.environ.get(env.RANK, "").isdigit():
            rank = int(os.environ[env.RANK])
        kind = (
            formats.HookEventKind.COLLECTIVE_TIMEOUT
            if _is_collective_timeout(exc)
            else formats.HookEventKind.UNCAUGHT_EXCEPTION
        )
        _append_event(st, kind, rank, f"{type(exc).__name__}: {exc}", thread)
    except Exception:
        log.exception("hangwatch: could not record an exception event")


def record_event(kind: formats.HookEventKind, detail: str) -> None:
    """Append a HookEvent line of this kind. Never raises."""
    st = _state
    if st is None or st.owner_pid != os.getpid():
        return
    try:
        rank = int(sys.modules[_C10D].get_rank()) if _torch_pg_initialized() else -1
        _append_event(st, kind, rank, detail, threading.current_thread().name)
    except Exception:
        log.exception("hangwatch: could not record a %s event", kind)


def _append_event(
    st: _State, kind: formats.HookEventKind, rank: int, detail: str, thread: str
) -> None:
    line = formats.HookEvent(
        kind=kind, rank=rank, detail=detail[:4000], thread=thread, unix=time.time()
    ).to_bytes()
    path = hook_protocol.events_path(st.run_dir, os.getpid())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # One write() of one line in append mode: readers never see half a line.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _forget_in_child() -> None:
    # A forked child (e.g. a DataLoader worker) is not a rank: it must not
    # serve, shut down or rewrite its parent's files.
    global _state
    _state = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
