"""The diagnosis FR cannot make: from every rank's Python stacks, who the others wait on.

Gloo records no send/recv in FR, and a rank stuck in Python before its next
collective leaves no trace there either: the dumps of such a hang look
healthy, and the analyzer's FR verdict is `no-culprit-visible`. The bundle
still has each rank's stacks (torch's `dump_traceback` or py-spy, and the
agent's py-spy `--locals` cut down to the p2p peer arguments), and they say
what every main thread is doing:

* blocked in torch.distributed: a send/recv (`p2p`, with its peer when the
  stack names it) or another call (`collective`);
* waiting on torch's DataLoader (`data-loader`);
* inside torch.compile's compiler (`compile`): compiling, or waiting on the
  compile cache's lock while another rank compiles;
* outside torch.distributed: `compute` or `sleeping` where py-spy says
  whether the thread is active or idle, `python` where the format cannot say;
* `gil-held` when the rank's Python handlers stopped answering (the agent
  notes it), `no-stacks` when nothing could be read.

Who is blamed: with p2p peers known, each blocked rank waits on its peer;
following those waits ends in a cycle (a p2p deadlock: its members are
blamed) or at a rank that is not blocked in communication (that rank is
blamed). Without peers, while some ranks are blocked in communication, the
ranks that are not (and those without stacks) are the odd ones out. When
every rank is blocked, or none is, nobody is blamed and the summary says
what is known. Pure: meta dicts in, typed results out.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Final

from hangwatch.analyzer.report import (
    Finding,
    FindingKind,
    RankEvidence,
    RankStack,
    Report,
    StackDiagnosis,
    StackState,
)

from hangwatch.formats import RankMeta
from hangwatch.rankspec import format_ranks
from hangwatch.stacktext import Frame, main_thread, parse_threads

MAX_RANK_STACKS: Final = 64  # RankStack rows a report carries (the odd ones always)
EXCERPT_FRAMES: Final = 6

# torch.distributed's point-to-point entry points, and its pipelining package
# (whose stages only talk p2p).
P2P_FUNCS: Final = frozenset(
    {"send", "recv", "isend", "irecv", "batch_isend_irecv", "_batch_p2p", "_wait_batch_p2p"}
)
_RECV_ARGS: Final = ("src", "group_src", "peer")
_SEND_ARGS: Final = ("dst", "group_dst", "peer")
_PIPELINING: Final = "torch/distributed/pipelining/"
_DATA_LOADER: Final = "torch/utils/data/"
# Innermost stdlib frames that mean "waiting", in a format that has no idle flag.
_WAITING_FILES: Final = ("threading.py", "queue.py", "selectors.py", "subprocess.py", "socket.py")
# What the agent writes when the rank's Python could not answer (agent/collector.py).
_GIL_MARK: Final = "GIL held"
_COMM: Final = frozenset({StackState.P2P, StackState.COLLECTIVE})


def _peer(f: Frame) -> tuple[str, int | None]:
    """("from"/"to", the global peer) of a p2p frame; None where the stack does not say
    (a group-local rank of a group that is not the default one cannot be mapped)."""
    recv = f.short in ("recv", "irecv")
    names = _RECV_ARGS if recv else _SEND_ARGS
    direction = "from" if recv else "to"
    for n in names:
        v = f.args.get(n)
        if v is None:
            continue
        if n.startswith("group_") and "group" not in f.args:
            return direction, None  # group-local, and the group is not known to be the default
        return direction, v
    return direction, None


def classify(rank: int, meta: RankMeta) -> RankStack:
    """One rank's main thread, from the richest stacks its meta carries."""
    text = meta.peer_stacks or meta.stacks or ""
    errors = meta.errors
    gil = _GIL_MARK in str(errors.get("stacks", ""))
    threads = parse_threads(text)
    t = main_thread(threads)
    if t is None:
        state = StackState.GIL_HELD if gil else StackState.NO_STACKS
        return RankStack(rank=rank, state=state, detail=str(errors.get("stacks", ""))[:200])
    frames = [f.text() for f in t.frames[:EXCERPT_FRAMES]]
    dist = [f for f in t.frames if f.in_dist]
    if dist:
        p2p = [f for f in dist if f.short in P2P_FUNCS or _PIPELINING in f.path]
        if p2p:
            # The innermost p2p call carries the peer arguments.
            f = next((x for x in p2p if x.short in P2P_FUNCS), p2p[0])
            direction, peer = _peer(f)
            who = f" {direction} rank {peer}" if peer is not None else ""
            return RankStack(
                rank=rank,
                state=StackState.P2P,
                frames=frames,
                detail=f"{f.short}{who} ({os.path.basename(f.file)}:{f.line})",
                peer=peer,
            )
        f = dist[-1]  # the outermost: the API call the script made
        return RankStack(
            rank=rank, state=StackState.COLLECTIVE, frames=frames, detail=f"{f.short} ({f.text()})"
        )
    user = next((f for f in t.frames if _DATA_LOADER not in f.path), t.frames[0])
    if any(_DATA_LOADER in f.path for f in t.frames):
        state = StackState.DATA_LOADER
    elif t.in_torch_compile:
        state = StackState.COMPILE
    elif gil:
        state = StackState.GIL_HELD
    elif t.status:
        state = StackState.SLEEPING if t.status.startswith("idle") else StackState.COMPUTE
    elif os.path.basename(t.frames[0].path) in _WAITING_FILES:
        state = StackState.SLEEPING
    else:
        state = StackState.PYTHON
    return RankStack(rank=rank, state=state, frames=frames, detail=f"in {user.text()}")


def _follow(start: int, waits_on: dict[int, int]) -> tuple[int, list[int] | None]:
    """Where the chain of p2p waits from `start` ends: (terminal, None) or (-1, cycle)."""
    seen: list[int] = []
    at = start
    while at in waits_on and at not in seen:
        seen.append(at)
        at = waits_on[at]
    if at in seen:
        return -1, seen[seen.index(at) :]
    return at, None


def diagnose_stacks(rank_meta: dict[int, RankMeta]) -> StackDiagnosis | None:
    """The stack diagnosis over every rank with metadata, or None when no rank has stacks."""
    rows = {r: classify(r, m) for r, m in sorted(rank_meta.items())}
    if all(s.state == StackState.NO_STACKS for s in rows.values()):
        return None
    waits_on = {
        r: s.peer
        for r, s in rows.items()
        if s.state == StackState.P2P and s.peer is not None and s.peer != r
    }
    cycles: list[list[int]] = []
    roots: set[int] = set()
    for r in waits_on:
        end, cycle = _follow(r, waits_on)
        if cycle is not None:
            c = sorted(cycle)
            if c not in cycles:
                cycles.append(c)
        elif end in rows and rows[end].state not in _COMM:
            roots.add(end)
    odd = roots | {r for c in cycles for r in c}
    if not odd:
        blocked = {r for r, s in rows.items() if s.state in _COMM}
        if blocked and len(blocked) < len(rows):
            odd = set(rows) - blocked
    ranks = [rows[r] for r in sorted(odd)] + [s for r, s in rows.items() if r not in odd]
    return StackDiagnosis(
        ranks=ranks[: max(MAX_RANK_STACKS, len(odd))],
        odd_ranks=sorted(odd),
        cycles=sorted(cycles),
        summary=_summary(rows, sorted(odd), sorted(cycles), waits_on),
    )


def _states(rows: Iterable[RankStack]) -> str:
    by: dict[str, list[int]] = {}
    for s in rows:
        by.setdefault(s.state, []).append(s.rank)
    return "; ".join(f"ranks {format_ranks(rs)} {_STATE_WORDS[st]}" for st, rs in by.items())


_STATE_WORDS: Final[dict[str, str]] = {
    StackState.P2P: "blocked in p2p send/recv",
    StackState.COLLECTIVE: "blocked in a collective",
    StackState.DATA_LOADER: "waiting on the data loader",
    StackState.COMPILE: "inside torch.compile (compiling, or waiting on its cache lock)",
    StackState.COMPUTE: "computing in Python",
    StackState.SLEEPING: "idle (sleeping or waiting on a lock, event or queue)",
    StackState.PYTHON: "in Python code",
    StackState.GIL_HELD: "holding the GIL (Python does not answer)",
    StackState.NO_STACKS: "without stacks",
}
PREFIX: Final = "From the stacks, not FR (FR shows no stalled collective): "


def _summary(
    rows: dict[int, RankStack], odd: list[int], cycles: list[list[int]], waits_on: dict[int, int]
) -> str:
    parts: list[str] = []
    for c in cycles:
        chain = ", ".join(f"{r} {rows[r].detail.split(' (')[0]}" for r in c)
        parts.append(f"ranks {format_ranks(c)} deadlock in p2p ({chain})")
    cyc = {r for c in cycles for r in c}
    for r in odd:
        if r not in cyc:
            s = rows[r]
            parts.append(f"rank {r} is {_STATE_WORDS[s.state]} {s.detail}".rstrip())
    if parts:
        waiting = sorted(r for r, s in rows.items() if r not in odd and s.state in _COMM)
        tail = f"; ranks {format_ranks(waiting)} wait on them" if waiting else ""
        return PREFIX + "; ".join(parts) + tail + "."
    if all(s.state in _COMM for s in rows.values()):
        how = "the p2p peers are not in the stacks" if not waits_on else "no cycle closes"
        return (
            PREFIX + f"every rank is blocked in communication and nobody is computing "
            f"({_states(rows.values())}): a communication deadlock, but which ranks form "
            f"it cannot be told ({how})."
        )
    return PREFIX + f"no rank is blocked in communication ({_states(rows.values())})."


def stack_findings(diag: StackDiagnosis) -> list[Finding]:
    rows = {s.rank: s for s in diag.ranks}
    out = [
        Finding(
            kind=FindingKind.P2P_DEADLOCK,
            ranks=c,
            detail="; ".join(f"{r}: {rows[r].detail}" for r in c if r in rows),
        )
        for c in diag.cycles
    ]
    cyc = {r for c in diag.cycles for r in c}
    out += [
        Finding(
            kind=FindingKind.STACK_ODD_ONE_OUT,
            ranks=[r],
            detail=f"{rows[r].state}: {rows[r].detail}" if r in rows else "",
        )
        for r in diag.odd_ranks
        if r not in cyc
    ]
    return out


def with_stack_diagnosis(report: Report, rank_meta: dict[int, RankMeta]) -> Report:
    """The report, diagnosed from the stacks where FR shows no culprit; else unchanged."""
    if report.verdict != "no-culprit-visible":
        return report
    diag = diagnose_stacks(rank_meta)
    if diag is None:
        return report
    if not diag.odd_ranks:
        return dataclasses.replace(
            report, summary=f"{report.summary} {diag.summary}", stack_diagnosis=diag
        )
    evidence = dict(report.evidence)
    for r in diag.odd_ranks:
        evidence.setdefault(r, _meta_evidence(r, rank_meta.get(r) or RankMeta(rank=r)))
    return dataclasses.replace(
        report,
        verdict="hang",
        summary=diag.summary,
        lagging_ranks=diag.odd_ranks,
        findings=[*stack_findings(diag), *report.findings],
        evidence=evidence,
        basis="stacks",
        stack_diagnosis=diag,
    )


def _meta_evidence(rank: int, meta: RankMeta) -> RankEvidence:
    return RankEvidence(
        rank=rank,
        host=meta.host,
        pid=meta.pid,
        process_state=meta.process_state,
        reachable=meta.reachable is not False,
        stacks=meta.stacks or meta.peer_stacks,
        sources=dict(meta.sources),
    )
