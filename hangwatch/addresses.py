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


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (a coordinator there needs no token)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
