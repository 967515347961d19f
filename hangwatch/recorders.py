"""Every flight-recorder instance a training process writes to, and how to read each.

torch keeps one recorder per family of backends, and a dump call reads one:

* the generic instance, which ProcessGroupGloo records into (and, up to 2.14,
  the only one `_dump_fr_trace*` reads);
* legacy NCCL's own instance (ProcessGroupNCCL, every torch up to 2.14 and
  `nccl-legacy` on 2.15), read with `_dump_nccl_trace*`;
* from torch 2.15, one instance per backend that torch's `FlightRecorderHook`
  records because the backend does not record itself (2.15's default
  `nccl`, which is ProcessGroupNCCL2, and any out-of-tree backend), read with
  `_dump_fr_trace*(backend=NAME)`.

Discovery walks the process groups this process belongs to and asks each
group's device backends what they are; nothing here compares torch version
strings or lists backend names: capabilities are probed (`backend=` keyword,
`_dump_nccl_trace`, `_world.pg_flight_recorder_hooks`).

Two measured differences decide how a recorder's numbers are read (torch 2.15):

* **completion**: the hook retires an entry from the backend's completion
  hook, which fires when the op really finished (2.15's default NCCL has
  them). A backend without completion hooks (any backend written in Python)
  gets its entries `retired` as soon as the call returns, and
  `pg_status.last_completed_collective` stays -1, however the work ends.
  Such a recorder reports `completion="unknown"`: only what ranks *entered*
  is known. Which of the two a hooked backend is, the backend says
  (`supports_completion_hooks`, probed per device backend); the agent and the
  analyzer confirm it from the data (completed states and counters). gloo and
  legacy NCCL record completion ("tracked").
* **status offset**: `pg_status.last_enqueued_collective` is the last op_id.
  gloo and NCCL count op_id from 1, the hook from 0, so a hook recorder's
  status is one behind its collective_seq_id (`status_offset=1`).

Importing this module does not import torch; nothing here runs on the
collective path: status reads are one C++ call per instance.
"""

from __future__ import annotations

import _imp
import contextlib
import importlib
import json
import logging
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from hangwatch import formats
from hangwatch.formats import Completion, Recorder, RecorderKind

log = logging.getLogger("hangwatch.hook")

KIND_GENERIC = RecorderKind.GENERIC
KIND_NCCL = RecorderKind.NCCL
KIND_HOOKED = RecorderKind.HOOKED

COMPLETION_TRACKED = Completion.TRACKED
COMPLETION_UNKNOWN = Completion.UNKNOWN

# The generic instance's name as torch's `backend=` argument spells it.
GENERIC_INSTANCE = formats.GENERIC_INSTANCE
NCCL_INSTANCE = "nccl"


def c10d_ext() -> Any:
    """torch's C++ c10d bindings (untyped: the private names are not in torch's stubs)."""
    return importlib.import_module("torch._C._distributed_c10d")


@dataclass
class _Caps:
    backend_kw: bool
    nccl: bool
    hooks: bool


_caps: _Caps | None = None


def capabilities() -> _Caps:
    """What this torch can read, probed once."""
    global _caps
    if _caps is None:
        c = c10d_ext()
        backend_kw = False
        try:
            c._dump_fr_trace_json(includeCollectives=False, backend=GENERIC_INSTANCE)
            backend_kw = True
        except TypeError:
            pass
        c10d = importlib.import_module("torch.distributed.distributed_c10d")
        _caps = _Caps(
            backend_kw=backend_kw,
            nccl=hasattr(c, "_dump_nccl_trace_json") and hasattr(c, "ProcessGroupNCCL"),
            hooks=hasattr(c10d._world, "pg_flight_recorder_hooks"),
        )
    return _caps


@dataclass
class _Acc:
    kind: RecorderKind
    completion: Completion
    offset: int
    groups: list[str] = field(default_factory=list)


# (instance, kind, completion, status offset) per device backend of one group.
PgInstances = tuple[tuple[str, RecorderKind, Completion, int], ...]


def discover(cache: dict[tuple[int, str], PgInstances] | None = None) -> list[Recorder]:
    """The recorder instances this process's groups write to, in first-use order.

    Hook-recorded and NCCL instances come before the generic one: a group
    that lives in two (a "cpu:gloo,cuda:nccl" group) is tracked through its
    GPU instance, where collectives hang.

    The hook calls this after every group creation, and Megatron-style jobs
    create hundreds of groups at start: `cache` (keyed by the group's id
    and name, kept by the caller: an id may be reused, a name never) makes each call ask torch only about new groups, so
    start-up stays linear in the number of groups.
    """
    c = c10d_ext()
    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    caps = capabilities()
    world = c10d._world
    hooked_pgs = set(world.pg_flight_recorder_hooks) if caps.hooks else set()
    nccl_cls = getattr(c, "ProcessGroupNCCL", None)
    cache = {} if cache is None else cache
    acc: dict[str, _Acc] = {}
    for pg, name in world.pg_names.items():
        key = (id(pg), str(name))
        found = cache.get(key)
        if found is None:
            found = cache[key] = tuple(
                (inst, a.kind, a.completion, a.offset)
                for inst, a in _instances_of(pg, pg in hooked_pgs, nccl_cls, caps)
            )
        for inst, kind, completion, offset in found:
            # Group names are unique in pg_names: each lands once per instance.
            acc.setdefault(inst, _Acc(kind, completion, offset)).groups.append(str(name))
    order = sorted(acc, key=lambda i: (acc[i].kind == KIND_GENERIC, i))
    return [
        Recorder(
            instance=i,
            kind=acc[i].kind,
            completion=acc[i].completion,
            status_offset=acc[i].offset,
            groups=tuple(acc[i].groups),
            json_handler=_json_handler(i, acc[i].kind, caps),
        )
        for i in order
    ]


def _instances_of(pg: Any, hooked: bool, nccl_cls: Any, caps: _Caps) -> Iterable[tuple[str, _Acc]]:
    seen: set[str] = set()
    for dev in getattr(pg, "_device_types", None) or []:
        try:
            b = pg._get_backend(dev)
        except Exception as e:  # a device without a backend: nothing recorded there
            log.debug("hangwatch: no backend for %s: %s", dev, e)
            continue
        bname = _backend_name(b)
        if nccl_cls is not None and isinstance(b, nccl_cls):
            key, a = NCCL_INSTANCE, _Acc(KIND_NCCL, COMPLETION_TRACKED, 0)
        elif bname == GENERIC_INSTANCE:
            key, a = GENERIC_INSTANCE, _Acc(KIND_GENERIC, COMPLETION_TRACKED, 0)
        elif hooked and caps.backend_kw:
            completion = COMPLETION_TRACKED if completion_hooks(b) else COMPLETION_UNKNOWN
            key, a = bname, _Acc(KIND_HOOKED, completion, 1)
        else:
            log.debug("hangwatch: backend %r records into no flight recorder", bname)
            continue
        if key not in seen:
            seen.add(key)
            yield key, a


def completion_hooks(b: Any) -> bool:
    """Whether a device backend pushes completions to torch's hooks.

    torch 2.15 exposes `Backend.supports_completion_hooks` (a property;
    a method on some builds). Absent or failing: no, the honest default,
    since the hook then retires entries at issue.
    """
    v = getattr(b, "supports_completion_hooks", False)
    try:
        return bool(v() if callable(v) else v)
    except Exception as e:  # a backend whose probe throws promises nothing
        log.debug("hangwatch: supports_completion_hooks failed: %s", e)
        return False


def _backend_name(b: Any) -> str:
    for attr in ("name", "getBackendName", "_get_backend_name"):
        fn = getattr(b, attr, None)
        if callable(fn):
            try:
                return str(fn())
            except Exception as e:
                log.debug("hangwatch: %s() failed: %s", attr, e)
    return type(b).__name__


def _json_handler(instance: str, kind: str, caps: _Caps) -> str:
    if kind == KIND_NCCL:
        return "dump_nccl_trace_json"
    if caps.backend_kw:
        return f"fr_trace_json?backend={instance}"
    return "fr_trace_json"


def _reader(rec_kind: str, instance: str, *, pickle: bool) -> Callable[..., bytes]:
    c = c10d_ext()
    if rec_kind == KIND_NCCL:
        fn = c._dump_nccl_trace if pickle else c._dump_nccl_trace_json
        return lambda **kw: bytes(fn(**kw))
    fn = c._dump_fr_trace if pickle else c._dump_fr_trace_json
    if capabilities().backend_kw:
        return lambda **kw: bytes(fn(backend=instance, **kw))
    return lambda **kw: bytes(fn(**kw))


def status_doc(recorders: Iterable[Recorder]) -> bytes:
    """FRSTATUS: every instance's status-only dump, embedded as torch wrote it.

    Spliced as bytes, not parsed and re-encoded: with two instances the
    round trip through json cost 50 us of the rank's CPU per poll, the C++
    dumps themselves about 5 us each (benchmarks/recorder_status.py).
    """
    parts = []
    for r in recorders:
        name = json.dumps(r.instance)
        try:
            raw = _reader(r.kind, r.instance, pickle=False)(includeCollectives=False)
            parts.append(b'{"instance":' + name.encode() + b',"dump":' + raw + b"}")
        except Exception as e:  # one unreadable instance must not hide the others
            err = json.dumps(f"{type(e).__name__}: {e}"[:300])
            parts.append(f'{{"instance":{name},"error":{err}}}'.encode())
    return (
        b'{"schema":"' + formats.FRSTATUS.encode() + b'","recorders":[' + b",".join(parts) + b"]}"
    )


def find(recorders: Iterable[Recorder], instance: str | None) -> Recorder | None:
    recs = list(recorders)
    if not instance:
        return recs[0] if recs else None
    return next((r for r in recs if r.instance == instance), None)


@contextlib.contextmanager
def _symbolize_without_inductor() -> Iterator[None]:
    """Let torch symbolize FR call sites without importing torch._inductor.

    torch's traceback symbolizer asks `torch._inductor.codecache.PyCodeCache.
    stack_frames_for_code` which source lines a frame of inductor-generated code
    stands for. In a rank that never imported torch._inductor, that lookup
    imports it: 822 modules and 1.25 s of a rank's CPU, on torch 2.13 CPU
    (measured; sympy, dynamo and inductor stay in the rank's memory). Such a
    rank has no generated code, so the true answer is "none" (None); a stand-in
    gives it for the length of the dump. The import lock is held meanwhile, so
    no other thread of the rank can import torch._inductor and get the
    stand-in; the dump itself imports nothing. torch looks the function up on
    every symbolization (checked: after a real import, the real one answers),
    so nothing of the stand-in outlives the dump.
    """
    if "torch._inductor" in sys.modules:
        yield
        return
    _imp.acquire_lock()
    try:
        if "torch._inductor" in sys.modules:  # imported while we waited for the lock
            yield
            return
        pkg = types.ModuleType("torch._inductor")
        codecache = types.ModuleType("torch._inductor.codecache")

        class PyCodeCache:
            @staticmethod
            def stack_frames_for_code(_path: str, _line: int) -> None:
                return None

        codecache.PyCodeCache = PyCodeCache  # type: ignore[attr-defined]
        pkg.codecache = codecache  # type: ignore[attr-defined]
        sys.modules["torch._inductor"] = pkg
        sys.modules["torch._inductor.codecache"] = codecache
        try:
            yield
        finally:
            del sys.modules["torch._inductor.codecache"]
            del sys.modules["torch._inductor"]
    finally:
        _imp.release_lock()


def dump(rec: Recorder, *, pickle: bool, stacks: bool = True) -> bytes:
    """The full dump of one instance, as torch produces it."""
    if pickle:
        read = _reader(rec.kind, rec.instance, pickle=True)
        if not stacks:
            return read(includeCollectives=True, includeStackTraces=False, onlyActive=False)
        with _symbolize_without_inductor():
            return read(includeCollectives=True, includeStackTraces=True, onlyActive=False)
    return _reader(rec.kind, rec.instance, pickle=False)(includeCollectives=True, onlyActive=False)


def dump_pickle(rec: Recorder) -> bytes:
    return dump(rec, pickle=True)


def dump_json(rec: Recorder) -> bytes:
    return dump(rec, pickle=False)
