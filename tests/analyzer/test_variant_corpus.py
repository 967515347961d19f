"""A corpus of variants of the golden and conformance dumps, each with the verdict it must get.

Built at test time from tests/golden (real 4-rank gloo dumps with their
injection plan) and the real NCCL incidents under ../shared/conformance/nvrx
(skipped, saying so, when absent): partial selections, single ranks,
unreadable and truncated files, bundles stripped to raw dumps (unknown
membership), opposite-order subgroups on raw gloo dumps, torch 2.15's
group-local pg_config. Every expectation follows from the ground truth
(manifest or fault_injection.log) by the rules the verdicts promise, never
from an earlier run:

* never `healthy` while a loaded rank is inside unfinished work nobody can
  account for, and never with nothing loaded;
* never an NVRX_INNOCENT rank among the lagging ones; a rank whose file is bad is
  "no dump", blamed only when no rank with a dump explains the stall.
"""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helpers
import pytest
from fr_dumps import SimJob
from hangwatch.analyzer import analyze_path, load_dumps
from hangwatch.analyzer.report import Report
from helpers import GOLDEN_DIR
from helpers import conformance_incident as _incident
from helpers import fault_ranks as _truth

INCIDENTS = ["gpu_error_1st", "gpu_error_2nd", "lock_gil_1st", "lock_gil_2nd"]
WORLD = 4
NVRX_INNOCENT = 3  # a first-stage rank, faulty in none of the incidents
# The corpus has bundles whose agent was unreachable; that finding blames too.
CULPRIT_KINDS = helpers.CULPRIT_KINDS | {"agent-unreachable"}

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True, kw_only=True)
class Expect:
    verdict: str
    lagging: list[int] | None = None  # exact, when set
    within: set[int] | None = None  # lagging must be a subset (never an NVRX_INNOCENT)
    kinds: set[str] = field(default_factory=set)  # finding kinds that must be there
    no_dump: set[int] = field(default_factory=set)  # blamed only as "no dump"


@dataclass(frozen=True, kw_only=True)
class Case:
    id: str
    build: Callable[[Path], Path]  # writes the variant under tmp, returns what to analyze
    expect: Callable[[Path], Expect]  # from the variant and its ground truth
    kw: dict[str, Any] = field(default_factory=dict)  # analyze_path arguments


# ---------- building variants ----------


def _copy(src: Path) -> Callable[[Path], Path]:
    def build(tmp: Path) -> Path:
        shutil.copytree(src, tmp / "d", symlinks=False)
        return tmp / "d"

    return build


def _rank_files(d: Path, rank: int) -> list[Path]:
    """The FR dump files of one rank, in a bundle (rank_R/) or a plain directory."""
    out = []
    for p in sorted(d.rglob("*")):
        if not p.is_file() or p.name in ("meta.json", "stacks.txt", "manifest.json"):
            continue
        if p.parent.name == f"rank_{rank}" or p.name.rsplit("_", 1)[-1] == str(rank):
            out.append(p)
    return out


def _damaged(src: Path, rank: int, how: str) -> Callable[[Path], Path]:
    def build(tmp: Path) -> Path:
        d = _copy(src)(tmp)
        files = _rank_files(d, rank)
        assert files, f"no dump of rank {rank} in {src}"
        for f in files:
            b = f.read_bytes()
            f.write_bytes(b"\x00 not a dump" if how == "unreadable" else b[: len(b) // 2])
        return d

    return build


def _raw(src: Path) -> Callable[[Path], Path]:
    """The bundle without its metadata: what torch alone leaves."""

    def build(tmp: Path) -> Path:
        d = _copy(src)(tmp)
        for f in d.rglob("meta.json"):
            f.unlink()
        return d

    return build


def _in_flight(d: Path, rank: int, world_size: int) -> bool:
    """Rank's own dump shows work it has not finished (read by the loader alone)."""
    loaded = load_dumps(d, selected_ranks=[rank], world_size=world_size)
    E = loaded.entries
    return bool(len(E)) and not bool((E["retired"] | (E["state"] == "completed")).all())


# ---------- golden variants ----------


def _manifest(g: Path) -> dict[str, Any]:
    return dict(json.loads((g / "manifest.json").read_text()))


def _golden_cases() -> list[Case]:
    cases: list[Case] = []
    for g in sorted(p for p in GOLDEN_DIR.iterdir() if (p / "manifest.json").is_file()):
        m = _manifest(g)
        exp = m["expected"]
        truth = set(m["injected_ranks"])
        no_dump = set(m["ranks_without_dump"])
        bundle = m["layout"] == "bundle"
        ws = {"world_size": m["world_size"]}
        cases.append(
            Case(
                id=f"{g.name}-full",
                build=_copy(g),
                expect=lambda d, e=exp: Expect(verdict=e["verdict"], lagging=e["lagging_ranks"]),
                kw=ws,
            )
        )
        for r in range(WORLD):

            def one(
                d: Path, r: int = r, bundle: bool = bundle, no_dump: set[int] = no_dump
            ) -> Expect:
                if r in no_dump:
                    return Expect(verdict="unknown", lagging=[])  # nothing loaded
                if _in_flight(d, r, WORLD):
                    # Its peers are not selected: whether they entered is unknown.
                    return Expect(verdict="unknown", lagging=[], kinds={"outside-selection"})
                # Finished everything: FR has nothing on it; a bundle is an incident.
                return Expect(verdict="no-culprit-visible" if bundle else "healthy", lagging=[])

            cases.append(
                Case(
                    id=f"{g.name}-only-{r}",
                    build=_copy(g),
                    expect=one,
                    kw={**ws, "selected_ranks": [r]},
                )
            )
        for how in ("unreadable", "truncated"):
            for r in sorted(set(range(WORLD)) - no_dump):
                cases.append(
                    Case(
                        id=f"{g.name}-{how}-{r}",
                        build=_damaged(g, r, how),
                        expect=lambda d, r=r, exp=exp, truth=truth, no_dump=no_dump: (
                            _damaged_expect(exp, truth, no_dump, r)
                        ),
                        kw=ws,
                    )
                )
        if bundle:
            for with_ws in (False, True):
                cases.append(
                    Case(
                        id=f"{g.name}-raw{'-world-size' if with_ws else ''}",
                        build=_raw(g),
                        expect=lambda d, exp=exp, no_dump=no_dump, w=with_ws: _raw_expect(
                            exp, no_dump, w
                        ),
                        kw=ws if with_ws else {},
                    )
                )
    return cases


def _damaged_expect(exp: dict[str, Any], truth: set[int], no_dump: set[int], r: int) -> Expect:
    if exp["verdict"] in ("healthy", "no-culprit-visible"):
        return Expect(verdict=exp["verdict"], lagging=[])
    dumped_culprits = truth - no_dump - {r}
    if dumped_culprits:
        # A culprit with a dump explains the stall: the bad file is not blamed.
        return Expect(verdict=exp["verdict"], lagging=sorted(dumped_culprits))
    if r in truth:
        # The only culprit's file is bad: blamed, as "no dump", never "never entered"
        # (and a mismatch cannot be seen without the odd rank's dump).
        return Expect(verdict="hang", lagging=[r], no_dump={r})
    # No culprit has a dump, and neither has r: both are candidates, as "no dump".
    return Expect(verdict="hang", within=truth | {r}, no_dump=truth | {r})


def _raw_expect(exp: dict[str, Any], no_dump: set[int], with_ws: bool) -> Expect:
    if exp["verdict"] == "no-culprit-visible":
        # Without bundle metadata nobody reported a stall, and gloo records no p2p.
        return Expect(verdict="healthy", lagging=[], kinds={"gloo-p2p-blind-spot"})
    if no_dump and not with_ws:
        # Nobody names the rank without a dump: membership is only what the dumps show.
        return Expect(verdict="unknown", lagging=[], kinds={"membership-unknown"})
    return Expect(verdict=exp["verdict"], lagging=exp["lagging_ranks"])


# ---------- simulated raw dumps (torch's formats, no metadata) ----------


def _opposite_order(tmp: Path) -> Path:
    """Raw gloo: two new subgroups of ranks {0, 1}, entered in opposite orders;
    each group's collective appears in one rank's dump only."""
    job = SimJob(4, backend="gloo")
    job.group("1", [0, 1])
    job.group("2", [0, 1])
    job.all("0")
    job.ranks[0].coll("1", done=False)
    job.ranks[1].coll("2", done=False)
    return job.write(tmp / "d")


def _opposite_order_unmappable(tmp: Path) -> Path:
    """As above, but a third group in between makes the local pg_ids ambiguous:
    membership stays unknown."""
    job = SimJob(4, backend="gloo")
    job.group("1", [0, 1])
    job.group("2", [2, 3])
    job.group("3", [0, 1])
    job.all("0")
    job.all("2")
    job.ranks[0].coll("1", done=False)
    job.ranks[1].coll("3", done=False)
    return job.write(tmp / "d")


def _local_pg_config(tmp: Path) -> Path:
    """torch 2.15's gloo writes a subgroup member's pg_config with group-local
    ranks ('[0, 1]' for {2, 3}); here under the group's own name, the worst case."""
    job = SimJob(4)
    job.group("1", [2, 3], "sub")
    job.all("0")
    job.all("1")
    job.ranks[2].coll("1", done=False)  # rank 3 never enters
    d = tmp / "d"
    d.mkdir()
    for r in range(4):
        obj = job.ranks[r].dump_obj()
        if r in (2, 3):
            obj["pg_config"]["1"]["ranks"] = "[0, 1]"
        (d / f"nccl_trace_rank_{r}").write_bytes(pickle.dumps(obj))
    return d


def _sim_cases() -> list[Case]:
    return [
        Case(
            id="sim-gloo-opposite-order-subgroups",
            build=_opposite_order,
            expect=lambda d: Expect(verdict="hang", lagging=[0, 1], kinds={"cross-group-deadlock"}),
        ),
        Case(
            id="sim-gloo-opposite-order-membership-unknown",
            build=_opposite_order_unmappable,
            expect=lambda d: Expect(verdict="unknown", lagging=[], kinds={"membership-unknown"}),
        ),
        Case(
            id="sim-group-local-pg-config",
            build=_local_pg_config,
            expect=lambda d: Expect(verdict="hang", lagging=[3]),
        ),
    ]


# ---------- conformance variants (real NCCL) ----------


def _lazy(name: str, make: Callable[[Path], Callable[[Path], Path]]) -> Callable[[Path], Path]:
    return lambda tmp: make(_incident(name))(tmp)


def _nvrx_cases() -> list[Case]:
    cases: list[Case] = []
    for name in INCIDENTS:
        cases += [
            Case(
                id=f"{name}-ranks-0-7",
                build=_lazy(name, _copy),
                # No faulty rank selected, and every selected rank has unfinished
                # work with the unselected stages.
                expect=lambda d: Expect(verdict="unknown", lagging=[], kinds={"outside-selection"}),
                kw={"selected_ranks": "0-7"},
            ),
            Case(
                id=f"{name}-ranks-8-15",
                build=_lazy(name, _copy),
                expect=lambda d: Expect(verdict="hang", lagging=sorted(_truth(d))),
                kw={"selected_ranks": "8-15"},
            ),
            Case(
                id=f"{name}-only-{NVRX_INNOCENT}",
                build=_lazy(name, _copy),
                expect=lambda d: Expect(verdict="unknown", lagging=[], kinds={"outside-selection"}),
                kw={"selected_ranks": [NVRX_INNOCENT]},
            ),
        ]
        for how in ("unreadable", "truncated"):
            cases.append(
                Case(
                    id=f"{name}-{how}-{NVRX_INNOCENT}",
                    build=_lazy(name, lambda s, how=how: _damaged(s, NVRX_INNOCENT, how)),
                    expect=lambda d: Expect(verdict="hang", lagging=sorted(_truth(d))),
                )
            )
            cases.append(
                Case(
                    id=f"{name}-{how}-first-faulty",
                    build=_lazy(name, lambda s, how=how: _damaged(s, min(_truth(s)), how)),
                    # The other faulty rank's dump explains the stall; no NVRX_INNOCENT.
                    expect=lambda d: Expect(verdict="hang", within=_truth(d)),
                )
            )
    return cases


CASES = _golden_cases() + _sim_cases() + _nvrx_cases()


def _check(rep: Report, e: Expect, case_id: str) -> None:
    why = f"{case_id}: {rep.verdict} {rep.lagging_ranks} {rep.summary}\n{rep.findings}"
    assert rep.verdict == e.verdict, why
    if e.lagging is not None:
        assert rep.lagging_ranks == e.lagging, why
    if e.within is not None:
        assert set(rep.lagging_ranks) <= e.within and rep.lagging_ranks, why
    kinds = {f.kind for f in rep.findings}
    assert e.kinds <= kinds, why
    # Every culprit finding names lagging ranks (a missing-dump finding may also
    # list ranks without a dump that are not blamed; a deadlock lists its cycle).
    per_rank = CULPRIT_KINDS - {"missing-dump", "cross-group-deadlock"}
    blamed = {r for f in rep.findings if f.kind in per_rank for r in f.ranks}
    assert blamed <= set(rep.lagging_ranks), why
    for f in rep.findings:
        if f.kind in CULPRIT_KINDS and set(f.ranks) & e.no_dump:
            assert f.kind in ("missing-dump", "frozen", "agent-unreachable"), why
    if e.no_dump & set(rep.lagging_ranks):
        assert "never entered" not in rep.summary, why  # "no dump", in the headline too


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_variant(case: Case, tmp_path: Path) -> None:
    target = case.build(tmp_path)
    rep = analyze_path(target, **case.kw)
    _check(rep, case.expect(target), case.id)


def test_the_corpus_covers_what_it_promises() -> None:
    ids = [c.id for c in CASES]
    for part in (
        "-only-",
        "-unreadable-",
        "-truncated-",
        "-raw",
        "opposite-order",
        "mismatch-full",
    ):
        assert any(part in i for i in ids), part
    assert len(ids) == len(set(ids))
