"""Checks on the addresses settings name: webhook URLs and bind hosts."""

from __future__ import annotations

import ipaddress
import urllib.parse


def check_http_url(url: str, what: str, *, credentials: bool = True) -> None:
    """An http(s) URL with a host; ValueError names the setting, never the URL
    (a webhook URL is often the secret itself)."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as e:
        raise ValueError(f"{what}: not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what}: expected an http:// or https:// URL with a host")
    if not credentials and (parts.username or parts.password or parts.query):
        raise ValueError(f"{what}: must not carry credentials or a query")


def hostport(host: str, port: int) -> str:
    """host:port, with IPv6 literals bracketed."""
    h = host.strip("[]")
    return f"[{h}]:{port}" if ":" in h else f"{h}:{port}"


def check_hostport(target: str, what: str) -> None:
    """HOST:PORT (or [v6]:PORT) with a port in 1-65535, or a gRPC target URI
    (dns:///h:p, unix:/path, ipv4:...), which gRPC itself resolves. Without
    this, a typo is accepted and dialled for ever."""
    if ":/" in target or target.startswith(("unix:", "unix-abstract:", "ipv4:", "ipv6:")):
        return
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what}: expected HOST:PORT, got {target!r}")
    if host.startswith("[") != host.endswith("]") or (":" in host and not host.startswith("[")):
        raise ValueError(f"{what}: an IPv6 host goes in brackets, [::1]:PORT; got {target!r}")


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (a coordinator there needs no token)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
