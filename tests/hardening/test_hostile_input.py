"""Hostile and random agent input against a real coordinator over real gRPC (loopback, port 0).

- Messages over the size limit are refused with RESOURCE_EXHAUSTED.
- Bytes that are not a protobuf, sent through raw generic calls to every
  method, are refused and the server stays up.
- Property tests (hypothesis): every handler that takes agent data gets
  random-but-typed messages (huge and negative ints, NaN, weird unicode,
  path tricks, empty strings, a real session or incident id some of the
  time). Properties: the answer is OK or a clean refusal, never UNKNOWN or
  INTERNAL (an exception escaping a handler); the server stays healthy; and
  nothing is written outside the data dir.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypedDict

import grpc
import pytest
from hangwatch.server.coordinator import Coordinator
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hangwatch.config import Config
from hangwatch.wire import pb, rpc

SERVICE = "/hangwatch.v1.Coordinator/"
MAX_MSG = 256 * 1024
CLEAN = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DATA_LOSS,  # an upload whose sha256 does not match
    grpc.StatusCode.ABORTED,  # the same file being uploaded by another stream
}
JOB = "hostile-job"
AGENT = "hostile-agent"
HYP = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


class Env:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.coord = Coordinator(
            Config.of(
                data_dir=str(self.data), grpc_port=0, http_port=0, stall_timeout=0.5,
                dump_deadline=2.0, max_message_bytes=MAX_MSG,
            ),
            tick_s=0.05,
        )  # fmt: skip
        self.coord.start()
        self.channel = grpc.insecure_channel(
            self.coord.grpc_address,
            options=[("grpc.max_send_message_length", 8 * MAX_MSG)],
        )
        self.stub = rpc.CoordinatorStub(self.channel)
        resp = self.stub.Register(
            pb.RegisterRequest(
                job_id=JOB,
                agent_id=AGENT,
                host="h",
                ranks=[
                    pb.RankInfo(
                        rank=r, world_size=2, pid=100 + r, backend="gloo",
                        groups=[pb.GroupInfo(name="0", desc="default_pg", pg_id=0, ranks=[0, 1])],
                    )
                    for r in (0, 1)
                ],
            ),
            timeout=10,
        )  # fmt: skip
        self.session = resp.session_id
        row = self.coord.store.create_incident(
            job_id=JOB, reason="hostile input test", trigger="stall", ranks_expected=[0, 1]
        )
        self.incident = row.id
        self.outside_before = self.outside_files()

    def outside_files(self) -> set[str]:
        out: set[str] = set()
        for dirpath, _dirs, files in os.walk(self.root):
            if Path(dirpath).is_relative_to(self.data):
                continue
            out.update(os.path.join(dirpath, f) for f in files)
        return out

    def healthy(self) -> None:
        h = self.stub.Health(pb.HealthRequest(), timeout=5)
        assert h.serving

    def close(self) -> None:
        self.channel.close()
        self.coord.stop(grace=1.0)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    env = Env(tmp_path_factory.mktemp("hostile"))
    try:
        yield env
    finally:
        env.close()
    # Checked after the server stopped: nothing it wrote landed outside its data dir.
    assert env.outside_files() == env.outside_before


def _call(fn: Any, req: Any) -> grpc.StatusCode:
    try:
        fn(req, timeout=20)
    except grpc.RpcError as e:
        code = e.code()
        assert code in CLEAN, f"{code}: {e.details()}"
        return code  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


# ---- size limit and garbage -------------------------------------------------------------


@pytest.mark.timeout(60)
def test_oversized_messages_are_refused(hostile: Env) -> None:
    big = pb.RegisterRequest(job_id=JOB, agent_id=AGENT, host="x" * (2 * MAX_MSG))
    with pytest.raises(grpc.RpcError) as ei:
        hostile.stub.Register(big, timeout=10)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    chunk = pb.BundleChunk(
        job_id=JOB, agent_id=AGENT, incident_id=hostile.incident, rank=0,
        file_name="fr_trace_rank_0", data=b"\0" * (2 * MAX_MSG), last=True,
    )  # fmt: skip
    with pytest.raises(grpc.RpcError) as ei:
        hostile.stub.UploadBundle(iter([chunk]), timeout=10)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as ei:
        hostile.stub.UploadFiles(iter([pb.BundleChunks(chunks=[chunk])]), timeout=10)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    hostile.healthy()


GARBAGE = [
    b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",  # a varint that never ends
    b"\x0a\xff\xff\xff\xff\x0f" + b"a" * 8,  # a length far past the end
    b"\x07",  # wire type 7 does not exist
    os.urandom(4096),
]


def _assert_decode_refusal(e: grpc.RpcError) -> None:
    """grpc refuses undecodable bytes itself, before any handler runs. grpc.aio
    answers UNKNOWN naming the DecodeError (the sync server says INTERNAL);
    anything else would mean a handler saw the garbage."""
    code, details = e.code(), e.details() or ""
    assert code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT) or (
        code == grpc.StatusCode.UNKNOWN and "DecodeError" in details
    ), f"{code}: {details}"


UNARY = ["Register", "ReportProgress", "ReportEntries", "ReportEvent", "CompleteDump", "Health"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", UNARY)
def test_malformed_protobuf_bytes_are_refused(hostile: Env, method: str) -> None:
    raw = hostile.channel.unary_unary(SERVICE + method)  # no serializers: bytes on the wire
    for blob in GARBAGE:
        try:
            raw(blob, timeout=10)
        except grpc.RpcError as e:
            _assert_decode_refusal(e)
        # Random bytes can happen to parse (protobuf skips unknown fields); then
        # the handler's own validation answered, which is also fine.
    hostile.healthy()


@pytest.mark.timeout(60)
def test_malformed_stream_chunks_are_refused(hostile: Env) -> None:
    for method in ("UploadBundle", "UploadFiles"):
        raw = hostile.channel.stream_unary(SERVICE + method)
        with pytest.raises(grpc.RpcError) as ei:
            raw(iter([GARBAGE[0], GARBAGE[1]]), timeout=10)
        _assert_decode_refusal(ei.value)
    watch = hostile.channel.unary_stream(SERVICE + "WatchCommands")
    with pytest.raises(grpc.RpcError) as ei:
        list(watch(GARBAGE[1], timeout=10))
    _assert_decode_refusal(ei.value)
    hostile.healthy()


# ---- property tests ----------------------------------------------------------------------

NASTY = st.sampled_from(
    ["", ".", "..", "../../etc/passwd", "a/b", "/abs", "x\x00y", "\u202e", "é" * 300, "C:\\x", " "]
)


def idents(valid: str) -> st.SearchStrategy[str]:
    return st.one_of(st.just(valid), NASTY, st.text(max_size=70))


INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)
SMALL = st.integers(-3, 8)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
ENUM = st.integers(-1, 9)


def _drawn_property(test: Callable[[Env, st.DataObject], None]) -> Any:
    """`test` as a property drawing its message inside (`data`), under HYP's settings."""
    return pytest.mark.timeout(120)(HYP(given(data=st.data())(test)))


def _survives(hostile: Env, fn: Any, req: Any) -> None:
    """One hostile call: a clean answer or refusal (see `_call`), and the server still serves."""
    _call(fn, req)
    hostile.healthy()


class _Sender(TypedDict):
    job_id: str
    agent_id: str
    session_id: str


def _sender(hostile: Env, data: st.DataObject) -> _Sender:
    """Who a session message claims to come from: the fixture's ids or hostile ones, and the
    real session some of the time."""
    return _Sender(
        job_id=data.draw(idents(JOB)),
        agent_id=data.draw(idents(AGENT)),
        session_id=data.draw(st.one_of(st.just(hostile.session), st.text(max_size=40))),
    )


def groups() -> st.SearchStrategy[pb.GroupInfo]:
    return st.builds(
        pb.GroupInfo,
        name=idents("0"),
        desc=st.text(max_size=30),
        pg_id=st.one_of(SMALL, INT64),
        ranks=st.lists(st.one_of(SMALL, INT32), max_size=6),
    )


RANK_INFO = st.builds(
    pb.RankInfo,
    rank=st.one_of(SMALL, INT32),
    local_rank=st.one_of(SMALL, INT32),
    world_size=st.one_of(SMALL, INT32),
    pid=INT32,
    backend=st.one_of(st.just("gloo"), st.text(max_size=10)),
    torch_version=st.text(max_size=10),
    groups=st.lists(groups(), max_size=3),
    fr_source=st.text(max_size=12),
)


@pytest.mark.timeout(120)
@HYP
@given(
    job=idents(JOB),
    agent=idents(AGENT),
    host=st.text(max_size=40),
    ranks=st.lists(RANK_INFO, max_size=5),
    version=st.text(max_size=20),
)
def test_register_never_breaks(
    hostile: Env, job: str, agent: str, host: str, ranks: list[Any], version: str
) -> None:
    # A different agent id than the fixture's, so its session stays valid.
    agent = agent if agent != AGENT else AGENT + "-2"
    req = pb.RegisterRequest(
        job_id=job, agent_id=agent, host=host, ranks=ranks, agent_version=version
    )
    _survives(hostile, hostile.stub.Register, req)


@_drawn_property
def test_report_progress_never_breaks(hostile: Env, data: st.DataObject) -> None:
    inflight = st.builds(
        pb.InFlight, seq=st.one_of(SMALL, INT64), op=st.text(max_size=20), age_s=FLOATS
    )
    gp = st.builds(
        pb.GroupProgress,
        group=idents("0"),
        last_enqueued=st.one_of(SMALL, INT64),
        last_completed=st.one_of(SMALL, INT64),
        last_started=st.one_of(SMALL, INT64),
        oldest_in_flight=inflight,
        completed_unchanged_s=FLOATS,
    )
    rp = st.builds(
        pb.RankProgress,
        rank=st.one_of(SMALL, INT32),
        state=ENUM,
        groups=st.lists(gp, max_size=3),
        fr_age_s=FLOATS,
    )
    req = pb.ProgressReport(
        **_sender(hostile, data),
        report_seq=data.draw(UINT64),
        ranks=data.draw(st.lists(rp, max_size=4)),
    )
    _survives(hostile, hostile.stub.ReportProgress, req)


@_drawn_property
def test_report_entries_never_breaks(hostile: Env, data: st.DataObject) -> None:
    entry = st.builds(
        pb.FrEntry,
        rank=st.one_of(SMALL, INT32),
        record_id=st.one_of(SMALL, INT64),
        group=idents("0"),
        collective_seq=st.one_of(SMALL, INT64),
        p2p_seq=st.one_of(SMALL, INT64),
        profiling_name=st.one_of(st.just("gloo:all_reduce"), st.text(max_size=40)),
        state=st.one_of(
            st.sampled_from(["scheduled", "started", "completed"]), st.text(max_size=10)
        ),
        retired=st.booleans(),
        is_p2p=st.booleans(),
        age_s=FLOATS,
        input_sizes_json=st.one_of(st.just("[[16]]"), st.just("[" * 5000), st.text(max_size=60)),
        input_dtypes_json=st.one_of(st.just('["Float"]'), st.text(max_size=40)),
    )
    req = pb.EntryBatch(
        **_sender(hostile, data),
        entries=data.draw(st.lists(entry, max_size=6)),
        dropped=data.draw(UINT64),
    )
    _survives(hostile, hostile.stub.ReportEntries, req)


@_drawn_property
def test_report_event_never_breaks(hostile: Env, data: st.DataObject) -> None:
    req = pb.Event(
        **_sender(hostile, data),
        kind=data.draw(ENUM),  # type: ignore[arg-type]  # unknown enum values on purpose
        rank=data.draw(st.one_of(SMALL, INT32)),
        detail=data.draw(st.text(max_size=300)),
        age_s=data.draw(FLOATS),
    )
    _survives(hostile, hostile.stub.ReportEvent, req)


@_drawn_property
def test_upload_chunks_never_break(hostile: Env, data: st.DataObject) -> None:
    incident = data.draw(st.one_of(st.just(hostile.incident), idents("x")))
    name = data.draw(
        st.one_of(st.just("fr_trace_rank_0"), st.just("meta.json"), NASTY, st.text(max_size=40))
    )
    rank = data.draw(st.one_of(st.sampled_from([0, 1]), SMALL, INT32))
    chunk = st.builds(
        pb.BundleChunk,
        job_id=idents(JOB),
        agent_id=idents(AGENT),
        incident_id=st.one_of(st.just(incident), idents("x")),
        rank=st.one_of(st.just(rank), INT32),
        file_name=st.one_of(st.just(name), NASTY),
        offset=st.one_of(st.integers(0, 64), UINT64),
        data=st.binary(max_size=64),
        last=st.booleans(),
        sha256=st.one_of(
            st.just(""), st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
        ),
        total_size=st.one_of(st.integers(0, 256), UINT64),
    )
    chunks = data.draw(st.lists(chunk, min_size=0, max_size=4))
    _call(hostile.stub.UploadBundle, iter(chunks))
    # The same chunks through UploadFiles, cut into messages anywhere.
    cut = data.draw(st.integers(0, len(chunks)))
    messages = [pb.BundleChunks(chunks=chunks[:cut]), pb.BundleChunks(chunks=chunks[cut:])]
    _call(hostile.stub.UploadFiles, iter(messages))
    hostile.healthy()


@_drawn_property
def test_complete_dump_never_breaks(hostile: Env, data: st.DataObject) -> None:
    failure = st.builds(pb.RankFailure, rank=st.one_of(SMALL, INT32), reason=st.text(max_size=200))
    req = pb.DumpResult(
        job_id=data.draw(idents(JOB)),
        agent_id=data.draw(idents(AGENT)),
        incident_id=data.draw(st.one_of(st.just(hostile.incident), idents("x"))),
        ranks_dumped=data.draw(st.lists(st.one_of(SMALL, INT32), max_size=6)),
        failures=data.draw(st.lists(failure, max_size=3)),
    )
    _survives(hostile, hostile.stub.CompleteDump, req)
