"""A throwaway certificate authority for TLS tests, made with the openssl CLI.

Each name gets a key and a certificate the CA signed, valid for localhost and
127.0.0.1, with no extended key usage, so one certificate serves as a server's
and as a client's (the relay presents its one both ways).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

needs_openssl = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="needs the openssl CLI to make test certificates"
)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_pki(d: Path, names: tuple[str, ...]) -> Path:
    """`d`/ca.pem, and `d`/NAME.pem and NAME.key for each name; returns `d`."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "1", "-subj", "/CN=hangwatch-test-ca", cwd=d)  # fmt: skip
    for name in names:
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        (d / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    return d
