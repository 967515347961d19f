"""Collect one rank's incident bundle: FR dump, Python stacks, GPU state, process state.

Each source has a timeout and a fallback, and every step records where its
data came from (RankMeta `sources`) or why it is missing (`errors`):
- FR: the hook's pickle handler (torch's own pickle, with call-site frames),
  else torch's C++ `fr_trace_json` (answers even while the GIL is held), else
  torch's dump-on-timeout file from `<run_dir>/fr/`.
- stacks: torch's `dump_traceback` handler, else `py-spy dump` (measured:
  on a SIGSTOPped process plain `py-spy dump` fails with "Failed to suspend
  process" and `--nonblocking` works, so a stopped rank goes straight to
  `--nonblocking`).
The rank directory is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from hangwatch.agent import endpoint, stackargs
from hangwatch.agent.procstate import process_state, state_name, thread_demand_ns
from hangwatch.agent.ranks import RankTracker

from hangwatch import formats, frtail, hook_protocol
from hangwatch.formats import FrSource, MissingReason, RankMeta, Recorder
from hangwatch.wire import pb

log = logging.getLogger("hangwatch.agent")

# torch's first pickle dump with stack traces symbolizes frames (~1.8 s
# measured idle, longer on a loaded node) and needs the GIL, so it is only
# waited for briefly once the C++ JSON dump, which needs neither, is in hand.
FR_PICKLE_GRACE_S = 0.5
FR_JSON_TIMEOUT_S = 3.0
TRACEBACK_TIMEOUT_S = 2.0
PYSPY_TIMEOUT_S = 5.0


@dataclass
class RankBundle:
    rank: int
    directory: str
    files: list[str]
    meta: RankMeta
    # Why this rank counts as not dumped ("" = dumped): text that starts with a MissingReason.
    failure: str = ""
    sources: dict[str, str] = field(default_factory=dict)


def gpu_snapshot() -> dict[str, Any]:
    """Node GPU state via NVML; on a machine without it, why not."""
    try:
        import pynvml
    except ImportError as e:
        return {"available": False, "reason": f"nvidia-ml-py not installed: {e}"}
    try:
        pynvml.nvmlInit()
    except Exception as e:
        return {"available": False, "reason": str(e) or type(e).__name__}
    try:
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            util = pynvml.nvmlDeviceGetUtilizationRates(h)
            procs = [
                {"pid": int(p.pid), "used_memory": int(p.usedGpuMemory or 0)}
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            ]
            devices.append(
                {
                    "index": i,
                    "name": _text(pynvml.nvmlDeviceGetName(h)),
                    "uuid": _text(pynvml.nvmlDeviceGetUUID(h)),
                    "memory_used": int(mem.used),
                    "memory_total": int(mem.total),
                    "utilization_gpu": int(util.gpu),
                    "processes": procs,
                }
            )
        return {"available": True, "devices": devices}
    except Exception as e:
        return {"available": False, "reason": f"NVML query failed: {e}"}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception as e:
            log.debug("nvmlShutdown: %s", e)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _fetch_fr(sock: str, rec: Recorder) -> tuple[bytes | None, str]:
    """(dump, error text) of one recorder instance: the pickle (with call-site
    frames) when it arrives within a short grace after the JSON dump, else the JSON dump."""
    errors: list[str] = []
    pickle_handler = f"{hook_protocol.FR_PICKLE}?{hook_protocol.INSTANCE_PARAM}={rec.instance}"
    json_handler = rec.json_handler or hook_protocol.FR_TRACE_JSON
    # Not a `with` block: leaving one waits for a pickle call still blocked on
    # the GIL; its own socket timeout ends that thread instead.
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hangwatch-fr")
    try:
        pickled = pool.submit(
            endpoint.call,
            sock,
            pickle_handler,
            timeout=FR_JSON_TIMEOUT_S + FR_PICKLE_GRACE_S,
        )
        as_json = pool.submit(endpoint.call, sock, json_handler, timeout=FR_JSON_TIMEOUT_S)
        json_data: bytes | None = None
        try:
            json_data = as_json.result()
        except (TimeoutError, endpoint.EndpointError) as e:
            errors.append(f"{json_handler}: {e}")
        try:
            return pickled.result(timeout=FR_PICKLE_GRACE_S), "; ".join(errors)
        except FutureTimeout:
            errors.append(
                f"{hook_protocol.FR_PICKLE}: no answer within {FR_PICKLE_GRACE_S:g}s of the JSON dump"
            )
        except (TimeoutError, endpoint.EndpointError) as e:
            errors.append(f"{hook_protocol.FR_PICKLE}: {e}")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return json_data, "; ".join(errors)


def _find_pyspy(pyspy: str) -> str | None:
    # A venv's console scripts sit beside its interpreter, which need not be
    # on PATH (e.g. `.venv/bin/python -m hangwatch agent`).
    return shutil.which(pyspy) or shutil.which(pyspy, path=os.path.dirname(sys.executable))


def pyspy_stacks(pyspy: str, pid: int, nonblocking: bool, with_locals: bool = False) -> str:
    """py-spy's dump, each thread's idle flag checked against its CPU time.

    py-spy's "idle" is the thread's OS state at one instant, and a thread
    computing in pure Python reads idle whenever it waits for the GIL
    another thread holds (measured: 5 dumps in 6 of a process with two
    spinning threads called one of them idle). So, when py-spy called some
    thread idle, the agent reads how long each thread was on a CPU or
    waiting for one over CPU_WINDOW_S right after the dump (not across it:
    py-spy stops the process while it reads it, and measured under a loaded
    suite that stop ate the window), and a thread py-spy called idle that
    wanted a real share of a core meanwhile is marked "active+cpu" (mark_busy).
    """
    exe = _find_pyspy(pyspy)
    if exe is None:
        raise RuntimeError(f"py-spy executable {pyspy!r} not found")
    cmd = [exe, "dump", "--pid", str(pid)]
    if nonblocking:
        cmd.append("--nonblocking")
    if with_locals:
        cmd.append("--locals")
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=PYSPY_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"py-spy timed out after {PYSPY_TIMEOUT_S:g}s") from e
    if out.returncode != 0:
        first = (out.stderr or out.stdout).strip().splitlines()[:2]
        raise RuntimeError(f"py-spy exit {out.returncode}: {' / '.join(first)}")
    if "(idle)" not in out.stdout:
        return out.stdout
    before, t0 = thread_demand_ns(pid), time.monotonic()
    time.sleep(CPU_WINDOW_S)
    after, window = thread_demand_ns(pid), time.monotonic() - t0
    return mark_busy(out.stdout, busy_threads(before, after, window))


# Paid only when py-spy reads some thread idle, in parallel across a node's
# ranks; a thread computing wants the CPU all of it, an idle one none.
CPU_WINDOW_S = 0.2
# A thread that wanted this share of a core over the window is computing.
BUSY_SHARE = 0.1
_IDLE_HEADER = re.compile(r"^Thread (\d+) \(idle\)", re.MULTILINE)


def busy_threads(before: dict[int, int], after: dict[int, int], window_s: float) -> set[int]:
    """Threads that wanted the CPU (ns on or waiting for one) for BUSY_SHARE of the window."""
    need = int(BUSY_SHARE * window_s * 1e9)
    return {tid for tid, t in after.items() if tid in before and t - before[tid] >= need}


def mark_busy(text: str, busy: set[int]) -> str:
    """py-spy's dump with "(idle)" read as "(active+cpu)" for the threads in `busy`."""
    return _IDLE_HEADER.sub(
        lambda m: f"Thread {m.group(1)} (active+cpu)" if int(m.group(1)) in busy else m.group(0),
        text,
    )


def _has_python_frames(text: str) -> bool:
    # dump_traceback prints "<no Python frame>" for threads it cannot read and
    # nothing at all when the GIL is held by a C call.
    return 'File "' in text


def _abort_file(run_dir: str, rank: int, rec: Recorder) -> str | None:
    """The dump of this recorder the hook wrote when torch aborted a group."""
    fr_dir = os.path.dirname(hook_protocol.fr_dump_prefix(run_dir))
    path = os.path.join(fr_dir, formats.abort_dump_name(rec.instance, rank))
    return path if os.path.isfile(path) else None


def _exit_file(run_dir: str, t: RankTracker, rec: Recorder) -> str | None:
    """The dump of this recorder the hook wrote as the rank's process died."""
    fr_dir = os.path.dirname(hook_protocol.fr_dump_prefix(run_dir))
    path = os.path.join(fr_dir, formats.exit_dump_name(rec.instance, t.rank, t.pid))
    return path if os.path.isfile(path) else None


def _watchdog_file(t: RankTracker, run_dir: str, rank: int) -> str | None:
    """torch's own dump-on-timeout file: where the hook pointed it, or where the job did."""
    prefix = t.info.watchdog_prefix or hook_protocol.fr_dump_prefix(run_dir)
    path = f"{prefix}{rank}"
    return path if os.path.isfile(path) else None


def collect_rank(
    t: RankTracker,
    *,
    run_dir: str,
    incident_id: str,
    pyspy: str,
    gpu: dict[str, Any],
    tail_context: int = 0,
    clock: tuple[int, int] | None = None,
) -> RankBundle:
    """One rank's bundle. `clock`: the agent's measured (offset, error) of this
    host's wall clock from the coordinator's, in ns, recorded in meta.json."""
    rank = t.rank
    state = process_state(t.pid, t.info.proc_starttime)
    alive = state in (pb.PROCESS_STATE_RUNNING, pb.PROCESS_STATE_UNRESPONSIVE)
    stopped = state == pb.PROCESS_STATE_STOPPED
    sources: dict[str, str] = {
        "fr": FrSource.NONE,
        "stacks": "none",
        "gpu": "nvml" if gpu.get("available") else "none",
        "process": "procfs",
    }
    errors: dict[str, str] = {}
    files: dict[str, bytes] = {}
    reachable = False

    # FR dumps: one file per recorder instance.
    fr_kind = t.info.fr_source or FrSource.WORKER_SERVER
    recs = list(t.recorders.values()) or [None]
    fr_names: list[str] = []
    fr_errors: list[str] = []
    for rec in recs:
        fr_name = f"{rec.file_stem if rec else formats.FR_FILE_PREFIX}{rank}"
        label = rec.instance if rec else formats.GENERIC_INSTANCE
        if alive and t.socket and rec is not None:
            data, err = _fetch_fr(t.socket, rec)
            if data is not None:
                files[fr_name] = data
                sources["fr"] = fr_kind
                reachable = True
            if err:
                fr_errors.append(f"{label}: {err}" if len(recs) > 1 else err)
        if fr_name not in files and rec is not None:
            # A gone rank's own last word first (as it died), else torch's abort.
            found = [
                (path, source)
                for path, source in (
                    # Named by pid: present only once this process died (it may
                    # have died since `alive` was read, answering nothing).
                    (_exit_file(run_dir, t, rec), FrSource.EXIT_FILE),
                    (_abort_file(run_dir, rank, rec), FrSource.ABORT_FILE),
                )
                if path is not None
            ]
            if found:
                path, source = found[0]
                with open(path, "rb") as f:
                    files[fr_name] = f.read()
                if sources["fr"] == FrSource.NONE:
                    sources["fr"] = source
        if fr_name in files:
            fr_names.append(fr_name)
    if not fr_names:
        # torch's file holds whichever instance its watchdog dumped (legacy
        # NCCL's, or the hooked backend's): the analyzer reads the backend from it.
        wd = _watchdog_file(t, run_dir, rank)
        if wd is not None:
            fr_name = f"{formats.FR_FILE_PREFIX}{rank}"
            with open(wd, "rb") as f:
                files[fr_name] = f.read()
            fr_names.append(fr_name)
            sources["fr"] = FrSource.WATCHDOG_FILE
    if fr_errors:
        errors["fr"] = "; ".join(fr_errors)
    if not fr_names:
        if stopped:
            errors["fr"] = "process stopped (SIGSTOP?): it cannot dump and left no watchdog file"
        elif not alive:
            errors["fr"] = f"process {state_name(state)}: no endpoint and no watchdog file"

    # Python stacks. When the rank's Python status handler has stopped
    # answering, its GIL is held: dump_traceback would only time out, so go
    # straight to py-spy.
    stacks = ""
    if not t.python_ok:
        errors["stacks"] = "Python handlers not answering (GIL held?): used py-spy"
    if alive and t.socket and t.python_ok:
        try:
            text = endpoint.call(
                t.socket, hook_protocol.DUMP_TRACEBACK, timeout=TRACEBACK_TIMEOUT_S
            ).decode("utf-8", "replace")
            reachable = True
            if _has_python_frames(text):
                stacks, sources["stacks"] = (
                    text,
                    FrSource.WORKER_SERVER if fr_kind != FrSource.THREAD else FrSource.THREAD,
                )
            else:
                errors["stacks"] = "dump_traceback returned no Python frames (GIL held?)"
        except (TimeoutError, endpoint.EndpointError) as e:
            errors["stacks"] = f"dump_traceback: {e}"
    if not stacks and (alive or stopped):
        for nonblocking in (True,) if stopped else (False, True):
            try:
                stacks = pyspy_stacks(pyspy, t.pid, nonblocking)
                sources["stacks"] = "py-spy"
                errors.pop("stacks", None)
                break
            except RuntimeError as e:
                errors["stacks"] = f"{errors.get('stacks', '')}; py-spy: {e}".lstrip("; ")
    if stacks:
        files[formats.STACKS_FILE] = stacks.encode()
    # Which peer a rank blocked in send/recv waits on, and whether each thread
    # is idle or running: only py-spy says (measured: ~40 ms a rank), and only
    # the peer arguments of its --locals are kept (agent.stackargs). It pauses
    # the rank for that long: measured, --nonblocking can pin another thread's
    # frames (an import in a handler thread) on the main thread of a busy rank.
    peer_stacks = ""
    if alive or stopped:
        try:
            peer_stacks = stackargs.keep_peer_args(
                pyspy_stacks(pyspy, t.pid, stopped, with_locals=True)
            )
        except RuntimeError as e:
            errors["peer_stacks"] = f"py-spy --locals: {e}"
    for fr_name in fr_names if tail_context > 0 else []:
        try:
            # meta.json (written below) carries every group's members.
            tail = frtail.tail_bytes(
                files[fr_name], context=tail_context, max_members=frtail.AGENT_MAX_MEMBERS
            )
            if tail is not None:
                files[formats.tail_name_for(fr_name)] = tail
        except ValueError as e:
            # The whole dump goes up instead: slower, never less evidence.
            errors["fr_tail"] = f"cannot cut a tail of {fr_name}: {e}"

    failure = ""
    if sources["fr"] == FrSource.NONE:
        if stopped:
            failure = MissingReason.PROCESS_STOPPED
        elif not alive:
            failure = f"{MissingReason.PROCESS_DEAD} {state_name(state)}"
        else:
            failure = MissingReason.NO_FR_DUMP.text(errors.get("fr", "unknown"))
    meta = RankMeta(
        rank=rank,
        host=t.info.host or socket.gethostname(),
        pid=t.pid,
        process_state=state_name(state),
        reachable=reachable,
        groups=t.info.groups,
        recorders=tuple(t.recorders.values()),
        sources=sources,
        gpu=gpu,
        errors=errors,
        exceptions=tuple(t.exceptions),  # the report's evidence and a thread-exception finding
        peer_stacks=peer_stacks or None,
        # A tails-first incident uploads meta.json and not stacks.txt: one
        # file fewer per rank is 4,096 fewer creates at the coordinator.
        stacks=stacks if tail_context > 0 and stacks else None,
        clock_offset_ns=clock[0] if clock else None,
        clock_error_ns=clock[1] if clock else None,
    )
    files[formats.META_FILE] = meta.to_bytes()
    directory = _write_rank_dir(run_dir, incident_id, rank, files)
    return RankBundle(
        rank=rank,
        directory=directory,
        files=sorted(files),
        meta=meta,
        failure=failure,
        sources=sources,
    )


def prune_bundles(run_dir: str, *, keep: int, protect: set[str]) -> list[str]:
    """Delete all but the `keep` newest incident bundles; returns what went.

    The full dumps of a tails-first incident wait here for an UPLOAD_FULL, so
    bundles are kept, but a training node's disk must not fill with them.
    """
    root = os.path.join(run_dir, formats.BUNDLES_DIR)
    try:
        entries = [e for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    # Newest first; the half-built dot-dirs of _write_rank_dir live one level down.
    entries.sort(key=lambda e: e.stat(follow_symlinks=False).st_mtime, reverse=True)
    removed = []
    for e in entries[max(0, keep) :]:
        if e.name in protect or e.name.startswith("."):
            continue
        shutil.rmtree(e.path, ignore_errors=True)
        removed.append(e.name)
    return removed


def rank_dir(run_dir: str, incident_id: str, rank: int) -> str:
    return os.path.join(run_dir, formats.BUNDLES_DIR, incident_id, f"rank_{rank}")


def _write_rank_dir(run_dir: str, incident_id: str, rank: int, files: dict[str, bytes]) -> str:
    final = rank_dir(run_dir, incident_id, rank)
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".rank_{rank}.", dir=parent)
    for name, data in files.items():
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(data)
    if os.path.isdir(final):
        # A repeated DUMP for the same incident replaces the earlier copy whole.
        old = tempfile.mkdtemp(prefix=f".old_rank_{rank}.", dir=parent)
        os.replace(final, os.path.join(old, "d"))
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    return final
