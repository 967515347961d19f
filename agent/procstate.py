"""A rank's process state from /proc/<pid>/stat."""

from __future__ import annotations

import os
from typing import Final

from hangwatch import hook_protocol
from hangwatch.wire import pb, process_state_name

_STATE = {
    "R": pb.PROCESS_STATE_RUNNING,
    "S": pb.PROCESS_STATE_RUNNING,
    "D": pb.PROCESS_STATE_RUNNING,  # uninterruptible I/O: alive, not stopped
    "I": pb.PROCESS_STATE_RUNNING,
    "T": pb.PROCESS_STATE_STOPPED,  # SIGSTOP
    "t": pb.PROCESS_STATE_STOPPED,  # tracing stop
    "Z": pb.PROCESS_STATE_ZOMBIE,
    "X": pb.PROCESS_STATE_GONE,
}


def process_state(pid: int, starttime: int | None = None) -> int:
    """A `pb.ProcessState`. A pid whose start time differs from `starttime` was reused: GONE."""
    return process_sample(pid, starttime)[0]


def process_sample(
    pid: int,
    starttime: int | None = None,
    waits: dict[int, int] | None = None,
    compilers: list[str] | None = None,
    io: list[int] | None = None,
) -> tuple[int, int]:
    """(`pb.ProcessState`, CPU time in ns, 0 when unknown) from /proc/<pid>/stat.
    With `waits`, also fills it with pid -> ns that process's main thread has
    spent runnable, waiting for a CPU (schedstat), for the rank and each
    descendant read (`RunqueueWait` turns them into one growing total). With
    `io`, appends the storage bytes of the rank and each descendant read
    (`_note_io`); their sum is the tree's, as the CPU time is.

    The CPU time is the rank's and its children's: user + system over all its
    threads, plus what its children used (reaped ones from its own stat, live
    ones from theirs, found through its main thread's `children` list). A
    `torch.compile` does its work in compile worker processes and their
    compilers while the rank's own threads wait (measured on a cold cache: 14.2 s
    to compile a two-layer model on 2 cores, the rank's own threads at 0.0-0.01
    cores for 10 of them): counted alone, a compiling rank reads idle. A rank with no children costs
    one more small read, about 20 us a poll in all."""
    fields = hook_protocol.proc_stat_fields(pid)
    if fields is None or not fields:
        return pb.PROCESS_STATE_GONE, 0
    if starttime is not None and len(fields) > 19 and int(fields[19]) != starttime:
        return pb.PROCESS_STATE_GONE, 0
    cpu_ns = _cpu_ns(fields)
    # Readable, not non-zero: the kernel charges CPU time a tick at a time to
    # whichever task the tick lands in, so a rank's launcher that ran 15 ms
    # and then only waits on its working children can read 0 ticks of its
    # own; their time is still the tree's (a full run here read a spinning
    # child's parent as 0 for 20 s).
    if cpu_ns is not None:
        if waits is not None:
            _note_wait(pid, waits)
        if io is not None:
            _note_io(pid, io)
        cpu_ns += _children_cpu_ns(pid, MAX_DESCENDANTS, waits, compilers, io)
    return _STATE.get(fields[0], pb.PROCESS_STATE_RUNNING), cpu_ns or 0


def _note_wait(pid: int, waits: dict[int, int]) -> None:
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            waits[pid] = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        pass  # no schedstat (CONFIG_SCHED_INFO off), or gone meanwhile


def _note_io(pid: int, io: list[int]) -> None:
    """read_bytes + write_bytes of /proc/<pid>/io: what reached the storage
    layer (a disk, a network filesystem). Not rchar/wchar, which count every
    read() and write(), pipes, ttys and page-cache hits included: a hung rank
    whose logging thread writes a line a second must not read as working, and
    a cache hit costs CPU, which the CPU time sees. Like CPU time, a reaped
    child's counts are added to its parent's (the kernel's wait_task_zombie),
    so the sum over the live tree behaves as the CPU sum does and `CpuTotal`
    keeps it growing. Unreadable without task I/O accounting, or across users
    without ptrace rights: nothing is appended, and a tree with no reading
    reports 0, unknown."""
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            raw = f.read()
    except OSError:
        return
    # By name, not by line: rchar and wchar come first and count every read()
    # and write(); a kernel that listed fields differently must not make a
    # hung rank's socket traffic read as storage.
    got = 0
    found = 0
    for line in raw.split(b"\n"):
        name, _, value = line.partition(b":")
        if name in (b"read_bytes", b"write_bytes"):
            try:
                got += int(value)
            except ValueError:
                return
            found += 1
    if found == 2:
        io.append(got)


class CpuTotal:
    """A rank's CPU time (its own and its descendants', `process_sample`) as one
    total that only grows: each poll adds the sample's increase since the last
    and a decrease adds nothing. The storage I/O sum (`_note_io`) is kept the
    same way, for the same reasons.

    Why: the sum over the live process tree falls whenever a descendant's time
    leaves it unseen: a child reaped between the read of its parent's stat and
    the read of the parent's children list, or one whose parent ignores SIGCHLD
    (its time then goes nowhere), or an orphan re-parented outside the tree.
    The coordinator reads any fall as a new process behind the rank and starts
    its CPU window over (`records.RateWindow.note`), so the rank reads "unknown"
    (idle) for the next half window. Measured: three ranks compiling on one
    cold inductor cache on 2 cores beside three CPU-bound processes, sampled
    at 50 Hz: one fall of 0.42 s in 31 s; in one full test run in six the
    single lock holder read unknown at the instant the job had been quiet 9 s,
    so the two ranks waiting on its lock no longer counted as working and the
    job was paged as hung while it compiled. A fall that is later found again
    (the reaped child's time shows up in its parent's) is counted twice: an
    over-count of one child's CPU, only around a process's exit, which a hung
    rank does not do."""

    def __init__(self) -> None:
        self.total_ns = 0
        self._last = 0

    def update(self, sample_ns: int) -> int:
        """The total after this poll's sample; 0 until the first readable one."""
        if sample_ns <= 0:
            return self.total_ns  # unreadable this poll (the process is going)
        if self._last == 0:
            self.total_ns = sample_ns
        elif sample_ns > self._last:
            self.total_ns += sample_ns - self._last
        self._last = sample_ns
        return self.total_ns


class RunqueueWait:
    """A rank's time spent runnable but not running, ns, as one total that only
    grows: each process's own schedstat wait is added by its increase since the
    last poll. (Unlike CPU time, a child's wait is not folded into its parent's
    when it is reaped, so the plain sum would drop whenever a compile worker
    exits, and a drop reads as a new process.)

    Why it counts as work: on an oversubscribed node a compiling rank's
    compilers get a fraction of a CPU and its CPU rate alone can fall under the
    busy mark, while it is as busy as a process can be. Measured: three ranks
    compiling on one cold inductor cache on 2 cores, with two other CPU-bound
    processes beside them, read "ranks 0-2 idle" for 13 s and were paged.
    """

    def __init__(self) -> None:
        self.total_ns = 0
        self._last: dict[int, int] = {}

    def update(self, waits: dict[int, int]) -> int:
        for pid, ns in waits.items():
            prev = self._last.get(pid)
            if prev is not None and ns > prev:
                self.total_ns += ns - prev
        # Only the processes read this poll (at most MAX_DESCENDANTS + 1):
        # exited ones drop out.
        self._last = waits
        return self.total_ns


# Descendants read per poll at most (a DataLoader with 64 workers, each with a
# pin-memory thread, is far below): bounds what one poll can cost.
MAX_DESCENDANTS = 256


def _cpu_ns(fields: list[str]) -> int | None:
    """utime + stime + cutime + cstime (fields 14-17 of stat; reaped children's
    time is in the last two), in ns; None when unreadable."""
    try:
        return sum(int(x) for x in fields[11:15]) * _TICK_NS if len(fields) > 14 else None
    except ValueError:
        return None


def _children_cpu_ns(
    pid: int,
    budget: int,
    waits: dict[int, int] | None = None,
    compilers: list[str] | None = None,
    io: list[int] | None = None,
) -> int:
    """CPU time of `pid`'s live descendants, each counted with its own reaped
    children, depth first, reading at most `budget` of them. A child that exits
    between two reads is missed for that poll only: its time moves into its
    parent's once reaped. With `compilers`, appends the names of descendants
    that are compilers (COMPILERS)."""
    total = 0
    todo = _children(pid)
    while todo and budget > 0:
        child = todo.pop()
        budget -= 1
        got = hook_protocol.proc_stat(child)
        if got is not None and got[1]:
            comm, fields = got
            if compilers is not None and comm in COMPILERS:
                compilers.append(comm)
            total += _cpu_ns(fields) or 0
            if waits is not None:
                _note_wait(child, waits)
            if io is not None:
                _note_io(child, io)
            todo.extend(_children(child))
    return total


# Processes that build code: inductor's cpp_builder runs g++ (cc1plus, as,
# collect2, ld under it) for CPU kernels, triton ptxas for GPU ones; nvcc and
# clang for extensions. One of them alive under a rank is a compile at work.
COMPILERS: Final = frozenset(
    {"cc1plus", "cc1", "g++", "gcc", "c++", "cc", "clang", "clang++", "as", "ld"}
    | {"ld.gold", "ld.lld", "collect2", "nvcc", "ptxas", "cicc", "fatbinary", "nvlink"}
)


# Threads of one process whose children are read: bounds a poll's cost for a
# process with very many threads (a real rank has tens).
MAX_THREADS = 512


def _children(pid: int) -> list[int]:
    """Children of every thread of `pid` (CONFIG_PROC_CHILDREN lists a child
    under the thread that started it, while that thread lives). Not the main
    thread's alone: measured during a real inductor compile with the main
    thread's list only, the compiling rank read near 0 cores for seconds, then
    its CPU came back in one burst as its compilers were reaped; with every
    thread's list it reads about one core throughout."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tids[:MAX_THREADS]:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue
    return out


def state_name(state: int) -> str:
    return process_state_name(state)


def thread_demand_ns(pid: int) -> dict[int, int]:
    """Each thread's time on a CPU plus its time waiting on a run queue, in ns
    (/proc/<pid>/task/<tid>/schedstat); {} if the process is gone.

    A thread that computes wants the CPU whether or not a loaded machine
    gives it one: the wait counts too. Where schedstat cannot be read, the
    thread's CPU time from stat (10 ms ticks) stands in.
    """
    out: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        if not tid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                run, wait = f.read().split()[:2]
            out[int(tid)] = int(run) + int(wait)
            continue
        except (OSError, ValueError):
            pass  # no schedstat here: fall back to stat
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                raw = f.read().decode("ascii", "replace")
        except OSError:
            continue  # the thread ended meanwhile
        fields = raw[raw.rfind(")") + 2 :].split()
        if len(fields) > 12:
            out[int(tid)] = (int(fields[11]) + int(fields[12])) * _TICK_NS  # utime, stime
    return out


_TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
