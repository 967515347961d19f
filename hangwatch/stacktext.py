"""Python stack text, as torch's `dump_traceback` (faulthandler style) and `py-spy dump` print it.

The one reader of that text: the agent cuts py-spy's `--locals` down with it
(`agent/stackargs.py`), the analyzer names each rank's main thread and what it
is blocked in (`analyzer/stackdiag.py`), and the excerpt every report, page
and terminal shows is cut from the same thread (`analyzer/text.py`). Three
readers with their own patterns once disagreed on which thread was the main
one; one parser and one `main_rank` rule keep them from drifting again.

Formats read:

    Thread 0x00007f.. (most recent call first):        faulthandler header
      File "/x/train.py", line 11 in step              faulthandler frame
    Thread 9892 (idle): "MainThread"                   py-spy header (status, name)
        step (train.py:11)                             py-spy frame (4 spaces)
            Arguments:                                 py-spy --locals section (8)
                dst: 1                                 py-spy argument (12)

Pure text in, dataclasses out; no imports beyond the standard library, so it
is safe inside a rank and on a node.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Final

# Frames of torch.distributed; its debug and elastic servers run in threads of
# their own and are not a call the script made into it.
TORCH_DIST: Final = "torch/distributed/"
TORCH_DIST_SERVERS: Final = ("torch/distributed/debug", "torch/distributed/elastic/")

# torch.compile's compile-time modules: dynamo turning a frame into a graph,
# inductor generating, building and tuning code (its C++ and Triton builds and
# their probes), Triton's compiler. Compiled code that runs is not among them
# (dynamo runs cached code from its C frame evaluation, inductor's output from
# generated modules in its cache directory), so a main thread with one of these
# frames is compiling, or waiting on the compile cache's file lock that another
# rank holds while it compiles (measured, torch 2.13: `cpu_vec_isa.py`'s build
# under `filelock`, 12.5 s for two of three ranks on one cold cache).
TORCH_COMPILE_FILES: Final = (
    "torch/_dynamo/convert_frame.py",
    "torch/_inductor/compile_fx.py",
    "torch/_inductor/codecache.py",
    "torch/_inductor/async_compile.py",
    "torch/_inductor/cpp_builder.py",
    "torch/_inductor/cpu_vec_isa.py",
    "torch/_inductor/select_algorithm.py",
    "torch/_inductor/autotune_process.py",
    "triton/compiler/",
)

FAULTHANDLER_FRAME: Final = re.compile(
    r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>.*)$'
)
# py-spy indents frames by 4 and arguments by 12: fewer than 8 spaces keeps an
# argument whose value happens to end in "(x:1)" from reading as a frame.
PYSPY_FRAME: Final = re.compile(
    r"^[ \t]{1,7}(?P<func>\S.*?) \((?P<file>[^()]*):(?P<line>\d+)\)\s*$"
)
PYSPY_ARG: Final = re.compile(r"^ {12}(?P<name>\w+): (?P<value>-?\d+|None)\s*$")
PYSPY_SECTION: Final = re.compile(r"^ {8}(?P<section>Arguments|Locals):\s*$")
# py-spy's "Thread 9892 (idle)"; faulthandler's header carries no status.
PYSPY_STATUS: Final = re.compile(r"^Thread \S+ \((?P<status>(?:idle|active)[^()]*)\)")
# faulthandler prints "Stack (most recent call first):" for one thread alone.
THREAD_HEADERS: Final = ("Thread ", "Current thread ", "Stack (")

_THREAD_BOOTSTRAP: Final = ("_bootstrap", "_bootstrap_inner", "run")
_MAIN_OUTERMOST: Final = ("<module>", "_run_module_as_main", "_run_code")


@dataclass
class Frame:
    func: str
    file: str
    line: str
    args: dict[str, int | None] = field(default_factory=dict)  # py-spy --locals integers

    def text(self) -> str:
        """`func (file:line)` with the file cut to its base name: what excerpts show."""
        return f"{self.func} ({os.path.basename(self.file)}:{self.line})"

    @property
    def short(self) -> str:
        # py-spy names methods "Class.method"; faulthandler gives the bare name.
        return self.func.strip().rsplit(".", 1)[-1]

    @property
    def path(self) -> str:
        return self.file.replace("\\", "/")

    @property
    def in_dist(self) -> bool:
        """A call into torch.distributed (not one of its server threads)."""
        return TORCH_DIST in self.path and not any(s in self.path for s in TORCH_DIST_SERVERS)


@dataclass
class Thread:
    header: str
    frames: list[Frame] = field(default_factory=list)  # innermost first

    @property
    def status(self) -> str:
        """py-spy's "idle", "active", "active+gil"; "active+cpu" where the agent saw
        an "idle" thread use CPU right after the dump (waiting for the GIL, not
        idle); "" in faulthandler output."""
        m = PYSPY_STATUS.match(self.header)
        return m["status"] if m else ""

    @property
    def outermost(self) -> tuple[str, str] | None:
        return (self.frames[-1].func, self.frames[-1].file) if self.frames else None

    @property
    def main_rank(self) -> int:
        return main_rank(self.header, self.outermost)

    @property
    def is_helper(self) -> bool:
        """hangwatch's own threads: named hangwatch-*, a thread running its code
        that threading started (the main thread may pass through hangwatch's
        hook: not a helper), or one C++ entered into the hook's handlers."""
        if "hangwatch" in self.header:
            return True
        if not self.frames or self.main_rank < 2:
            return False
        return any("/hangwatch/" in f.path for f in self.frames)

    @property
    def in_collective(self) -> bool:
        return any(f.in_dist for f in self.frames)

    @property
    def in_torch_compile(self) -> bool:
        """Inside torch.compile's compiler (TORCH_COMPILE_FILES), not in a
        collective it may make while compiling, nor importing its modules: a
        `<module>` frame of those files is an import, and torch imports dynamo
        where nothing compiles (measured, torch 2.13: DistributedDataParallel's
        constructor imports torch._dynamo, 0.9 s of convert_frame.py's imports
        in a 2-rank gloo job, longer on a loaded machine)."""
        return not self.in_collective and any(
            f.func != "<module>" and m in f.path for f in self.frames for m in TORCH_COMPILE_FILES
        )


def parse_threads(text: str) -> list[Thread]:
    """Every thread with at least one frame, in the order printed.

    A line at column 0 that is not a thread header (py-spy's "Process 12:",
    "Python v3.11") ends the current thread, so its frames are never
    attached to the wrong one.
    """
    threads: list[Thread] = []
    current: Thread | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        m = FAULTHANDLER_FRAME.match(line) or PYSPY_FRAME.match(line)
        if m and current is not None:
            current.frames.append(Frame(m["func"], m["file"], m["line"]))
        elif (a := PYSPY_ARG.match(line)) and current is not None and current.frames:
            v = a["value"]
            current.frames[-1].args[a["name"]] = None if v == "None" else int(v)
        elif line.startswith(THREAD_HEADERS):
            current = Thread(header=line.rstrip())
            threads.append(current)
        elif not line[0].isspace():
            current = None
    return [t for t in threads if t.frames]


def main_rank(header: str, outermost: tuple[str, str] | None) -> int:
    """How surely a thread is the main one, from its header and its outermost
    frame (func, file): 0 surely (py-spy's "MainThread", or a module's top
    level outermost); 1 maybe (not started by threading: a main thread whose
    faulthandler dump was cut at 100 frames); 2 not (started by threading, or
    a thread torch's C++ worker server entered into hangwatch's hook
    handlers, whose outermost frame is hangwatch's)."""
    if '"MainThread"' in header:
        return 0
    if outermost is None:
        return 2
    func = outermost[0].strip().rsplit(".", 1)[-1]
    file = outermost[1].replace("\\", "/")
    if func in _MAIN_OUTERMOST:
        return 0
    if os.path.basename(file) == "threading.py" and func in _THREAD_BOOTSTRAP:
        return 2
    return 2 if "/hangwatch/" in file else 1


def main_thread(threads: list[Thread]) -> Thread | None:
    """The thread surest to be the main one (the first of equals), or None where
    none can be."""
    best = min(threads, key=lambda t: t.main_rank, default=None)
    return best if best is not None and best.main_rank < 2 else None


def thread_that_matters(threads: list[Thread]) -> Thread | None:
    """The thread a person should read first: one blocked in a torch.distributed
    call, else the main thread, else the deepest; never one of hangwatch's own
    helper threads while another is there."""
    ours = [t for t in threads if not t.is_helper] or threads
    return min(ours, key=lambda t: (not t.in_collective, t.main_rank, -len(t.frames)), default=None)


# Paths whose frames are not the user's: torch and installed packages, the
# interpreter's own library and frozen modules, hangwatch (but its hang zoo's
# jobs, which stand in for a user's script).
_NOT_USER: Final = ("site-packages", "dist-packages", "/lib/python3", "<frozen ")


def is_user_frame(f: Frame) -> bool:
    """A frame of the job's own code: not torch, an installed package, hangwatch
    or the standard library."""
    path = f.path
    if "/hangwatch/" in path and "/hangwatch/testing/" not in path:
        return False
    return not any(p in path for p in _NOT_USER)


@dataclass(frozen=True)
class ReadingOrder:
    """A rank's stack text as a page shows it: `shown` opens with the thread that
    matters, then the job's other threads as printed; hangwatch's own helper
    threads are `helpers` (folded, `helper_count` of them). `user_line`: the line
    of `shown` holding the innermost frame of the job's own code in the thread
    that matters (None when it has none). Nothing is dropped."""

    shown: str
    helpers: str = ""
    helper_count: int = 0
    user_line: int | None = None
    # That frame as `func (file:line)`: what a page shows before the stack.
    user_frame: str | None = None


def reading_order(text: str) -> ReadingOrder:
    lines = text.splitlines()
    preamble: list[str] = []
    blocks: list[list[str]] = []
    for line in lines:
        if line.startswith(THREAD_HEADERS):
            blocks.append([line])
        elif blocks:
            blocks[-1].append(line)
        else:
            preamble.append(line)
    if not blocks:
        return ReadingOrder(shown=text)
    parsed = [parse_threads("\n".join(b)) for b in blocks]
    threads = [p[0] if p else Thread(header=b[0]) for p, b in zip(parsed, blocks, strict=True)]
    chosen = thread_that_matters([t for t in threads if t.frames])
    first = [i for i, t in enumerate(threads) if t is chosen]
    rest = [i for i, t in enumerate(threads) if t is not chosen and not t.is_helper]
    helpers = [i for i, t in enumerate(threads) if t is not chosen and t.is_helper]
    shown = preamble + [line for i in first + rest for line in blocks[i]]
    user_line = None
    user = None
    if chosen is not None and first:
        user = next((f for f in chosen.frames if is_user_frame(f)), None)
        if user is not None:
            start = len(preamble)
            for k, line in enumerate(blocks[first[0]]):
                m = FAULTHANDLER_FRAME.match(line) or PYSPY_FRAME.match(line)
                if m and (m["func"], m["file"], m["line"]) == (user.func, user.file, user.line):
                    user_line = start + k
                    break
    return ReadingOrder(
        shown="\n".join(shown),
        helpers="\n".join(line for i in helpers for line in blocks[i]),
        helper_count=len(helpers),
        user_line=user_line,
        user_frame=user.text() if user is not None else None,
    )
