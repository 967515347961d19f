"""The file formats (hangwatch.formats): round trips, old files, hostile files, and one writer each.

Every file that crosses a process boundary is a dataclass with a schema tag.
Readers take a file without the tag (the previous release wrote some
untagged), ignore keys they do not know, and refuse anything else with one
FormatError line; reason codes keep the text earlier releases wrote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import GOLDEN_DIR, REPO_ROOT

from hangwatch import formats
from hangwatch.formats import (
    COMPACT_RANKS_ABOVE,
    MAX_RANKS,
    Completion,
    FormatError,
    GroupInfo,
    HookEvent,
    HookEventKind,
    IncidentDoc,
    MissingReason,
    RankInfo,
    RankMeta,
    Recorder,
    RecorderKind,
    ServerInfo,
    TriggerKind,
    compact_ranks,
    expand_ranks,
)

# --- meta.json member lists: long strided groups travel as ranges -----------


@pytest.mark.parametrize(
    "ranks",
    [
        list(range(4096)),  # the world group
        list(range(3, 4096, 32)),  # a data-parallel group
        list(range(COMPACT_RANKS_ABOVE + 1)),
    ],
)
def test_strided_groups_round_trip_as_ranges(ranks: list[int]) -> None:
    packed = compact_ranks(ranks)
    assert isinstance(packed, dict)
    assert expand_ranks(packed) == ranks


@pytest.mark.parametrize(
    "ranks",
    [
        list(range(8)),  # small groups stay lists: self-describing, cheap
        [*range(100), 200],  # not evenly strided
        list(range(100, 0, -1)),  # descending: kept as written
    ],
)
def test_other_groups_stay_lists(ranks: list[int]) -> None:
    assert compact_ranks(ranks) == ranks
    assert expand_ranks(ranks) == ranks


@pytest.mark.parametrize(
    "value",
    [
        {"start": 0, "stop": 10, "step": 0},
        {"start": 0, "stop": 10, "step": -1},
        {"start": -5, "stop": 10, "step": 1},
        {"start": 0, "stop": MAX_RANKS * 4, "step": 1},  # a memory bomb, not a job
        {"start": 0, "stop": "10", "step": 1},
        {"start": True, "stop": 10, "step": 1},
        {"stop": 10},
        "0-10",
        None,
    ],
)
def test_hostile_or_odd_values_expand_to_nothing(value: object) -> None:
    assert expand_ranks(value) is None


# --- one document of each format, as its writer fills it -------------------

GLOO = Recorder(
    instance="gloo",
    kind=RecorderKind.GENERIC,
    completion=Completion.TRACKED,
    groups=("0", "1"),
    json_handler="fr_trace_json",
)
HOOKED = Recorder(
    instance="hwstore",
    kind=RecorderKind.HOOKED,
    completion=Completion.UNKNOWN,
    status_offset=1,
    groups=("0",),
    json_handler="fr_trace_json?backend=hwstore",
)


def rank_info() -> RankInfo:
    return RankInfo(
        job_id="job",
        rank=3,
        local_rank=1,
        world_size=8,
        pid=4242,
        proc_starttime=123456,
        host="node-1",
        backend="gloo",
        torch_version="2.13.0",
        socket="/run/hangwatch/hook/4242.sock",
        fr_source="worker-server",
        started_unix=1.7e9,
        groups=(
            GroupInfo(name="0", desc="default_pg", pg_id=0, ranks=list(range(8))),
            GroupInfo(name="1", desc="tp", pg_id=1, ranks=[2, 3]),
        ),
        recorders=(HOOKED, GLOO),
        watchdog_prefix="/run/hangwatch/fr/fr_trace_rank_",
    )


def rank_meta() -> RankMeta:
    return RankMeta(
        rank=3,
        host="node-1",
        pid=4242,
        process_state="running",
        reachable=True,
        # The world group of a big job travels as a range and comes back as one.
        groups=(
            GroupInfo(name="0", desc="default_pg", pg_id=0, ranks=range(4096)),
            GroupInfo(name="1", desc="tp", pg_id=1, ranks=[2, 3]),
        ),
        recorders=(GLOO,),
        sources={"fr": "worker-server", "stacks": "py-spy", "gpu": "none", "process": "procfs"},
        gpu={"available": False, "reason": "no NVML"},
        errors={"stacks": "dump_traceback: timed out"},
        stacks="Thread 1 (idle): MainThread\n",
        last_report_age_s=1.5,
    )


def incident() -> IncidentDoc:
    return IncidentDoc(
        id="20261201-abc",
        job_id="job",
        reason="group 0 stalled at seq 10 (all_reduce): ranks 0,2,3 waiting",
        created_unix=1.7e9,
        trigger={
            "kind": TriggerKind.STALL,
            "stalled": [{"group": "0", "seq": 10, "op": "all_reduce", "kind": "stall"}],
        },
        world_size=4,
        ranks_expected=(0, 1, 2, 3),
        tail_context=0,
        ranks_dumped=(0, 2, 3),
        ranks_unreachable={1: "agent unreachable: node-2 silent for 12.0s"},
    )


def server_info() -> ServerInfo:
    return ServerInfo(grpc="127.0.0.1:7451", http="http://127.0.0.1:7450", pid=99, started_unix=1.0)


def hook_event() -> HookEvent:
    return HookEvent(
        kind=HookEventKind.COLLECTIVE_TIMEOUT,
        rank=3,
        detail="RuntimeError: Timed out waiting 4000ms for recv operation",
        thread="MainThread",
        unix=1.7e9,
    )


Doc = RankInfo | RankMeta | IncidentDoc | ServerInfo | HookEvent
FORMATS: dict[str, tuple[Callable[[], Doc], Callable[[bytes], Doc], str]] = {
    "rankinfo": (rank_info, RankInfo.from_bytes, formats.RANKINFO),
    "rankmeta": (rank_meta, RankMeta.from_bytes, formats.RANKMETA),
    "incident": (incident, IncidentDoc.from_bytes, formats.INCIDENT),
    "serverinfo": (server_info, ServerInfo.from_bytes, formats.SERVER_INFO),
    "hookevent": (hook_event, HookEvent.from_bytes, formats.HOOK_EVENT),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_round_trip(name: str) -> None:
    make, parse, schema = FORMATS[name]
    doc = make()
    data = doc.to_bytes()
    assert json.loads(data)["schema"] == schema
    assert parse(data) == doc


def test_rank_meta_is_compact_on_disk() -> None:
    """The agent writes one per rank: no indentation, long groups as ranges."""
    data = rank_meta().to_bytes()
    assert b"\n" not in data and b'"ranks":{"start":0,"stop":4096,"step":1}' in data
    assert RankMeta.from_bytes(rank_meta().to_bytes(pretty=True)) == rank_meta()


# --- files the previous release wrote ----------------------------------------


def _untagged(doc: Doc) -> bytes:
    d = json.loads(doc.to_bytes())
    del d["schema"]
    return json.dumps(d).encode()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_file_without_a_schema_tag_reads(name: str) -> None:
    make, parse, _ = FORMATS[name]
    assert parse(_untagged(make())) == make()


@pytest.mark.parametrize(
    "path", sorted(GOLDEN_DIR.glob("*/rank_*/meta.json")), ids=lambda p: p.parent.parent.name
)
def test_golden_bundles_metas_read(path: Path) -> None:
    """meta.json files the previous release's snapshot wrote (no recorders, lists not ranges)."""
    raw = json.loads(path.read_text())
    meta = RankMeta.from_json(raw)
    assert meta.rank == raw["rank"] == int(path.parent.name.removeprefix("rank_"))
    assert [g.name for g in meta.groups] == [g["name"] for g in raw["groups"]]
    assert [list(g.ranks) for g in meta.groups] == [g["ranks"] for g in raw["groups"]]
    assert meta.reachable is raw["reachable"] and meta.sources == raw["sources"]


def test_minimal_old_documents_take_defaults() -> None:
    """What older coordinators and hooks left out reads as "not known"."""
    doc = IncidentDoc.from_json({"schema": formats.INCIDENT, "id": "i1"})
    assert doc == IncidentDoc(id="i1") and doc.stalled_keys() == set()
    meta = RankMeta.from_json({"rank": 2})
    assert (meta.host, meta.pid, meta.reachable, meta.process_state) == (None, None, None, None)
    # A hook that had found no recorder yet lists none; the agent assumes gloo's.
    info = RankInfo.from_json({"schema": formats.RANKINFO, "rank": 0, "world_size": 1, "pid": 7})
    assert info.recorders == () and info.local_rank == -1 and info.socket is None


def test_unknown_keys_and_codes_from_a_newer_writer() -> None:
    d = json.loads(rank_info().to_bytes())
    d["added_later"] = {"x": 1}
    d["recorders"][0].update(kind="quantum", completion="eventually", extra=True)
    info = RankInfo.from_json(d)
    assert info.recorders[0].kind == "quantum"  # kept as text
    # A completion this reader does not know promises nothing: read as unknown.
    assert info.recorders[0].completion is Completion.UNKNOWN
    ev = HookEvent.from_json({"schema": formats.HOOK_EVENT, "kind": "new-kind", "rank": 1})
    assert ev.kind == "new-kind" and not isinstance(ev.kind, HookEventKind)
    assert HookEvent.from_bytes(hook_event().to_bytes()).kind is HookEventKind.COLLECTIVE_TIMEOUT


def test_stall_trigger_keys() -> None:
    assert incident().stalled_keys() == {("0", 10)}
    bad = IncidentDoc(id="x", trigger={"stalled": [{"group": 0, "seq": "10"}]})
    with pytest.raises(FormatError, match="'group'"):
        bad.stalled_keys()


# --- hostile and broken files ------------------------------------------------


def _assert_clean(e: pytest.ExceptionInfo[FormatError], schema: str) -> None:
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert msg.startswith(f"{schema}: ") and "\n" not in msg and len(msg) < 400, msg


# (format, field, hostile value): wrong types, bools for ints, out of range.
WRONG: list[tuple[str, str, Any]] = [
    ("rankinfo", "rank", "3"),
    ("rankinfo", "rank", True),
    ("rankinfo", "rank", -1),
    ("rankinfo", "pid", None),
    ("rankinfo", "pid", 1.5),
    ("rankinfo", "world_size", 0),
    ("rankinfo", "groups", {"name": "0"}),
    ("rankinfo", "groups", [["0"]]),
    ("rankinfo", "groups", [{"desc": "no name"}]),
    ("rankinfo", "groups", [{"name": "0", "ranks": [0, "1"]}]),
    ("rankinfo", "groups", [{"name": "0", "ranks": [0, True]}]),
    ("rankinfo", "groups", [{"name": "0", "ranks": {"start": 0, "stop": 1 << 40, "step": 1}}]),
    ("rankinfo", "groups", [{"name": "0", "pg_id": -2}]),
    ("rankinfo", "recorders", [{"kind": "generic"}]),
    ("rankinfo", "recorders", [{"instance": "gloo", "groups": [0]}]),
    ("rankinfo", "dump_prefixes", {"watchdog": 3}),
    ("rankinfo", "socket", 17),
    ("rankmeta", "rank", None),
    ("rankmeta", "rank", [3]),
    ("rankmeta", "reachable", "yes"),
    ("rankmeta", "pid", "42"),
    ("rankmeta", "sources", ["fr"]),
    ("rankmeta", "errors", {"fr": {"nested": 1}}),
    ("rankmeta", "gpu", "none"),
    ("rankmeta", "stacks", {"x": 1}),
    ("rankmeta", "last_report_age_s", "1s"),
    ("incident", "id", 5),
    ("incident", "trigger", "stall"),
    ("incident", "ranks_expected", "0-3"),
    ("incident", "ranks_dumped", [0, None]),
    ("incident", "ranks_unreachable", {"one": "x"}),
    ("incident", "ranks_unreachable", {"-1": "x"}),
    ("incident", "ranks_unreachable", {"1": 2}),
    ("incident", "world_size", "4"),
    ("incident", "tail_context", -1),
    ("serverinfo", "grpc", None),
    ("serverinfo", "pid", "99"),
    ("hookevent", "kind", None),
    ("hookevent", "rank", "0"),
]


@pytest.mark.parametrize(("name", "key", "value"), WRONG, ids=lambda v: repr(v)[:30])
def test_wrong_types_are_one_clear_error(name: str, key: str, value: Any) -> None:
    make, parse, schema = FORMATS[name]
    d = json.loads(make().to_bytes())
    d[key] = value
    with pytest.raises(FormatError) as e:
        parse(json.dumps(d).encode())
    _assert_clean(e, schema)
    assert repr(key) in str(e.value) or key in str(e.value), str(e.value)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_truncated_and_mistyped_files_are_one_clear_error(name: str) -> None:
    make, parse, schema = FORMATS[name]
    data = make().to_bytes()
    for cut in (0, 1, len(data) // 3, len(data) // 2, len(data) - 2):
        with pytest.raises(FormatError) as e:
            parse(data[:cut])
        _assert_clean(e, schema)
    for other in (b"[]", b"null", b"42", b'"text"', b"\xff\xfe{}", b"{" * 100_000):
        with pytest.raises(FormatError) as e:
            parse(other)
        _assert_clean(e, schema)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_huge_files_are_refused_before_parsing(name: str) -> None:
    make, parse, schema = FORMATS[name]
    limit = {
        "rankinfo": formats.MAX_RANKINFO_BYTES,
        "rankmeta": formats.MAX_RANKMETA_BYTES,
        "incident": formats.MAX_INCIDENT_BYTES,
        "serverinfo": 64 * 1024,
        "hookevent": formats.MAX_EVENT_BYTES,
    }[name]
    d = json.loads(make().to_bytes())
    d["padding"] = "x" * limit
    with pytest.raises(FormatError, match="limit") as e:
        parse(json.dumps(d).encode())
    _assert_clean(e, schema)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_another_schema_is_refused(name: str) -> None:
    make, parse, schema = FORMATS[name]
    d = json.loads(make().to_bytes())
    for tag in ("hangwatch.report/1", schema.replace("/1", "/2")):
        d["schema"] = tag
        with pytest.raises(FormatError, match="schema") as e:
            parse(json.dumps(d).encode())
        _assert_clean(e, schema)


def test_server_info_read_is_none_while_absent_or_broken(tmp_path: Path) -> None:
    assert ServerInfo.read(tmp_path) is None
    (tmp_path / ServerInfo.FILE).write_bytes(server_info().to_bytes()[:10])
    assert ServerInfo.read(tmp_path) is None
    server_info().write(tmp_path)
    assert ServerInfo.read(tmp_path) == server_info()


# --- reason codes ---------------------------------------------------------------


def test_reason_codes_keep_the_text_earlier_releases_wrote() -> None:
    """Stored incidents, bundles and the store hold these exact strings."""
    assert [str(t) for t in TriggerKind] == [
        "stall", "watchdog", "timeout", "rank-lost", "agent-lost", "backend-unhealthy", "crash",
        "no-progress",
    ]  # fmt: skip
    assert [str(k) for k in HookEventKind] == [
        "collective-timeout", "uncaught-exception", "backend-abort",
    ]  # fmt: skip
    assert MissingReason.AGENT_UNREACHABLE == "agent unreachable"
    assert MissingReason.NO_ANSWER == "no answer before deadline"
    assert MissingReason.RESTARTED == "coordinator restarted before this rank's dump arrived"
    assert MissingReason.PROCESS_STOPPED == "process stopped (SIGSTOP?)"


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("agent unreachable: node-3 silent for 12.0s", MissingReason.AGENT_UNREACHABLE),
        ("agent unreachable: no agent registered this rank", MissingReason.AGENT_UNREACHABLE),
        ("no answer before deadline (30s)", MissingReason.NO_ANSWER),
        ("coordinator restarted before this rank's dump arrived", MissingReason.RESTARTED),
        ("process stopped (SIGSTOP?)", MissingReason.PROCESS_STOPPED),
        ("process gone", MissingReason.PROCESS_DEAD),
        ("no FR dump: fr_trace_json: timed out", MissingReason.NO_FR_DUMP),
        ("agent reported no result for this rank", MissingReason.NO_RESULT),
        ("dump failed", MissingReason.DUMP_FAILED),
        ("fr_trace_rank_0: INVALID_ARGUMENT: bad name", None),  # an upload refusal
    ],
)
def test_missing_reasons_read_back_from_their_text(text: str, code: MissingReason | None) -> None:
    assert MissingReason.of(text) is code
    unobserved = code in (
        MissingReason.AGENT_UNREACHABLE,
        MissingReason.NO_ANSWER,
        MissingReason.RESTARTED,
    )
    assert (code is not None and code.unobserved) == unobserved


# --- every writer and reader goes through the dataclasses -----------------------

# Code that ships, and the test support that stands in for agents and ranks.
SOURCES = ("hangwatch", "agent", "server", "analyzer", "tests/support", "benchmarks")
TAGS = (
    formats.RANKINFO,
    formats.RANKMETA,
    formats.INCIDENT,
    formats.HOOK_EVENT,
    formats.SERVER_INFO,
)
# A document built or read by hand: its schema tag spelled out, a "schema" key
# written next to a format constant, or the tag looked up in a parsed dict.
BY_HAND = [
    *(re.compile(re.escape(f'"{t}"')) for t in TAGS),
    re.compile(r'"schema"\s*:\s*formats\.(RANKINFO|RANKMETA|INCIDENT|HOOK_EVENT|SERVER_INFO)\b'),
    re.compile(r'\.get\(\s*"schema"\s*\)\s*[!=]=\s*formats\.(?!FRSTATUS)'),
    re.compile(r'\bSERVER_INFO_FILE\b|"server\.json"'),
]


def test_every_writer_and_reader_uses_the_dataclasses() -> None:
    hits = []
    for folder in SOURCES:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            rel = path.relative_to(REPO_ROOT)
            if "_proto" in rel.parts or rel.parts[:2] == ("hangwatch", "formats"):
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if any(p.search(line) for p in BY_HAND):
                    hits.append(f"{rel}:{n}: {line.strip()}")
    assert hits == [], "build and read these files with hangwatch.formats:\n" + "\n".join(hits)


def test_the_check_finds_a_hand_built_document(tmp_path: Path) -> None:
    """The scan above is not vacuous: the hand-written forms it replaced are caught."""
    old = [
        '    meta = {"schema": formats.RANKMETA, "rank": rank}',
        '        if info.get("schema") != formats.RANKINFO:',
        '    doc = {"schema": "hangwatch.incident/1", "id": iid}',
        '    path = data_dir / "server.json"',
    ]
    assert all(any(p.search(line) for p in BY_HAND) for line in old)
    assert not any(p.search('if doc.get("schema") == formats.FRSTATUS:') for p in BY_HAND)
