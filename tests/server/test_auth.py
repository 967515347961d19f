"""Bearer-token auth and TLS on the real gRPC server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from hangwatch.server.coordinator import Coordinator

from hangwatch.wire import pb, rpc
from tests.support.pki import make_pki, needs_openssl

TOKEN = "s3cret-token-for-tests"


def _register(
    stub: rpc.CoordinatorStub, metadata: list[tuple[str, str]] | None
) -> pb.RegisterResponse:
    return stub.Register(
        pb.RegisterRequest(
            job_id="j",
            agent_id="a",
            host="h",
            ranks=[
                pb.RankInfo(rank=0, world_size=1, pid=1, groups=[pb.GroupInfo(name="0", ranks=[0])])
            ],
        ),
        metadata=metadata,
        timeout=5,
    )


@pytest.mark.timeout(30)
def test_token_required_on_every_rpc_but_health(
    start_coordinator: Callable[..., Coordinator],
) -> None:
    c = start_coordinator(token=TOKEN)
    with grpc.insecure_channel(c.grpc_address) as ch:
        stub = rpc.CoordinatorStub(ch)
        for md in (None, [("authorization", "Bearer wrong")], [("authorization", TOKEN)]):
            with pytest.raises(grpc.RpcError) as ei:
                _register(stub, md)
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Streaming methods are guarded too.
        with pytest.raises(grpc.RpcError) as ei:
            next(
                iter(
                    stub.WatchCommands(
                        pb.WatchRequest(job_id="j", agent_id="a", session_id="x"), timeout=5
                    )
                )
            )
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as ei:
            stub.UploadBundle(
                iter([pb.BundleChunk(incident_id="x", file_name="f", last=True)]), timeout=5
            )
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as ei:
            stub.UploadFiles(
                iter(
                    [
                        pb.BundleChunks(
                            chunks=[pb.BundleChunk(incident_id="x", file_name="f", last=True)]
                        )
                    ]
                ),
                timeout=5,
            )
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as ei:
            report = pb.ProgressReport(job_id="j", agent_id="a", session_id="x", report_seq=1)
            next(iter(stub.StreamProgress(iter([report]), timeout=5)))
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert c.registry.jobs() == []

        good = [("authorization", f"Bearer {TOKEN}")]
        assert len(_register(stub, good).session_id) == 32
        assert c.registry.jobs() == ["j"]
        # Health answers without a token (documented: liveness probes).
        assert stub.Health(pb.HealthRequest(), timeout=5).serving
    assert (
        c.metrics.counter(
            "hangwatch_grpc_requests_total", {"method": "Register", "code": "UNAUTHENTICATED"}
        )
        == 3
    )


@pytest.mark.timeout(60)
@needs_openssl
def test_mutual_tls(start_coordinator: Callable[..., Coordinator], tmp_path: Path) -> None:
    d = make_pki(tmp_path / "pki", ("server", "client"))
    c = start_coordinator(
        tls_cert=str(d / "server.pem"), tls_key=str(d / "server.key"), tls_ca=str(d / "ca.pem")
    )
    ca = (d / "ca.pem").read_bytes()
    with_cert = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=(d / "client.key").read_bytes(),
        certificate_chain=(d / "client.pem").read_bytes(),
    )
    with grpc.secure_channel(c.grpc_address, with_cert) as ch:
        assert rpc.CoordinatorStub(ch).Health(pb.HealthRequest(), timeout=10).serving
    # No client certificate: the handshake is refused.
    with grpc.secure_channel(
        c.grpc_address, grpc.ssl_channel_credentials(root_certificates=ca)
    ) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            rpc.CoordinatorStub(ch).Health(pb.HealthRequest(), timeout=5)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    # Plaintext to a TLS port fails too.
    with grpc.insecure_channel(c.grpc_address) as ch, pytest.raises(grpc.RpcError):
        rpc.CoordinatorStub(ch).Health(pb.HealthRequest(), timeout=5)
