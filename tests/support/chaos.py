"""Fault injectors for hardening tests and the soak benchmark: real processes, real faults.

- `CoordinatorProc`: `hangwatch server` as a child process on a port it keeps
  across restarts, so `kill()` (SIGKILL) and `start()` look to agents exactly
  like a coordinator crash and a supervisor restarting it.
- `RelayProc`: `hangwatch relay` as a child process, with its /metrics.
- `AgentProc`: `hangwatch agent` as a child process, optionally inside a network
  namespace and/or with a skewed wall clock.
- `TmpfsMount`: a small tmpfs mounted over a directory, to make it full or read-only.
- `NetnsLink`: a network namespace joined to the host by a veth pair; taking
  the host end down partitions everything inside it.
- `skewed_clock_env`: environment that shifts a process's wall clock (and only that).
- `rss_bytes`: a process's resident set size from /proc.

Each injector that needs privileges (mount, ip netns) raises `FaultUnavailable`
with the reason when the host refuses, so tests can skip and say why. Nothing
here imports torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from hangwatch.agent.collector import pyspy_stacks

from hangwatch.config import env_var
from hangwatch.testing.ports import free_port
from tests.support.serving import wait_serving


class FaultUnavailable(RuntimeError):
    """This host cannot inject the fault (no privilege, missing tool); the message says why."""


class ChaosError(RuntimeError):
    """A managed process failed; the message carries its log tail."""


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        return path.read_bytes()[-limit:].decode("utf-8", "replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"


def _clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    # The caller's own hangwatch settings (token, ports, run dir) must not leak in.
    out = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    out.update(extra or {})
    return out


def _kill(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGKILL) -> int | None:
    if proc is None:
        return None
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
    return proc.wait()


def _stop(
    proc: subprocess.Popen[bytes] | None, grace: float = 10.0, log_path: Path | None = None
) -> int | None:
    """SIGTERM, then SIGKILL after `grace` seconds; returns the exit code.
    A process still there at SIGKILL has its stacks appended to `log_path`
    first (py-spy, from outside: it answers even with the GIL held), so a
    failed test says where the stop stuck."""
    if proc is None:
        return None
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(grace)
        except subprocess.TimeoutExpired:
            if log_path is not None:
                _append_stacks(proc.pid, log_path, f"still running {grace:g} s after SIGTERM")
    return _kill(proc)


def _append_stacks(pid: int, log_path: Path, why: str) -> None:
    try:
        text = pyspy_stacks("py-spy", pid, nonblocking=False)
    except RuntimeError as e:
        text = f"py-spy could not dump it: {e}\n"
    with open(log_path, "a", encoding="utf-8") as f:
        f.write(f"--- the test harness: pid {pid} {why}; its stacks:\n{text}")


def rss_bytes(pid: int) -> int:
    """Resident set size of `pid` (VmRSS), in bytes."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ChaosError(f"pid {pid} has no VmRSS (a zombie?)")


# ---- coordinator ------------------------------------------------------------------


class _ChildProc:
    """A child process the test starts, SIGKILLs and restarts; its output, across
    every start, goes to `log_path`."""

    what = "process"
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise ChaosError(f"{self.what} not started")
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> float:
        """SIGKILL (no shutdown code runs) and reap; returns the monotonic kill time."""
        t = time.monotonic()
        _kill(self.proc)
        return t

    def stop(self, grace: float = 10.0) -> int | None:
        return _stop(self.proc, grace, self.log_path)

    def log(self) -> str:
        return _tail(self.log_path, 1 << 20)

    def start(self) -> object:
        raise NotImplementedError

    def __enter__(self) -> Self:
        """Started (unless already running); stopped on exit."""
        if not self.alive():
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class CoordinatorProc(_ChildProc):
    """`python -m hangwatch server` that can be SIGKILLed and restarted on the same
    gRPC port and data dir. The HTTP port is new on every start (read it from
    `http`). Its output, across every restart, goes to `<data_dir>/../<name>.log`
    so a read-only or full data dir does not also lose the log."""

    what = "coordinator"

    def __init__(
        self,
        data_dir: Path,
        *,
        host: str = "127.0.0.1",
        grpc_port: int | None = None,
        stall_timeout: float = 2.0,
        dump_deadline: float = 15.0,
        agent_lost_timeout: float = 3.0,
        token: str | None = None,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.grpc_port = grpc_port if grpc_port is not None else free_port(host)
        self.token = token
        self.args = [
            "--host", host, "--grpc-port", str(self.grpc_port), "--http-port", "0",
            "--data-dir", str(self.data_dir), "--stall-timeout", str(stall_timeout),
            "--dump-deadline", str(dump_deadline), "--agent-lost-timeout", str(agent_lost_timeout),
            *extra_args,
        ]  # fmt: skip
        self.log_path = log_path or self.data_dir.parent / f"{self.data_dir.name}.coordinator.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = ""
        self.starts = 0

    @property
    def grpc(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def start(self, timeout: float = 60.0) -> float:
        """Start and wait until it serves; returns the monotonic time it began serving."""
        if self.alive():
            raise ChaosError("coordinator already running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        environ = _clean_env({env_var("token"): self.token} if self.token else None)
        with open(self.log_path, "ab") as log:
            log.write(f"--- start #{self.starts + 1} at {time.time():.3f}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "hangwatch", "server", *self.args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=environ,
            )  # fmt: skip
        self.starts += 1
        info = wait_serving(
            self.proc, self.data_dir, timeout, lambda: _tail(self.log_path), ChaosError
        )
        self.http = info.http
        return time.monotonic()

    def restart(self, timeout: float = 60.0) -> float:
        self.kill()
        return self.start(timeout)

    def api(self, path: str, timeout: float = 10.0) -> Any:
        req = urllib.request.Request(self.http + path)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def health(self, timeout: float = 5.0) -> Any:
        """The gRPC Health answer (a `pb.HealthResponse`)."""
        import grpc

        from hangwatch.wire import pb, rpc

        with grpc.insecure_channel(self.grpc) as ch:
            return rpc.CoordinatorStub(ch).Health(pb.HealthRequest(), timeout=timeout)


# ---- relay ------------------------------------------------------------------------------

# What `hangwatch relay` logs once each of its streams to the coordinator is up.
RELAY_STREAMS_UP = ("forwarding progress to", "carrying agents' commands from")


class RelayProc(_ChildProc):
    """`python -m hangwatch relay` for `coordinator`, on ports of its own (0).
    `start` returns once both its streams to the coordinator are up: an agent
    that came before them would be turned away and go straight."""

    what = "relay"

    def __init__(
        self, *, coordinator: str, log_path: Path, token: str | None = None, window: float = 0.1
    ) -> None:
        self.log_path = log_path
        self.token = token
        self.cmd = [
            sys.executable, "-m", "hangwatch", "relay", "--grpc-port", "0", "--http-port", "0",
            "--relay-window", str(window), "--coordinator", coordinator,
        ]  # fmt: skip
        self.grpc = self.http = ""

    def start(self, timeout: float = 60.0) -> None:
        if self.alive():
            raise ChaosError("relay already running")
        environ = _clean_env({env_var("token"): self.token} if self.token else None)
        # Its one line of addresses on a pipe of its own: written into the log
        # beside its log records, the line and its newline were seen split by one.
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                env=environ,
            )  # fmt: skip
        assert self.proc.stdout is not None
        with self.proc.stdout:  # it writes nothing else there
            line = self.proc.stdout.readline().decode(errors="replace")
        if not line.startswith("hangwatch relay: "):
            self.kill()
            raise ChaosError(f"relay did not start: {line!r}\n{_tail(self.log_path)}")
        fields = dict(f.split("=", 1) for f in line.split()[2:])
        self.grpc, self.http = fields["grpc"], fields["http"]
        end = time.monotonic() + timeout
        while not all(up in _tail(self.log_path, 1 << 20) for up in RELAY_STREAMS_UP):
            if not self.alive() or time.monotonic() > end:
                self.kill()
                raise ChaosError(f"relay did not reach its coordinator:\n{_tail(self.log_path)}")
            time.sleep(0.1)

    def metrics(
        self, timeout: float = 10.0
    ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Its /metrics, by (sample name, sorted labels)."""
        from prometheus_client.parser import text_string_to_metric_families

        req = urllib.request.Request(f"http://{self.http}/metrics")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }


# ---- agent ------------------------------------------------------------------------------


class AgentProc(_ChildProc):
    """`python -m hangwatch agent` for one node's run dir; killable and restartable.

    `netns` runs it inside that network namespace (`ip netns exec`, which execs,
    so the pid is the agent's own). `clock_offset_s` shifts its wall clock.
    """

    what = "agent"

    def __init__(
        self,
        *,
        coordinator: str,
        run_dir: Path,
        job_id: str,
        node_id: str,
        log_path: Path,
        poll_interval: float = 0.5,
        token: str | None = None,
        netns: str | None = None,
        extra_env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.run_dir = Path(run_dir)
        self.log_path = log_path
        self.netns = netns
        self.token = token
        self.extra_env = dict(extra_env or {})
        self.cmd = [
            sys.executable, "-m", "hangwatch", "agent", "--coordinator", coordinator,
            "--run-dir", str(self.run_dir), "--job-id", job_id, "--node-id", node_id,
            "--poll-interval", str(poll_interval), *extra_args,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, *, extra_env: Mapping[str, str] | None = None) -> None:
        if self.alive():
            raise ChaosError("agent already running")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        environ = _clean_env({**self.extra_env, **(extra_env or {})})
        if self.token:
            environ[env_var("token")] = self.token
        cmd = (["ip", "netns", "exec", self.netns] if self.netns else []) + self.cmd
        with open(self.log_path, "ab") as log:
            log.write(f"--- start #{self.starts + 1} at {time.time():.3f}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=environ
            )
        self.starts += 1

    def check(self) -> None:
        """Raise with the log tail if the agent died on its own."""
        if self.proc is not None and self.proc.poll() is not None:
            raise ChaosError(f"agent exited with {self.proc.returncode}:\n{_tail(self.log_path)}")


# ---- clock skew -----------------------------------------------------------------------

# An LD_PRELOAD shim that moves CLOCK_REALTIME (clock_gettime, gettimeofday,
# time) by a fixed offset and leaves every other clock alone: a node whose NTP
# is wrong still has a true monotonic clock. It works below Python, so torch's
# C++ FR timestamps and the agent's time.time() move together, as on a real
# node. libfaketime would do, but its clock_nanosleep wrapper breaks Python's
# time.sleep (EINVAL) when only the wall clock is faked.
_SKEW_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sys/time.h>
#include <time.h>

#ifndef OFFSET_NS
#error "build with -DOFFSET_NS=<nanoseconds>"
#endif

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);
static clock_gettime_fn real_clock_gettime;

__attribute__((constructor)) static void skew_init(void) {
  real_clock_gettime = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
}

int clock_gettime(clockid_t clk, struct timespec *ts) {
  if (!real_clock_gettime) skew_init();
  int rc = real_clock_gettime(clk, ts);
  if (rc == 0 && (clk == CLOCK_REALTIME || clk == CLOCK_REALTIME_COARSE)) {
    long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + (long long)(OFFSET_NS);
    ts->tv_sec = ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
  }
  return rc;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
  (void)tz;
  struct timespec ts;
  int rc = clock_gettime(CLOCK_REALTIME, &ts);
  if (rc == 0 && tv) {
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = ts.tv_nsec / 1000;
  }
  return rc;
}

time_t time(time_t *out) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  if (out) *out = ts.tv_sec;
  return ts.tv_sec;
}
"""


def skewed_clock_env(offset_s: float, build_dir: Path) -> dict[str, str]:
    """Environment that runs a process with its wall clock shifted by `offset_s`.

    Compiles the shim into `build_dir` with the system C compiler (once per
    offset); FaultUnavailable when there is none.
    """
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise FaultUnavailable("no C compiler (cc) to build the clock-skew shim")
    offset_ns = round(offset_s * 1e9)
    build_dir.mkdir(parents=True, exist_ok=True)
    lib = build_dir / f"skew_{offset_ns}.so"
    if not lib.exists():
        src = build_dir / "skew.c"
        src.write_text(_SKEW_C)
        r = subprocess.run(
            [cc, "-shared", "-fPIC", "-O2", f"-DOFFSET_NS={offset_ns}LL", "-o", str(lib), str(src), "-ldl"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if r.returncode != 0:
            raise FaultUnavailable(f"building the clock-skew shim failed: {r.stderr.strip()}")
    return {"LD_PRELOAD": str(lib)}


# ---- disks --------------------------------------------------------------------------------


def _run(cmd: Sequence[str], what: str) -> None:
    if shutil.which(cmd[0]) is None:
        raise FaultUnavailable(f"{what}: `{cmd[0]}` is not installed")
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise FaultUnavailable(f"{what}: `{' '.join(cmd)}` failed: {r.stderr.strip()}")


class TmpfsMount:
    """A tmpfs of `size_bytes` mounted over `path` (created if needed).

    `fill(leave_bytes)` writes a filler file until about that much room is
    left; `free()` deletes it. `read_only(True/False)` remounts. Root ignores
    file modes, so a read-only mount is the only honest "read-only dir" for
    a coordinator running as root.
    """

    FILLER = ".chaos-filler"

    def __init__(self, path: Path, size_bytes: int) -> None:
        self.path = Path(path)
        self.size_bytes = size_bytes
        self.mounted = False

    def mount(self) -> TmpfsMount:
        self.path.mkdir(parents=True, exist_ok=True)
        _run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size_bytes}", "tmpfs", str(self.path)],
            "mounting a tmpfs",
        )
        self.mounted = True
        return self

    def fill(self, leave_bytes: int) -> int:
        """Fill the mount until about `leave_bytes` remain; returns the bytes left."""
        st = os.statvfs(self.path)
        avail = st.f_bavail * st.f_frsize
        want = max(0, avail - leave_bytes)
        # Unbuffered: a buffered file that hit ENOSPC would raise it again when
        # closed, flushing the block it could not write (fill(0) always does).
        with open(self.path / self.FILLER, "ab", buffering=0) as f:
            block = b"\0" * (1 << 16)
            while want > 0:
                try:
                    n = f.write(block[: min(want, len(block))])
                except OSError:
                    break
                want -= n or 0
        st = os.statvfs(self.path)
        return int(st.f_bavail * st.f_frsize)

    def free(self) -> None:
        (self.path / self.FILLER).unlink(missing_ok=True)

    def read_only(self, ro: bool) -> None:
        opt = "remount,ro" if ro else "remount,rw"
        _run(["mount", "-o", opt, str(self.path)], f"remounting {self.path} {opt}")

    def unmount(self) -> None:
        if self.mounted:
            # Lazy: a coordinator killed mid-write may still hold a file open.
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=30)
            self.mounted = False

    def __enter__(self) -> TmpfsMount:
        return self.mount()

    def __exit__(self, *exc: object) -> None:
        self.unmount()


# ---- network ------------------------------------------------------------------------------


class NetnsLink:
    """A network namespace joined to the host by a /30 veth pair.

    Processes started with `prefix()` (or `AgentProc(netns=...)`) reach the
    host only through `host_ip`; `partition()` takes the host end of the pair
    down, which cuts them off in both directions without touching anything
    else on the host, and `heal()` brings it back. Names and the subnet are
    derived from the pid so parallel test runs do not collide.
    """

    def __init__(self, tag: str = "a") -> None:
        n = os.getpid() % 4096
        self.name = f"hw{n}{tag}"
        self.host_if = f"hwh{n}{tag}"[:15]
        self.ns_if = f"hwn{n}{tag}"[:15]
        # One 10.213.0.0/16 /30 block per (pid, tag): host .1, namespace .2.
        k = (n * 4 + ord(tag[0]) % 4) * 4
        self.host_ip = f"10.213.{k >> 8}.{(k & 0xFF) + 1}"
        self.ns_ip = f"10.213.{k >> 8}.{(k & 0xFF) + 2}"
        self.created = False

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def create(self) -> NetnsLink:
        steps = [
            ["ip", "netns", "add", self.name],
            ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
            ["ip", "link", "set", self.ns_if, "netns", self.name],
            ["ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if],
            ["ip", "link", "set", self.host_if, "up"],
            [*self.prefix(), "ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if],
            [*self.prefix(), "ip", "link", "set", self.ns_if, "up"],
            [*self.prefix(), "ip", "link", "set", "lo", "up"],
        ]
        try:
            for i, cmd in enumerate(steps):
                _run(cmd, "creating a network namespace")
                if i == 0:
                    self.created = True
        except FaultUnavailable:
            self.destroy()
            raise
        return self

    def partition(self) -> None:
        _run(["ip", "link", "set", self.host_if, "down"], "partitioning")

    def heal(self) -> None:
        _run(["ip", "link", "set", self.host_if, "up"], "healing the partition")

    def destroy(self) -> None:
        if not self.created:
            return
        # Deleting the namespace deletes its veth end, and with it the host end.
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30)
        self.created = False

    def __enter__(self) -> NetnsLink:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def two_node_agents(
    coord: CoordinatorProc, tmp_path: Path, job: str, token: str | None = None, **node_b: Any
) -> tuple[list[Path], list[AgentProc]]:
    """Node A's and node B's run dirs (`<tmp>/node-a`, `<tmp>/node-b`) and their agents,
    not started; `node_b` are the AgentProc options only node B's agent gets (the fault)."""
    runs = [tmp_path / "node-a", tmp_path / "node-b"]
    agents = [
        AgentProc(
            coordinator=coord.grpc,
            run_dir=runs[i],
            job_id=job,
            node_id=f"node-{'ab'[i]}",
            log_path=tmp_path / f"agent-{'ab'[i]}.log",
            token=token,
            **(node_b if i == 1 else {}),
        )
        for i in range(2)
    ]
    return runs, agents
