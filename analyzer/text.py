"""Small text helpers shared by the diagnosis sentences, the terminal report and the loader."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from hangwatch.analyzer.report import FindingKind

from hangwatch.rankspec import format_ranks


def rank_list(ranks: Iterable[int], *, limit: int = 12) -> str:
    """[0,1,2,3,7,9,10] -> '0-3,7,9,10'; long lists end with '... (N ranks)'."""
    return format_ranks(ranks, pairs_as_ranges=False, limit=limit, more="total")


# What torch calls a group nobody named (gloo's new_group without group_desc).
UNNAMED_DESCS = frozenset({"", "undefined"})


def group_sort_key(name: str) -> tuple[int, int, str]:
    """Groups in numeric order (0, 1, 2, 33, 108), names that are not numbers after them."""
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def group_desc(desc: str) -> str:
    """A group's description for people: '' for one nobody named (never 'undefined')."""
    return "" if desc in UNNAMED_DESCS else desc


def collective_text(op: str, seq: int) -> str:
    """'all_to_all #44790'; an op no dump still holds the entry of says so."""
    return f"{op} #{seq}" if op else f"#{seq} (op not in any dump)"


def seq_text(seq: int | None) -> str:
    """A sequence number for people: FR's -1 (nothing yet) is 'none'."""
    return "none" if seq is None or seq < 0 else str(seq)


# Findings whose ranks besides the blamed ones are the ones waiting on them.
_WAITERS_BESIDE_BLAMED = frozenset({FindingKind.P2P_UNMATCHED, FindingKind.CROSS_GROUP_DEADLOCK})


def finding_roles(
    kind: str, ranks: Iterable[int], blamed: Iterable[int]
) -> list[tuple[str, list[int]]]:
    """A finding's ranks split by role: [('blamed', [9]), ('waiting', [1])].

    A finding that blames nobody, or only blamed ranks, is one plain part
    ('', ranks): the role words appear only where both kinds stand side by side.
    """
    rs = sorted(set(ranks))
    bl = set(blamed)
    culprits = [r for r in rs if r in bl]
    others = [r for r in rs if r not in bl]
    if not culprits or not others:
        return [("", rs)]
    return [
        ("blamed", culprits),
        ("waiting" if kind in _WAITERS_BESIDE_BLAMED else "not blamed", others),
    ]


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


_FAULTHANDLER_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>.*)$')
_PYSPY_FRAME = re.compile(r"^\s+(?P<func>\S.*?) \((?P<file>[^()]*):(?P<line>\d+)\)\s*$")


# Frames of torch.distributed that are not a call into it: its debug and
# elastic servers run in threads of their own.
_TORCH_DIST = ("torch/distributed/",)
_TORCH_DIST_SERVERS = ("torch/distributed/debug", "torch/distributed/elastic/")
_THREAD_BOOTSTRAP = ("_bootstrap", "_bootstrap_inner", "run")
_MAIN_OUTERMOST = ("<module>", "_run_module_as_main", "_run_code")

Block = tuple[str, list[tuple[str, str, str]]]


def _norm(path: str) -> str:
    return path.replace("\\", "/")


def _started_by_threading(block: Block) -> bool:
    fr = block[1]
    if not fr:
        return False
    func, file, _ = fr[-1]
    return os.path.basename(_norm(file)) == "threading.py" and func.strip() in _THREAD_BOOTSTRAP


def _is_helper(block: Block) -> bool:
    """hangwatch's own threads: named hangwatch-*, a thread running its code
    (the main thread may pass through hangwatch's hook: not a helper), or a
    thread torch's C++ worker server entered into the hook's handlers (its
    outermost Python frame is hangwatch's, and not a module's top level)."""
    header, fr = block
    if "hangwatch" in header:
        return True
    if _started_by_threading(block):
        return any("/hangwatch/" in _norm(f) for _, f, _ in fr)
    return bool(fr) and _entered_from_cpp_into_hangwatch(fr[-1][0], fr[-1][1])


def _entered_from_cpp_into_hangwatch(func: str, file: str) -> bool:
    return "/hangwatch/" in _norm(file) and func.strip() not in _MAIN_OUTERMOST


def _in_collective(block: Block) -> bool:
    """Blocked in a torch.distributed call (not in one of its server threads)."""
    return any(
        any(t in _norm(f) for t in _TORCH_DIST)
        and not any(t in _norm(f) for t in _TORCH_DIST_SERVERS)
        for _, f, _ in block[1]
    )


def _is_main(block: Block) -> bool:
    """py-spy names it MainThread; in a faulthandler dump the main thread is
    the one not started by threading (its outermost frame is the script's
    `<module>`, or runpy's for `python -m`)."""
    header, fr = block
    if "MainThread" in header:
        return True
    if not fr:
        return False
    return fr[-1][0].strip() in _MAIN_OUTERMOST or not _started_by_threading(block)


def stack_excerpt(stacks: str, *, frames: int = 6) -> list[str]:
    """The innermost frames of the thread that matters.

    Reads both faulthandler-style dumps (torch's `dump_traceback`) and
    `py-spy dump` output. The thread is, in this order: one blocked in a
    torch.distributed call, the main thread (py-spy labels it MainThread; in
    faulthandler output it is the thread whose outermost frame is not
    threading's bootstrap: `<module>`, or runpy's for `python -m`), else the
    deepest; never one of hangwatch's own helper threads while another is
    there. Frames come back innermost first as `func (file:line)` with the
    file shortened to its base name.
    """
    blocks: list[Block] = []
    for line in stacks.splitlines():
        if not line.strip():
            continue
        m = _FAULTHANDLER_FRAME.match(line) or _PYSPY_FRAME.match(line)
        if m and blocks:
            blocks[-1][1].append((m["func"], m["file"], m["line"]))
        elif not line.startswith((" ", "\t")):
            blocks.append((line, []))
    blocks = [b for b in blocks if b[1]] or blocks
    if not blocks:
        return []
    ours = [b for b in blocks if not _is_helper(b)] or blocks

    def rank(b: Block) -> tuple[bool, bool, bool, int]:
        # A thread whose outermost frame is a module's top level is the main
        # one for sure; "not started by threading" also fits threads C++
        # started, and a main thread whose dump was cut at 100 frames.
        top = b[1][-1][0].strip() if b[1] else ""
        return (not _in_collective(b), top not in _MAIN_OUTERMOST, not _is_main(b), -len(b[1]))

    _header, chosen = min(ours, key=rank)
    out = [f"{func} ({os.path.basename(file)}:{line})" for func, file, line in chosen[:frames]]
    if len(chosen) > frames:
        out.append(f"... {len(chosen) - frames} outer frames")
    return out


def one_line(s: str) -> str:
    """The first line of an error message, capped: what a FileError shows."""
    s = s.strip().splitlines()[0] if s.strip() else "unknown error"
    return s[:300]
