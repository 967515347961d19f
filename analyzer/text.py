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
    """A sequence number for people, as every report and page writes it: "#5";
    FR's -1 (nothing yet) reads "none"."""
    return "none" if seq is None or seq < 0 else f"#{seq}"


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


def _short(func: str) -> str:
    # py-spy names methods "Class.method"; faulthandler gives the bare name.
    return func.strip().rsplit(".", 1)[-1]


def main_rank(header: str, outermost: tuple[str, str] | None) -> int:
    """How surely a thread is the main one, from its header and its outermost
    frame (func, file): 0 surely (py-spy's "MainThread", or a module's top
    level outermost); 1 maybe (not started by threading: a main thread whose
    faulthandler dump was cut at 100 frames); 2 not (started by threading, or
    a thread torch's C++ worker server entered into hangwatch's hook
    handlers, whose outermost frame is hangwatch's). The one rule for the
    stack excerpt and the stack diagnosis."""
    if '"MainThread"' in header:
        return 0
    if outermost is None:
        return 2
    func, file = _short(outermost[0]), _norm(outermost[1])
    if func in _MAIN_OUTERMOST:
        return 0
    if os.path.basename(file) == "threading.py" and func in _THREAD_BOOTSTRAP:
        return 2
    return 2 if "/hangwatch/" in file else 1


def _outermost(block: Block) -> tuple[str, str] | None:
    return (block[1][-1][0], block[1][-1][1]) if block[1] else None


def _is_helper(block: Block) -> bool:
    """hangwatch's own threads: named hangwatch-*, a thread running its code
    that threading started (the main thread may pass through hangwatch's
    hook: not a helper), or one C++ entered into the hook's handlers."""
    header, fr = block
    if "hangwatch" in header:
        return True
    if not fr or main_rank(header, _outermost(block)) < 2:
        return False
    return any("/hangwatch/" in _norm(f) for _, f, _ in fr)


def _in_collective(block: Block) -> bool:
    """Blocked in a torch.distributed call (not in one of its server threads)."""
    return any(
        any(t in _norm(f) for t in _TORCH_DIST)
        and not any(t in _norm(f) for t in _TORCH_DIST_SERVERS)
        for _, f, _ in block[1]
    )


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

    def rank(b: Block) -> tuple[bool, int, int]:
        return (not _in_collective(b), main_rank(b[0], _outermost(b)), -len(b[1]))

    _header, chosen = min(ours, key=rank)
    out = [f"{func} ({os.path.basename(file)}:{line})" for func, file, line in chosen[:frames]]
    if len(chosen) > frames:
        out.append(f"... {len(chosen) - frames} outer frames")
    return out


def one_line(s: str) -> str:
    """The first line of an error message, capped: what a FileError shows."""
    s = s.strip().splitlines()[0] if s.strip() else "unknown error"
    return s[:300]
