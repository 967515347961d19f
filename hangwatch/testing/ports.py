"""Free TCP ports for test jobs and servers."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just reported free on `host`.

    Another process may take it before the caller binds it: the race is
    inherent to handing a port number to a child process. Callers that can
    bind port 0 themselves should do that instead; the zoo launcher retries
    once when its rendezvous port turns out to be taken.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
