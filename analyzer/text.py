"""Small text helpers shared by the diagnosis sentences, the terminal report and the loader."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable


def rank_list(ranks: Iterable[int], *, limit: int = 12) -> str:
    """[0,1,2,3,7,9,10] -> '0-3,7,9,10'; long lists end with '... (N ranks)'."""
    rs = sorted(set(ranks))
    if not rs:
        return "none"
    spans: list[tuple[int, int]] = []
    for r in rs:
        if spans and r == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], r)
        else:
            spans.append((r, r))
    parts = [str(a) if a == b else (f"{a},{b}" if b == a + 1 else f"{a}-{b}") for a, b in spans]
    if len(parts) > limit:
        return ",".join(parts[:limit]) + f",... ({len(rs)} ranks)"
    return ",".join(parts)


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


_FAULTHANDLER_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>.*)$')
_PYSPY_FRAME = re.compile(r"^\s+(?P<func>\S.*?) \((?P<file>[^()]*):(?P<line>\d+)\)\s*$")


def stack_excerpt(stacks: str, *, frames: int = 6) -> list[str]:
    """The innermost frames of the thread most likely to be the training loop.

    Reads both faulthandler-style dumps (torch's `dump_traceback`) and
    `py-spy dump` output. The main thread is the one whose outermost frame is
    `<module>` (or that py-spy labels MainThread); frames come back innermost
    first as `func (file:line)` with the file shortened to its base name.
    """
    blocks: list[tuple[str, list[tuple[str, str, str]]]] = []
    for line in stacks.splitlines():
        if not line.strip():
            continue
        m = _FAULTHANDLER_FRAME.match(line) or _PYSPY_FRAME.match(line)
        if m and blocks:
            blocks[-1][1].append((m["func"], m["file"], m["line"]))
        elif not line.startswith((" ", "\t")):
            blocks.append((line, []))
    if not blocks:
        return []

    def is_main(block: tuple[str, list[tuple[str, str, str]]]) -> bool:
        header, fr = block
        return "MainThread" in header or bool(fr and fr[-1][0].strip() == "<module>")

    _header, chosen = next((b for b in blocks if is_main(b)), max(blocks, key=lambda b: len(b[1])))
    out = [f"{func} ({os.path.basename(file)}:{line})" for func, file, line in chosen[:frames]]
    if len(chosen) > frames:
        out.append(f"... {len(chosen) - frames} outer frames")
    return out


def one_line(s: str) -> str:
    """The first line of an error message, capped: what a FileError shows."""
    s = s.strip().splitlines()[0] if s.strip() else "unknown error"
    return s[:300]
