"""Response ids that say where their response lives: a follow-up through any replica, no Redis.

The Responses API keeps each stored response on one engine, so a follow-up
(``previous_response_id``) must reach that engine (``gateway/responses/affinity.py``). Asking a
shared map where an id lives costs a Redis round trip for every answer (its publish) and for
every follow-up that reaches another replica (its lookup): 0.25 of the fleet's 0.35 round trips
per request at 2,000 requests/s (``loadtests/results/fleet_scale/``), and a follow-up that cannot
be served while Redis is out. Instead, when the replicas share a secret
(``cache_isolation.secret_env``, the one that keys cache salts and the fleet's prefix view), the
gateway hands the client an id that carries its holder, sealed, and reads it back on the
follow-up: no write, no lookup, and no outage can lose a conversation. LiteLLM routes Responses
follow-ups the same way (the model id encoded in the response id); this one is also
authenticated, bound to its tenant and opaque.

**The id**: ``resp_`` + base64url(version ‖ created ‖ holder tag ‖ MAC) + ``.`` + the engine's
own id, where

* ``created`` is the wall-clock second it was issued (4 bytes): past ``ttl_s`` it is refused,
  like an expired entry of the map (replicas' clocks agree to far better than the hour);
* the holder tag is ``HMAC(key, "holder" ␀ model ␀ backend)``'s first 8 bytes: the client learns
  nothing of the fleet's names; the gateway finds the pair by computing the tags of the pairs
  its policy serves (memoised per policy snapshot), so a backend or model the policy no longer
  has is simply not found (404, as before);
* the MAC is ``HMAC(key, "id" ␀ tenant ␀ version ‖ created ‖ tag ‖ engine id)``'s first 16 bytes:
  an id cannot be forged or altered, and another tenant's id fails its check exactly as a random
  string does (one constant-time comparison; no store is asked for either), so a tenant can
  neither use another's responses nor learn that an id exists.

``key = HMAC(secret, "response-ids")``: its own domain, so no id tells anything about a cache salt
or a prefix root. Without the secret, each process would draw its own and no other replica could
read its ids: the gateway then keeps the shared map instead (``ResponseAffinity``).

Usage::

    ids = ResponseIds.from_env("GATEWAY_CACHE_SALT_SECRET")   # None without the variable
    public = ids.seal("resp_abc", "acme", "llama", "gpu-1")   # what the client sees
    ids.open(public, "acme", snapshot.backends_by_model)      # Opened("gpu-1", "llama", "resp_abc", ...)
    ids.sealed(public)                                        # True: the shape of a sealed id
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

VERSION = 1
PREFIX = "resp_"
SEPARATOR = "."
_META = struct.Struct(">BI8s")  # version, created (s), holder tag
TAG_BYTES = 8
MAC_BYTES = 16
TOKEN_CHARS = 39
"""base64url of the 29 bytes of meta and MAC, without padding."""
MAX_UPSTREAM_ID = 128
"""An engine id longer than this is handed out as it is (vLLM's are 37 characters): the client's
``previous_response_id`` is bounded (256)."""


class Named(Protocol):
    """A backend as the policy names it."""

    @property
    def name(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Opened:
    """What a sealed id says: who may continue it, where it lives, the engine's id, and until when."""

    backend: str
    model: str
    upstream_id: str
    left_s: float
    """Seconds until it expires."""


class ResponseIds:
    """Seals and opens response ids (module docstring)."""

    def __init__(self, secret: bytes, *, ttl_s: float = 3600.0, wall: Callable[[], float] = time.time) -> None:
        self._key = hmac.new(secret, b"response-ids", hashlib.sha256).digest()
        self.ttl_s = ttl_s
        self._wall = wall
        self._tags: dict[tuple[str, str], bytes] = {}
        self._pairs: tuple[object, dict[bytes, tuple[str, str]]] | None = None

    @classmethod
    def from_env(cls, name: str, *, ttl_s: float = 3600.0) -> ResponseIds | None:
        """From the secret in variable ``name``; None when it is unset (each process its own)."""
        value = os.environ.get(name)
        return cls(value.encode(), ttl_s=ttl_s) if value else None

    def seal(self, upstream_id: str, tenant: str, model: str, backend: str) -> str:
        """The id the client sees for the engine's ``upstream_id``."""
        if len(upstream_id) > MAX_UPSTREAM_ID:
            return upstream_id
        meta = _META.pack(VERSION, int(self._wall()) & 0xFFFFFFFF, self._tag(model, backend))
        token = base64.urlsafe_b64encode(meta + self._mac(tenant, meta, upstream_id)).rstrip(b"=")
        return f"{PREFIX}{token.decode()}{SEPARATOR}{upstream_id}"

    @staticmethod
    def sealed(response_id: str) -> bool:
        """Whether ``response_id`` has the shape of a sealed id (ids issued before the secret was set,
        or by a replica without it, do not: those are looked up in the shared map)."""
        head = len(PREFIX) + TOKEN_CHARS
        return len(response_id) > head and response_id.startswith(PREFIX) and response_id[head] == SEPARATOR

    def open(self, public_id: str, tenant: str, served: Mapping[str, Sequence[Named]]) -> Opened | None:
        """What ``public_id`` says, if ``tenant`` was handed it, it has not expired, and the policy
        (``served``: model → its backends, ``PolicySnapshot.backends_by_model``) still has its
        holder; else None, the same for all (the caller answers 404)."""
        head = len(PREFIX) + TOKEN_CHARS
        if not self.sealed(public_id):
            return None
        token = public_id[len(PREFIX) : head]
        try:
            raw = base64.urlsafe_b64decode(token + "=")
        except (binascii.Error, ValueError):
            return None
        if base64.urlsafe_b64encode(raw).rstrip(b"=") != token.encode():
            return None  # one encoding per id: b64decode skips stray characters and a last char's spare bits
        meta, mac = raw[: _META.size], raw[_META.size :]
        upstream_id = public_id[head + 1 :]
        if len(mac) != MAC_BYTES or not hmac.compare_digest(mac, self._mac(tenant, meta, upstream_id)):
            return None
        version, created, tag = _META.unpack(meta)
        holder = self._holders(served).get(tag)
        left_s = created + self.ttl_s - self._wall()
        if version != VERSION or holder is None or left_s <= 0:
            return None
        return Opened(backend=holder[1], model=holder[0], upstream_id=upstream_id, left_s=left_s)

    def _mac(self, tenant: str, meta: bytes, upstream_id: str) -> bytes:
        message = b"id\0" + tenant.encode() + b"\0" + meta + upstream_id.encode()
        return hmac.new(self._key, message, hashlib.sha256).digest()[:MAC_BYTES]

    def _tag(self, model: str, backend: str) -> bytes:
        tag = self._tags.get((model, backend))
        if tag is None:
            if len(self._tags) > 65_536:  # reloads kept adding names: start the memo again
                self._tags.clear()
            message = b"holder\0" + model.encode() + b"\0" + backend.encode()
            tag = self._tags[(model, backend)] = hmac.new(self._key, message, hashlib.sha256).digest()[:TAG_BYTES]
        return tag

    def _holders(self, served: Mapping[str, Sequence[Named]]) -> dict[bytes, tuple[str, str]]:
        """Tag → (model, backend) over what the policy serves, once per policy snapshot."""
        memo = self._pairs
        if memo is not None and memo[0] is served:
            return memo[1]
        pairs = {}
        for model, backends in served.items():
            for backend in backends:
                pairs[self._tag(model, backend.name)] = (model, backend.name)
        self._pairs = (served, pairs)
        return pairs
