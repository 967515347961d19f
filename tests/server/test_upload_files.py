"""UploadFiles (phase one of a large incident) over real gRPC: many files per
stream, packed into few messages, stored all-or-nothing with a shared sync."""

from __future__ import annotations

import hashlib
import io
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from hangwatch.agent.uploader import archive_chunks, pack_chunks
from hangwatch.server.coordinator import Coordinator
from hangwatch.server.incidents.collection import fr_stored

from hangwatch.formats import nodearchive
from hangwatch.wire import pb, rpc

from .conftest import chunks

JOB = "job-1"


def _incident(c: Coordinator, ranks: list[int]) -> str:
    return c.store.create_incident(
        job_id=JOB, reason="test", trigger="stall", ranks_expected=ranks
    ).id


def _files(iid: str, spec: list[tuple[int, str, bytes]], chunk: int) -> list[pb.BundleChunk]:
    out: list[pb.BundleChunk] = []
    for rank, name, data in spec:
        out += chunks(JOB, "node-a", iid, rank, name, data, chunk)
    return out


def _send(
    stub: rpc.CoordinatorStub, cs: list[pb.BundleChunk], limit: int = 64 * 1024
) -> pb.UploadFilesAck:
    return stub.UploadFiles(pack_chunks(cs, limit), timeout=10, compression=grpc.Compression.Gzip)


@pytest.mark.timeout(30)
def test_many_files_in_one_stream_stored_and_replayed(
    coordinator: Coordinator, stub: rpc.CoordinatorStub
) -> None:
    iid = _incident(coordinator, list(range(8)))
    spec = [
        (r, name, (f"{name} of rank {r}\n" * (200 * (r + 1))).encode())
        for r in range(8)
        for name in (f"fr_tail_rank_{r}", "meta.json", "stacks.txt")
    ]
    # Chunks of 1,000 bytes packed into 64 KiB messages: files span messages
    # and messages hold many files.
    ack = _send(stub, _files(iid, spec, 1000))
    assert [(a.rank, a.file_name, a.complete, a.duplicate) for a in ack.files] == [
        (r, n, True, False) for r, n, _ in spec
    ]
    bundle = coordinator.store.incident_dir(iid)
    for r, name, data in spec:
        assert (bundle / f"rank_{r}" / name).read_bytes() == data
    assert not list(bundle.rglob("*.part"))
    assert coordinator.service.group_sync.syncs >= 2  # bytes, then names

    again = _send(stub, _files(iid, spec, 4096))
    assert [a.duplicate for a in again.files] == [True] * len(spec)
    text = coordinator.metrics.render_prometheus()
    assert 'hangwatch_upload_files_total{outcome="stored"} 24' in text
    assert 'hangwatch_upload_files_total{outcome="duplicate"} 24' in text


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("break_it", "code", "needle"),
    [
        (lambda cs: setattr(cs[-1], "sha256", "0" * 64), "DATA_LOSS", "sha256"),
        (lambda cs: cs.pop(), "INVALID_ARGUMENT", "stream ended inside"),
        (lambda cs: setattr(cs[3], "offset", cs[3].offset + 1), "INVALID_ARGUMENT", "offset"),
        (lambda cs: setattr(cs[-1], "file_name", "../escape"), "INVALID_ARGUMENT", "file_name"),
        (lambda cs: setattr(cs[-1], "rank", 9), "INVALID_ARGUMENT", "rank"),
        (lambda cs: setattr(cs[0], "incident_id", "../x"), "INVALID_ARGUMENT", "incident"),
        # cs[3] starts the second file: each file's first chunk names its job.
        (lambda cs: setattr(cs[3], "job_id", "other-job"), "NOT_FOUND", "other-job"),
    ],
)
def test_a_bad_file_sinks_the_whole_stream_and_leaves_nothing(
    coordinator: Coordinator,
    stub: rpc.CoordinatorStub,
    tmp_path: Path,
    break_it: Callable[[list[pb.BundleChunk]], object],
    code: str,
    needle: str,
) -> None:
    iid = _incident(coordinator, [0, 1])
    spec = [(0, "meta.json", b"m" * 3000), (1, "meta.json", b"n" * 3000)]
    cs = _files(iid, spec, 1000)
    break_it(cs)
    before = set(tmp_path.rglob("*"))
    with pytest.raises(grpc.RpcError) as ei:
        _send(stub, cs, limit=2500)
    assert ei.value.code().name == code, ei.value.details()
    assert needle in (ei.value.details() or "")
    # All or nothing: the good first file is not stored either, no .part left.
    assert [p for p in set(tmp_path.rglob("*")) - before if not p.is_dir()] == []
    assert not list(tmp_path.rglob("*.part"))
    assert not (coordinator.store.incident_dir(iid) / "rank_0" / "meta.json").exists()


@pytest.mark.timeout(30)
def test_stream_size_caps(start_coordinator: Callable[..., Coordinator]) -> None:
    c = start_coordinator(max_file_bytes=10_000)
    iid = _incident(c, [0, 1])
    with grpc.insecure_channel(c.grpc_address) as ch:
        stub = rpc.CoordinatorStub(ch)
        # One file over the per-file cap, whether or not its size is announced.
        for announced in (True, False):
            cs = _files(iid, [(0, "big", b"b" * 20_000)], 4096)
            if not announced:
                cs[0].total_size = 0
            with pytest.raises(grpc.RpcError) as ei:
                _send(stub, cs)
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Too many files for one stream.
        many = _files(iid, [(0, f"f{i}", b"x") for i in range(1025)], 10)
        with pytest.raises(grpc.RpcError) as ei:
            _send(stub, many)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1024 files" in (ei.value.details() or "")
    assert not [p for p in c.store.incident_dir(iid).rglob("*") if p.is_file()]
    assert c.service.held.held == 0  # every refused stream gave its bytes back


@pytest.mark.timeout(30)
def test_held_bytes_cap_across_streams(start_coordinator: Callable[..., Coordinator]) -> None:
    c = start_coordinator()
    c.service.held.limit = 50_000
    iid = _incident(c, [0])
    with grpc.insecure_channel(c.grpc_address) as ch:
        stub = rpc.CoordinatorStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            _send(stub, _files(iid, [(0, "a", b"a" * 60_000)], 8192))
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry" in (ei.value.details() or "")
        ok = _send(stub, _files(iid, [(0, "a", b"a" * 40_000)], 8192))
        assert ok.files[0].complete
    assert c.service.held.held == 0
    stored = c.store.incident_dir(iid) / "rank_0" / "a"
    assert (
        hashlib.sha256(stored.read_bytes()).hexdigest() == hashlib.sha256(b"a" * 40_000).hexdigest()
    )


def _archive(
    iid: str, members: list[tuple[int, str, bytes]], node: str = "node-a"
) -> list[pb.BundleChunk]:
    """A node archive's chunks, built by the agent's own code."""
    return list(archive_chunks(members, size=4096, job_id=JOB, agent_id=node, incident_id=iid))


@pytest.mark.timeout(30)
def test_a_node_archive_is_stored_as_one_file_and_read_back(
    coordinator: Coordinator, stub: rpc.CoordinatorStub
) -> None:
    iid = _incident(coordinator, list(range(16)))
    members = [
        (r, name, (f"{name} of rank {r}\n" * (300 * (r + 1))).encode())
        for r in range(8, 16)
        for name in (f"fr_tail_rank_{r}", "meta.json")
    ]
    ack = stub.UploadFiles(pack_chunks(_archive(iid, members), 64 * 1024), timeout=10)
    assert [(a.rank, a.file_name, a.complete, a.duplicate) for a in ack.files] == [
        (8, "node_8.zip", True, False)
    ]
    bundle = coordinator.store.incident_dir(iid)
    assert [p.name for p in nodearchive.archives(bundle)] == ["node_8.zip"]
    assert not list(bundle.glob("rank_*"))  # 16 files, none made one by one
    for r, name, data in members:
        assert nodearchive.stored_file(bundle, r, name) == data
    assert fr_stored(bundle, range(16)) == set(range(8, 16))
    # A replay (the agent retrying after a lost ack) is a duplicate.
    again = stub.UploadFiles(pack_chunks(_archive(iid, members), 64 * 1024), timeout=10)
    assert [a.duplicate for a in again.files] == [True]


def _zip(entries: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buf, "w") as z:
        warnings.simplefilter("ignore")  # a duplicate name is what one case sends
        for name, data in entries:
            z.writestr(name, data)
    return buf.getvalue()


def _raw_archive(
    iid: str, first: int, data: bytes, name: str | None = None
) -> list[pb.BundleChunk]:
    cs = chunks(JOB, "node-a", iid, first, name or nodearchive.archive_name(first), data, 4096)
    for c in cs:
        c.node_archive = True
    return cs


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("data", "name", "needle"),
    [
        # A member of a rank outside the incident (another job's, or made up).
        (_zip([("rank_0/meta.json", b"{}"), ("rank_99/meta.json", b"{}")]), None, "rank 99"),
        (_zip([("rank_0/../../etc/passwd", b"x")]), None, "not rank_<R>/<file name>"),
        (_zip([("rank_0/meta.json", b"{}"), ("rank_0/meta.json", b"{}")]), None, "twice"),
        (b"PK\x03\x04 not really a zip", None, "not a readable zip"),
        (_zip([("rank_0/meta.json", b"{}")]), "node_3.zip", "named 'node_0.zip'"),
    ],
)
def test_a_bad_node_archive_is_refused_and_nothing_stored(
    coordinator: Coordinator,
    stub: rpc.CoordinatorStub,
    data: bytes,
    name: str | None,
    needle: str,
) -> None:
    iid = _incident(coordinator, list(range(8)))
    with pytest.raises(grpc.RpcError) as e:
        stub.UploadFiles(pack_chunks(_raw_archive(iid, 0, data, name), 64 * 1024), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert needle in (e.value.details() or ""), e.value.details()
    bundle = coordinator.store.incident_dir(iid)
    assert nodearchive.archives(bundle) == [] and not list(bundle.rglob("*.part"))


@pytest.mark.timeout(30)
def test_a_node_archive_on_upload_bundle_is_refused(
    coordinator: Coordinator, stub: rpc.CoordinatorStub
) -> None:
    iid = _incident(coordinator, list(range(8)))
    cs = _raw_archive(iid, 0, _zip([("rank_0/meta.json", b"{}")]))
    with pytest.raises(grpc.RpcError) as e:
        stub.UploadBundle(iter(cs), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UploadFiles" in (e.value.details() or "")


@pytest.mark.timeout(30)
def test_an_archive_damaged_on_disk_counts_its_ranks_as_not_dumped_and_says_so(
    coordinator: Coordinator, stub: rpc.CoordinatorStub, caplog: pytest.LogCaptureFixture
) -> None:
    iid = _incident(coordinator, list(range(8)))
    members = [(r, f"fr_tail_rank_{r}", b"tail" * 100) for r in range(8)]
    stub.UploadFiles(pack_chunks(_archive(iid, members), 64 * 1024), timeout=10)
    bundle = coordinator.store.incident_dir(iid)
    [path] = nodearchive.archives(bundle)
    assert fr_stored(bundle, range(8)) == set(range(8))
    path.write_bytes(path.read_bytes()[:50])
    assert fr_stored(bundle, range(8)) == set()
    assert "node archive node_0.zip unreadable" in caplog.text
