"""Terminal rendering with rich: a Report (reads the Report only), and the load's progress bar."""

from __future__ import annotations

import os
import sys

from hangwatch.analyzer.report import RankEvidence, Report
from hangwatch.analyzer.text import rank_list, stack_excerpt
from rich.console import Console, Group
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

MAX_GROUP_ROWS = 24
MAX_LAGGING_ROWS = 32
STACK_EXCERPT_LINES = 6

_VERDICT_STYLE = {
    "hang": "bold red",
    "mismatch": "bold magenta",
    "no-culprit-visible": "bold yellow",
    "healthy": "bold green",
    "unknown": "bold yellow",
}


def render(report: Report, console: Console) -> None:
    style = _VERDICT_STYLE.get(report.verdict, "bold")
    console.print(Text(f"[{report.verdict}] ", style=style) + Text(report.summary))
    loaded = f"ranks loaded: {rank_list(report.ranks_loaded)}"
    if report.ranks_missing:
        loaded += f"   missing: {rank_list(report.ranks_missing)}"
    if report.tail_ranks:
        loaded += f"   from FR tails only: {rank_list(report.tail_ranks)}"
    console.print(Text(loaded, style="dim"))

    sc = report.stalled_collective
    if sc is not None:
        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column()
        t.add_row("group", f"{sc.group} ({sc.group_desc})" if sc.group_desc else sc.group)
        t.add_row("collective", f"{sc.op} #{sc.seq}  [dim]{sc.profiling_name}[/dim]")
        t.add_row("members", rank_list(sc.group_ranks))
        t.add_row("entered", rank_list(sc.entered_ranks))
        if sc.completed_ranks:
            t.add_row("completed", rank_list(sc.completed_ranks))
        # A member without a dump is not known to have never entered: say "no dump".
        nodump = sorted(set(sc.missing_ranks) & set(report.ranks_missing))
        never = [r for r in sc.missing_ranks if r not in nodump]
        t.add_row("never entered", Text(rank_list(never), style="red" if never else ""))
        if nodump:
            t.add_row("no dump", Text(rank_list(nodump), style="yellow"))
        if sc.input_sizes:
            t.add_row("sizes / dtypes", f"{sc.input_sizes} {','.join(sc.dtypes)}")
        console.print(Panel(t, title="stalled collective", expand=False))

    if report.lagging_ranks:
        lt = Table(title="lagging ranks", show_lines=False)
        lt.add_column("rank", justify="right", style="bold red")
        lt.add_column("host / state")
        lt.add_column("last completed")
        lt.add_column("last entered")
        lt.add_column("call site (FR frames) / stack excerpt")
        for r in report.lagging_ranks[:MAX_LAGGING_ROWS]:
            ev = report.evidence.get(r)
            lt.add_row(str(r), *_evidence_cells(ev))
        if len(report.lagging_ranks) > MAX_LAGGING_ROWS:
            lt.caption = f"... and {len(report.lagging_ranks) - MAX_LAGGING_ROWS} more"
        console.print(lt)

    if report.findings:
        ft = Table(title="findings", show_header=True)
        ft.add_column("kind", style="bold")
        ft.add_column("ranks")
        ft.add_column("detail")
        for f in report.findings:
            ft.add_row(f.kind, rank_list(f.ranks, limit=6), f.detail)
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
        rows = sorted(report.groups, key=lambda g: (not g.lagging, g.group))
        for g in rows[:MAX_GROUP_ROWS]:
            gt.add_row(
                g.group,
                g.group_desc,
                str(len(g.ranks))
                if g.membership_known
                else f"{len(g.ranks)}? (membership unknown)",
                str(g.min_completed),
                str(g.max_enqueued),
                Text(rank_list(g.lagging, limit=6), style="red") if g.lagging else Text("-"),
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


def _evidence_cells(ev: RankEvidence | None) -> list[str | Text | Group]:
    if ev is None:
        return ["", "", "", ""]
    host = " ".join(x for x in (ev.host or "", ev.process_state or "") if x)
    if not ev.reachable:
        host = (host + " unreachable").strip()
    lc = (
        f"{ev.last_completed.op or 'collective'} #{ev.last_completed.seq} (g {ev.last_completed.group})"
        if ev.last_completed
        else "-"
    )
    le = (
        f"{ev.last_entered.op} #{ev.last_entered.seq} (g {ev.last_entered.group}, {ev.last_entered.state})"
        if ev.last_entered
        else "-"
    )
    lines = [f"{fr.name} ({os.path.basename(fr.filename)}:{fr.line})" for fr in ev.frames[:3]]
    if ev.stacks:
        source = ev.sources.get("stacks", "")
        lines += [
            f"-- now ({source or 'stacks'}):",
            *stack_excerpt(ev.stacks, frames=STACK_EXCERPT_LINES),
        ]
    return [host or "-", lc, le, Text("\n".join(lines) or "-")]


class LoadProgressBar:
    """`load_dumps(on_progress=...)` as a transient bar; it closes itself at done == total."""

    def __init__(self, description: str = "loading dumps") -> None:
        self.description = description
        self._bar: Progress | None = None

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
