"""Small text helpers shared by the diagnosis sentences, the terminal report and the loader."""

from __future__ import annotations

from collections.abc import Iterable

from hangwatch.analyzer.report import FindingKind

from hangwatch.stacktext import parse_threads, thread_that_matters

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


def stack_excerpt(stacks: str, *, frames: int = 6) -> list[str]:
    """The innermost frames of the thread that matters (`stacktext.thread_that_matters`:
    blocked in torch.distributed, else the main thread, else the deepest; never
    hangwatch's own helpers while another is there), from faulthandler-style or
    py-spy text. Innermost first, as `func (file:line)` with the file's base name.
    """
    chosen = thread_that_matters(parse_threads(stacks))
    if chosen is None:
        return []
    out = [f.text() for f in chosen.frames[:frames]]
    if len(chosen.frames) > frames:
        out.append(f"... {len(chosen.frames) - frames} outer frames")
    return out


def one_line(s: str) -> str:
    """The first line of an error message, capped: what a FileError shows."""
    s = s.strip().splitlines()[0] if s.strip() else "unknown error"
    return s[:300]
