"""gRPC TLS from the `auth` settings, both ways, for every hangwatch process.

One reading of --tls-cert, --tls-key and --tls-ca for the three roles that
speak gRPC: the coordinator serves with them, the agent dials with them, and
the relay does both (it serves its rack's agents and dials the coordinator).

- Serving: TLS when a certificate and key are given; a CA as well means the
  peers must present a certificate it signed (mTLS).
- Dialling: TLS when a CA is given, verifying the server with it; a
  certificate and key as well are presented as the client's (mTLS).

The relay presents its one certificate both ways, as the agent presents its
own: a certificate with no extended key usage, or with serverAuth and
clientAuth, serves for both.

Only grpc and the standard library: the agent imports this.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from hangwatch.config import AuthSection


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials(auth: AuthSection) -> grpc.ServerCredentials | None:
    """TLS when a cert and key are configured; with a CA, clients must present a cert."""
    if not (auth.tls_cert or auth.tls_key):
        return None
    if not (auth.tls_cert and auth.tls_key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    key, cert = Path(auth.tls_key).read_bytes(), Path(auth.tls_cert).read_bytes()
    ca = _read(auth.tls_ca)
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def channel_credentials(auth: AuthSection) -> grpc.ChannelCredentials | None:
    """TLS to a server verified with the CA, presenting the cert and key (mTLS)
    where both are given; None (plaintext) without a CA."""
    if not auth.tls_ca:
        return None
    both = auth.tls_cert and auth.tls_key
    return grpc.ssl_channel_credentials(
        root_certificates=_read(auth.tls_ca),
        private_key=_read(auth.tls_key) if both else None,
        certificate_chain=_read(auth.tls_cert) if both else None,
    )
