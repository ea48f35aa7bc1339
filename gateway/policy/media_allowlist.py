"""The syntax of ``limits.media_url_allowlist``: how a URL is read, and the hosts no entry may open.

Why in ``policy``: the policy load parses every entry (``RequestLimits``, ``gateway/policy/model.py``)
and the request stage matches each media URL against the same parse
(``gateway/request/media.py``, whose docstring states the whole rule: rules 3 and 4 are here).
Both must read a URL alike, so there is one reader, at the lowest stage that needs it.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}
METADATA_HOSTS = frozenset({"metadata", "metadata.google.internal", "metadata.goog", "instance-data"})
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in ("fd00:ec2::254", "100.100.100.200"))
"""Metadata services outside the link-local range (AWS over IPv6, Alibaba Cloud)."""
_AMBIGUOUS = re.compile(r"[\x00-\x20\x7f\\]|%2[eEfF]|%5[cC]")


class MediaUrlRefused(ValueError):
    """Why a URL (a request's or an allowlist entry's) cannot be used."""


@dataclass(frozen=True, slots=True)
class AllowedPrefix:
    """One normalised allowlist entry: ``scheme://host:port/path``."""

    scheme: str
    host: str
    port: int
    path: str

    def admits(self, url: SplitResult, port: int) -> bool:
        if url.scheme.lower() != self.scheme or url_host(url) != self.host or port != self.port:
            return False
        path = url.path or "/"
        return self.path == "/" or path == self.path or path.startswith(self.path + "/")


def parse_allowlist_entry(text: str) -> AllowedPrefix:
    """An entry of ``limits.media_url_allowlist``, normalised; ``MediaUrlRefused`` says what is wrong."""
    url, port = split_url(text)
    if url.query or url.fragment:
        raise MediaUrlRefused("an entry is a prefix: no query string or fragment")
    host = url_host(url)
    never = never_a_media_server(host)
    if never:
        raise MediaUrlRefused(f"{host} is {never}; no entry may open it")
    path = (url.path or "/").rstrip("/") or "/"
    return AllowedPrefix(url.scheme.lower(), host, port, path)


def split_url(text: str) -> tuple[SplitResult, int]:
    """The URL's parts and its port, or ``MediaUrlRefused`` when it is not plainly one http(s) URL."""
    if _AMBIGUOUS.search(text):
        raise MediaUrlRefused("it has whitespace, a control character, a backslash or an encoded dot or slash")
    try:
        url = urlsplit(text)
        port = url.port
    except ValueError:
        raise MediaUrlRefused("it is not a valid URL") from None
    scheme = url.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise MediaUrlRefused(f"the scheme must be https (or http where allowed), not {scheme or 'none'!r}")
    if "@" in url.netloc:
        raise MediaUrlRefused("it carries user info ('@' before the host)")
    if not url.hostname:
        raise MediaUrlRefused("it has no host")
    if any(segment in (".", "..") for segment in url.path.split("/")):
        raise MediaUrlRefused("its path has '.' or '..' segments")
    return url, DEFAULT_PORTS[scheme] if port is None else port


def url_host(url: SplitResult) -> str:
    """The URL's host as matched: lower-case (``urlsplit``), without a trailing dot."""
    return (url.hostname or "").rstrip(".")


def never_a_media_server(host: str) -> str | None:
    """What ``host`` is when it can never be a media server (a metadata service, ...), else None."""
    if host in METADATA_HOSTS:
        return "a cloud metadata host"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if address.is_link_local:
        return "a link-local address (where cloud metadata services listen)"
    if address.is_loopback:
        return "a loopback address"
    if address.is_unspecified or address.is_multicast:
        return "not a unicast address"
    return None
