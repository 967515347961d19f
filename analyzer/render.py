"""Terminal rendering with rich: a Report (reads the Report only), and the load's progress bar."""

from __future__ import annotations

import os
import sys
import textwrap

from hangwatch.analyzer.report import RankEvidence, Report
from hangwatch.analyzer.text import (
    collective_text,
    finding_roles,
    group_desc,
    group_sort_key,
    seq_text,
    stack_excerpt,
)
from rich.console import Console, Group
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from hangwatch.rankspec import format_ranks

MAX_GROUP_ROWS = 24
MAX_LAGGING_ROWS = 32
# A lagging rank's row: its FR call site and the innermost frames of its
# stack, one line each (cut with an ellipsis, never wrapped): the full stacks
# are in --json and --html.
FR_FRAME_LINES = 2
STACK_EXCERPT_LINES = 4

_VERDICT_STYLE = {
    "hang": "bold red",
    "mismatch": "bold magenta",
    "no-culprit-visible": "bold yellow",
    "healthy": "bold green",
    "unknown": "bold yellow",
}


def render(report: Report, console: Console) -> None:
    style = _VERDICT_STYLE.get(report.verdict, "bold")
    # The verdict line wraps as one block: its continuation lines are indented
    # under the summary, not flush with the tag (piped at 80 columns it used to
    # read as a new paragraph mid-sentence), and the report still fits the width.
    tag = f"[{report.verdict}] "
    lines = textwrap.wrap(
        report.summary,
        width=max(40, console.width),
        initial_indent=tag,
        subsequent_indent=" " * len(tag),
        break_long_words=False,
        break_on_hyphens=False,
    ) or [tag.rstrip()]
    head = Text(lines[0][: len(tag)], style=style) + Text(lines[0][len(tag) :])
    console.print(Text("\n").join([head, *(Text(line) for line in lines[1:])]), soft_wrap=True)
    loaded = f"ranks loaded: {format_ranks(report.ranks_loaded)}"
    if report.ranks_missing:
        loaded += f"   missing: {format_ranks(report.ranks_missing)}"
    if report.tail_ranks:
        loaded += f"   from FR tails only: {format_ranks(report.tail_ranks)}"
    console.print(Text(loaded, style="dim"))
    if report.basis == "stacks":
        console.print(Text("basis: the ranks' Python stacks (FR shows no culprit)", style="bold"))
    if report.stack_diagnosis is not None:
        _stack_table(report, console)

    sc = report.stalled_collective
    if sc is not None:
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column()
        t.add_row("group", _group_name(sc.group, sc.group_desc, sc.group_ranks))
        t.add_row("collective", f"{sc.op} #{sc.seq}  [dim]{sc.profiling_name}[/dim]")
        t.add_row("members", format_ranks(sc.group_ranks))
        t.add_row("entered", format_ranks(sc.entered_ranks))
        if sc.completed_ranks:
            t.add_row("completed", format_ranks(sc.completed_ranks))
        # A member without a dump is not known to have never entered: say "no dump".
        nodump = sorted(set(sc.missing_ranks) & set(report.ranks_missing))
        never = [r for r in sc.missing_ranks if r not in nodump]
        t.add_row("never entered", Text(format_ranks(never), style="red" if never else ""))
        if nodump:
            t.add_row("no dump", Text(format_ranks(nodump), style="yellow"))
        if sc.input_sizes:
            t.add_row("sizes / dtypes", f"{sc.input_sizes} {','.join(sc.dtypes)}")
        console.print(Panel(t, title="stalled collective", expand=False))

    if report.lagging_ranks:
        lt = Table(title="lagging ranks", show_lines=False)
        lt.add_column("rank", justify="right", style="bold red")
        lt.add_column("host / state")
        lt.add_column("last completed")
        lt.add_column("last entered")
        # Leave the other columns room: this one is cut, theirs wrap.
        lt.add_column(
            "call site (FR) / stack now",
            no_wrap=True,
            overflow="ellipsis",
            max_width=max(24, console.width - 52),
        )
        for r in report.lagging_ranks[:MAX_LAGGING_ROWS]:
            ev = report.evidence.get(r)
            lt.add_row(str(r), *_evidence_cells(ev))
        notes = []
        if len(report.lagging_ranks) > MAX_LAGGING_ROWS:
            notes.append(f"... and {len(report.lagging_ranks) - MAX_LAGGING_ROWS} more")
        if any((report.evidence.get(r) or _NO_EVIDENCE).stacks for r in report.lagging_ranks):
            notes.append(
                "innermost frames only: full stacks in --html, or --json evidence.<rank>.stacks"
            )
        lt.caption = "; ".join(notes) or None
        console.print(lt)

    if report.findings:
        ft = Table(title="findings", show_header=True)
        ft.add_column("kind", style="bold")
        ft.add_column("ranks")
        ft.add_column("detail")
        for f in report.findings:
            ft.add_row(f.kind, _finding_ranks(f.kind, f.ranks, report.lagging_ranks), f.detail)
        console.print(ft)

    if report.groups:
        gt = Table(title="group progress")
        gt.add_column("group")
        gt.add_column("desc")
        gt.add_column("size", justify="right")
        gt.add_column("min completed", justify="right")
        gt.add_column("max enqueued", justify="right")
        gt.add_column("behind")
        # Stalled groups first, then the rest; at thousands of groups, summarize.
        rows = sorted(report.groups, key=lambda g: (not g.lagging, group_sort_key(g.group)))
        for g in rows[:MAX_GROUP_ROWS]:
            gt.add_row(
                g.group,
                group_desc(g.group_desc) or Text("(unnamed)", style="dim"),
                str(len(g.ranks))
                if g.membership_known
                else f"{len(g.ranks)}? (membership unknown)",
                seq_text(g.min_completed),
                seq_text(g.max_enqueued),
                Text(format_ranks(g.lagging, limit=6), style="red") if g.lagging else Text("-"),
            )
        if len(rows) > MAX_GROUP_ROWS:
            stalled = sum(1 for g in rows if g.lagging)
            gt.caption = f"{len(rows) - MAX_GROUP_ROWS} more groups not shown ({stalled} groups have ranks behind in total)"
        console.print(gt)

    if report.errors:
        et = Table(title=f"files not loaded ({len(report.errors)})")
        et.add_column("file")
        et.add_column("reason")
        for e in report.errors[:20]:
            et.add_row(e.file, e.error)
        if len(report.errors) > 20:
            et.caption = f"... and {len(report.errors) - 20} more"
        console.print(et)


_NO_EVIDENCE = RankEvidence(rank=-1)


def _group_name(group: str, desc: str, ranks: list[int]) -> str:
    """'72 (EXPERT_MODEL_PARALLEL_GROUP)'; an unnamed one by its members: '1 (ranks 2,3)'."""
    if group_desc(desc):
        return f"{group} ({desc})"
    return f"{group} (ranks {format_ranks(ranks)})" if ranks else group


def _finding_ranks(kind: str, ranks: list[int], blamed: list[int]) -> Text:
    """The findings' ranks column; where culprits and others stand together, which is which."""
    out = Text()
    for role, rs in finding_roles(kind, ranks, blamed):
        if out:
            out.append("\n")
        if role:
            out.append(f"{role} ", style="dim")
        out.append(format_ranks(rs, limit=6), style="red" if role == "blamed" else "")
    return out


def _stack_table(report: Report, console: Console) -> None:
    diag = report.stack_diagnosis
    assert diag is not None
    st = Table(title="main threads, from the stacks")
    st.add_column("rank", justify="right")
    st.add_column("state")
    st.add_column("where")
    for s in diag.ranks[:MAX_LAGGING_ROWS]:
        odd = s.rank in diag.odd_ranks
        st.add_row(Text(str(s.rank), style="bold red" if odd else ""), s.state, s.detail)
    if len(diag.ranks) > MAX_LAGGING_ROWS:
        st.caption = f"... and {len(diag.ranks) - MAX_LAGGING_ROWS} more"
    console.print(st)


def _evidence_cells(ev: RankEvidence | None) -> list[str | Text | Group]:
    if ev is None:
        return ["", "", "", ""]
    host = " ".join(x for x in (ev.host or "", ev.process_state or "") if x)
    if not ev.reachable:
        host = (host + " unreachable").strip()
    lc = (
        f"{collective_text(ev.last_completed.op, ev.last_completed.seq)} (g {ev.last_completed.group})"
        if ev.last_completed
        else "-"
    )
    le = (
        f"{collective_text(ev.last_entered.op, ev.last_entered.seq)} (g {ev.last_entered.group}, {ev.last_entered.state})"
        if ev.last_entered
        else "-"
    )
    lines = [
        f"{fr.name} ({os.path.basename(fr.filename)}:{fr.line})"
        for fr in ev.frames[:FR_FRAME_LINES]
    ]
    if ev.stacks:
        source = ev.sources.get("stacks", "")
        lines += [
            f"-- now ({source or 'stacks'}):",
            *stack_excerpt(ev.stacks, frames=STACK_EXCERPT_LINES),
        ]
    cell = Text("\n".join(lines) or "-", no_wrap=True, overflow="ellipsis")
    return [host or "-", lc, le, cell]


class LoadProgressBar:
    """`load_dumps(on_progress=...)` as a transient bar; it closes itself at done == total."""

    def __init__(self, description: str = "loading dumps") -> None:
        self.description = description
        self._bar: Progress | None = None

    @property
    def showing(self) -> bool:
        """Whether the bar is on the terminal now."""
        return self._bar is not None

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            if done >= total:
                return  # nothing left to show: never flash an empty bar
            self._bar = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                transient=True,
            )
            self._bar.start()
            self._bar.add_task(self.description, total=total)
        self._bar.update(self._bar.task_ids[0], completed=done, total=total)
        if done >= total:
            self._bar.stop()
            self._bar = None


def load_progress_bar(description: str = "loading dumps") -> LoadProgressBar | None:
    """A progress bar for loading, or None where stderr is not a terminal (pipes, CI)."""
    if not sys.stderr.isatty():
        return None
    return LoadProgressBar(description)
