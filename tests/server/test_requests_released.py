"""A streaming call holds no parsed message while it waits for the next one
(server.ingest.requests): the coordinator copies out what it keeps and lets
the message (protobuf's own copy of its bytes) go. The clients here send
serialized bytes, so the only parsed messages in this process are the
coordinator's."""

from __future__ import annotations

import gc
import hashlib
import threading
from collections.abc import Iterator

import grpc
import pytest
from hangwatch.server.coordinator import Coordinator
from hangwatch.server.ingest.auth import SERVICE

from hangwatch.wire import pb

from .conftest import chunks, wait_for


def _parsed(*types: type) -> int:
    """Messages of `types` alive in this process."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) in types)


@pytest.mark.timeout(30)
def test_an_upload_stream_does_not_hold_its_last_message(coordinator: Coordinator) -> None:
    """Its chunks' data is held (the batch is stored whole at the end); the
    parsed message is not: gRPC's request iterator kept it until the next one."""
    iid = coordinator.store.create_incident(
        job_id="job-1", reason="test", trigger="stall", ranks_expected=[0]
    ).id
    data = hashlib.sha256(b"x").digest() * 8_000  # 256 KB, two chunks
    cs = chunks("job-1", "node-a", iid, 0, "fr_tail_rank_0", data, 128_000)
    first, rest = (pb.BundleChunks(chunks=part).SerializeToString() for part in (cs[:1], cs[1:]))
    del cs
    go_on = threading.Event()

    def requests() -> Iterator[bytes]:
        yield first
        go_on.wait(20)
        yield rest

    with grpc.insecure_channel(coordinator.grpc_address) as ch:
        call = ch.stream_unary(
            f"/{SERVICE}/UploadFiles",
            request_serializer=None,  # the requests are serialized already
            response_deserializer=pb.UploadFilesAck.FromString,
        )
        ack = call.future(requests(), timeout=20)
        try:
            wait_for(lambda: coordinator.service.held.held > 0, 10, "the first message taken")
            wait_for(
                lambda: _parsed(pb.BundleChunks, pb.BundleChunk) == 0,
                10,
                "the coordinator to let its first message go",
            )
        finally:
            go_on.set()
        files = ack.result().files
    assert [(f.rank, f.file_name, f.complete) for f in files] == [(0, "fr_tail_rank_0", True)]
    stored = coordinator.store.incident_dir(iid) / "rank_0" / "fr_tail_rank_0"
    assert stored.read_bytes() == data


@pytest.mark.timeout(30)
def test_a_relay_stream_does_not_hold_its_last_batch(coordinator: Coordinator) -> None:
    """A batch is applied and let go before the next is read. Its one report
    names no session, so the coordinator answers it: the answer comes after
    the batch was taken."""
    batch = pb.ProgressBatch(
        relay_id="relay-a",
        reports=[pb.ProgressReport(job_id="j", agent_id="a", session_id="0" * 32, report_seq=7)],
    ).SerializeToString()
    done = threading.Event()

    def requests() -> Iterator[bytes]:
        yield batch
        done.wait(20)

    with grpc.insecure_channel(coordinator.grpc_address) as ch:
        call = ch.stream_stream(
            f"/{SERVICE}/RelayProgress",
            request_serializer=None,  # the requests are serialized already
            response_deserializer=pb.RelayAck.FromString,
        )
        answers = call(requests(), timeout=20)
        try:
            first = next(answers)
            assert [(a.session_id, a.report_seq, a.known) for a in first.acks] == [
                ("0" * 32, 7, False)
            ]
            assert _parsed(pb.ProgressBatch, pb.ProgressReport) == 0
        finally:
            done.set()
            answers.cancel()
