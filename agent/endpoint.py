"""Client for a rank's FR endpoint: HTTP POST over the rank's Unix socket, with a timeout."""

from __future__ import annotations

import http.client
import socket


class EndpointError(Exception):
    """The endpoint answered with an error status, or could not be reached."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._path)
        except BaseException:
            s.close()
            raise
        self.sock = s


def call(sock_path: str, handler: str, *, timeout: float, max_bytes: int = 256 << 20) -> bytes:
    """POST /handler/<handler>; the body on 200. Raises TimeoutError, EndpointError."""
    conn = _UnixConnection(sock_path, timeout)
    try:
        conn.request("POST", f"/handler/{handler}", body=b"", headers={"Content-Length": "0"})
        resp = conn.getresponse()
        body = resp.read(max_bytes + 1)
    except TimeoutError as e:
        raise TimeoutError(f"{handler}: no answer within {timeout:g}s") from e
    except (OSError, http.client.HTTPException) as e:
        raise EndpointError(f"{handler}: {type(e).__name__}: {e}") from e
    finally:
        conn.close()
    if len(body) > max_bytes:
        raise EndpointError(f"{handler}: answer larger than {max_bytes} bytes")
    if resp.status != 200:
        text = body[:300].decode("utf-8", "replace").strip()
        raise EndpointError(f"{handler}: HTTP {resp.status}: {text}")
    return body
