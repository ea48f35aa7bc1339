"""Media URLs in chat messages: a ``data:`` URL, or a prefix the operator allowed.

A multimodal engine downloads every URL a message names (vLLM: ``image_url``, ``audio_url``,
``video_url``, the Responses API's ``input_image`` and ``input_file``, Anthropic's ``image`` and
``document`` blocks with a ``url`` source) from where it runs: inside the cluster,
next to the cloud metadata service (169.254.169.254) and whatever listens on its host's
loopback. A tenant who may name any URL can make the engine fetch from there for it (SSRF).
The rule, checked before any backend sees the request:

1. A ``data:`` URL is always accepted: its content is in the body, bounded by the byte limit.
2. Any other URL must match an entry of ``limits.media_url_allowlist``: the same scheme, the
   same host (exact and case-insensitive; no wildcard, so no entry is broader than the host
   it names), the same port (a scheme's default when absent), and a path equal to the entry's
   or below it on a segment boundary (``/img`` admits ``/img/a.png``, not ``/img-private``).
   ``https`` unless the entry itself says ``http://``. Query strings are not matched.
3. A URL that two parsers could read differently is refused before matching: user info
   (``https://cdn.example.com@evil.test/``), backslashes, whitespace or control characters,
   percent-encoded dots, slashes or backslashes, and ``.``/``..`` path segments (the engine's
   client could resolve ``/public/../private`` where the gateway does not).
4. No entry can open an address that is never a media server: an entry whose host is a
   link-local (cloud metadata, ``fe80::/10``), loopback, unspecified or multicast literal IP,
   or a metadata host name (``metadata.google.internal``), fails the policy load whatever
   the operator meant. A literal private address (``10.0.0.7``) may be listed on purpose (an
   internal media server): entries name exact hosts, so listing it opens that host only.
   A request naming such an address is refused like any unlisted URL, with a message that
   says why.

Rules 3 and 4 are the allowlist's syntax too, read alike by the policy load: the URL reader and
the hosts no entry may open are ``gateway/policy/media_allowlist.py``'s.

No DNS lookup happens here (none on the request path): a host is matched by its name, so only
hosts whose DNS the operator controls belong on the list. Redirects are the engine's to
follow; pair this list with the engine's own (vLLM ``--allowed-media-domains`` and
``VLLM_MEDIA_URL_ALLOW_REDIRECTS=0``) so that an allowed host cannot redirect elsewhere.

The same parsing guards the one other URL a tenant can make an engine connect to: the server of a
Responses ``mcp`` tool, for a tenant whose policy allows that tool (``check_server_url``). No
operator lists those hosts, so the rule there is https to a public host.
"""

from __future__ import annotations

import ipaddress
from functools import lru_cache
from typing import Any

from gateway.errors import InvalidRequest
from gateway.policy.media_allowlist import (
    AllowedPrefix,
    MediaUrlRefused,
    never_a_media_server,
    parse_allowlist_entry,
    split_url,
    url_host,
)

MEDIA_URL_KEYS = ("image_url", "audio_url", "video_url")
"""Content-part keys whose value is a URL (or ``{"url": ...}``) the engine downloads."""

INTERNAL_NAME_SUFFIXES = (".localhost", ".local", ".internal", ".svc", ".lan", ".home.arpa")
"""Host-name endings that resolve only inside a host, a cluster or a site (``check_server_url``)."""


@lru_cache(maxsize=16)
def compile_allowlist(entries: tuple[str, ...]) -> tuple[AllowedPrefix, ...]:
    """The policy's entries, parsed once per distinct list (the policy validated them at load)."""
    return tuple(parse_allowlist_entry(entry) for entry in entries)


def check_media_urls(messages: Any, allowlist: tuple[str, ...], field: str = "messages") -> None:
    """400 ``media_url_not_allowed`` for the first URL in ``messages`` (the body's ``field``: chat's
    ``messages``, the Responses API's ``input`` items) that the rule refuses."""
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            check_parts_urls(content, f"{field}[{i}].content", allowlist)


def check_parts_urls(parts: list[Any], where: str, allowlist: tuple[str, ...]) -> None:
    """The rule over one list of content parts, the body's ``where`` (``documents[2].content``):
    each part named ``where[j]`` in the error."""
    for j, part in enumerate(parts):
        if isinstance(part, dict):
            _check_part(part, f"{where}[{j}]", allowlist)


def check_block_urls(messages: Any, allowlist: tuple[str, ...]) -> None:
    """The same rule for Anthropic Messages content blocks: an ``image`` or ``document`` whose
    ``source`` is a URL (``{"type": "url", "url": ...}``), also inside a ``tool_result``; a
    ``file`` source names a file stored with the provider, which no engine here holds (400)."""
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for j, block in enumerate(content):
                _check_block(block, f"messages[{i}].content[{j}]", allowlist)


def _check_block(block: Any, where: str, allowlist: tuple[str, ...]) -> None:
    if not isinstance(block, dict):
        return
    kind = block.get("type")
    if kind in ("image", "document"):
        source = block.get("source")
        if not isinstance(source, dict):
            return
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            _check_url(source["url"], f"{where}.source.url", allowlist)
        elif source.get("type") == "file":
            raise InvalidRequest(
                "A 'file' source names a file stored with the provider; this gateway forwards no stored "
                "files. Send the content as base64 or text.",
                code="unsupported_field",
                param=f"{where}.source",
            )
    elif kind == "tool_result" and isinstance(block.get("content"), list):
        for k, inner in enumerate(block["content"]):
            _check_block(inner, f"{where}.content[{k}]", allowlist)


def _check_part(part: dict[str, Any], where: str, allowlist: tuple[str, ...]) -> None:
    for key in MEDIA_URL_KEYS:
        value = part.get(key)
        if value is None:
            continue
        param = f"{where}.{key}"
        if isinstance(value, dict):
            value, param = value.get("url"), param + ".url"
        if isinstance(value, str):
            _check_url(value, param, allowlist)
    document = part.get("file")
    if isinstance(document, dict):
        _check_file(document, f"{where}.file", allowlist)
    if part.get("type") == "input_file":  # the Responses API's file part: its fields on the part itself
        if isinstance(part.get("file_url"), str):
            _check_url(part["file_url"], f"{where}.file_url", allowlist)
        _check_file(part, where, allowlist)


def _check_file(document: dict[str, Any], where: str, allowlist: tuple[str, ...]) -> None:
    """A ``file`` part carries its content (``file_data``); a stored ``file_id`` is the provider's."""
    if document.get("file_id") is not None:
        raise InvalidRequest(
            "'file_id' names a file stored with the provider, which would be the platform's, not "
            "yours; this gateway forwards no stored files. Send the content as 'file_data'.",
            code="unsupported_field",
            param=f"{where}.file_id",
        )
    data = document.get("file_data")
    if isinstance(data, str) and "://" in data[:16]:  # base64 has no ':'; a URL is checked like any
        _check_url(data, f"{where}.file_data", allowlist)


def _check_url(url: str, param: str, allowlist: tuple[str, ...]) -> None:
    if url[:5].lower() == "data:":
        return
    try:
        parsed, port = split_url(url)
    except MediaUrlRefused as why:
        raise _refused(param, str(why)) from None
    never = never_a_media_server(url_host(parsed))
    if never:
        raise _refused(param, f"it names {never}")
    if not any(prefix.admits(parsed, port) for prefix in compile_allowlist(allowlist)):
        raise _refused(param, "it is not a data: URL and matches no entry of the gateway's media URL allowlist")


def check_server_url(url: Any, param: str) -> None:
    """400 ``server_url_not_allowed`` unless ``url`` is an https URL to a public host: what an
    engine may connect to for a tenant (a Responses ``mcp`` tool's ``server_url``).

    The media rules' parsing (rule 3) and refusals (rule 4: metadata, link-local, loopback), and
    more, since no operator listed the host: https only, no literal address that is not global
    (private, shared, reserved), no name that only resolves inside a cluster or a host
    (``localhost``, a single label, ``.local``, ``.internal``, ``.localhost``, ``.svc``). Names are
    matched as written (no DNS lookup here): pair this with an egress policy for the engine."""
    if not isinstance(url, str):
        raise InvalidRequest(f"'{param}' must be a string.", param=param)
    try:
        parsed, _ = split_url(url)
    except MediaUrlRefused as why:
        raise _server_refused(param, str(why)) from None
    host = url_host(parsed).lower()
    never = never_a_media_server(host) or _not_public(host)
    if never:
        raise _server_refused(param, f"it names {never}")
    if parsed.scheme.lower() != "https":
        raise _server_refused(param, "it must be an https URL")


def _not_public(host: str) -> str | None:
    """What ``host`` is when no tenant's tool may reach it from the engine's network, else None."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if "." not in host or host.endswith(INTERNAL_NAME_SUFFIXES):
            return "a name that resolves only inside the engine's network"
        return None
    return None if address.is_global else "an address that is not public"


def _server_refused(param: str, why: str) -> InvalidRequest:
    message = f"The server URL in '{param}' is not allowed: {why}; a tool server must be https to a public host."
    return InvalidRequest(message, code="server_url_not_allowed", param=param)


def _refused(param: str, why: str) -> InvalidRequest:
    message = f"The media URL in '{param}' is not allowed: {why}."
    return InvalidRequest(message, code="media_url_not_allowed", param=param)
