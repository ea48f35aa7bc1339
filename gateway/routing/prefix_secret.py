"""The cache-salt secret in prefix hashing: keyed chain roots, the trace log's hashes, the fleet stream.

Why: a prompt's block-hash chain (``prefix_keys.py``) leaves the process in two places, the
fleet's prefix view (a Redis stream every replica reads, ``gateway/fleet/prefix_sync.py``) and
the request trace log (``gateway/routing/prefix_signature.py``). A chain anyone can compute lets whoever
reads either confirm a guessed prompt for a tenant. Keying the root alone is not enough: a
chain hash is the seed of the next (``h_i = xxh64(block_i, seed=h_{i-1})``), so a reader who
sees ``h_{i-1}`` checks a guessed block ``i`` with one xxh64 and no secret. So the secret
enters in three places, and no chain hash is ever written where others read it:

* **Roots** (routing, in the process): ``root = HMAC-SHA256(secret, "prefix-keys␀root␀" scope
  ␀ model)``, its first 8 bytes as a big-endian integer. Memoised per (scope, model), a set the
  policy bounds (tenants' scopes × models; cleared past ``MAX_ROOTS`` in case reloads keep
  adding), so a request pays one dict lookup. The chain after the root stays xxh64 (a few
  hundred nanoseconds a block): its values never leave the process as they are.
* **Trace hashes** (the trace log): each chain hash through BLAKE2b-64 keyed with
  ``HMAC-SHA256(secret, "prefix-keys␀trace")``: a keyed one-way function, so equal prefixes
  still give equal hashes (what a what-if replay compares), and no written hash is the seed of
  another. About 0.45 µs a block (hashing the chain costs 0.17), paid only when a trace log is
  configured (``loadtests/results/prefix-secret/``).
* **Sealed stream entries** (the fleet view): an entry's blocks XOR a SHAKE-128 keystream of
  ``HMAC-SHA256(secret, "prefix-keys␀stream")`` and a random 16-byte nonce, behind the nonce
  and 8 check bytes (the keystream's first; a reader with another secret finds they differ and
  skips the entry). Without the secret an entry is noise: not even two entries' shared
  prefixes show. About 100 ns a block sealed and opened, in the background flush and read.

Domain: every HMAC input above starts with ``prefix-keys␀``, while a cache salt is the HMAC of
a scope (``tenant:…``, ``scope:…``) and the fleet stream's key the HMAC of
``fleet-prefix-view`` (``gateway/routing/isolation.py``, ``gateway/service.py``); so none of
these values equals, or tells anything about, a ``cache_salt``.

Who agrees: processes with the same secret (``cache_isolation.secret_env``) compute the same
roots and open each other's entries, exactly the processes that share engine cache entries
(one ``cache_salt`` per scope) and the fleet view's stream. Without the variable, each process
draws its own secret (so does its ``CacheSalter``), and the fleet view is off.

Usage::

    secret = PrefixSecret.from_env("GATEWAY_CACHE_SALT_SECRET")
    root = secret.root("tenant:acme", "llama")          # seeds the chain (prefix_keys.py)
    secret.trace_hashes(blocks)                         # ("3f0c…", ...) for the trace log
    secret.unseal(secret.seal(packed_blocks))           # the fleet stream's entries
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence

DOMAIN = b"prefix-keys"
"""The first field of every HMAC input of this module (never a scope, see the module docstring)."""
MAX_ROOTS = 65_536
"""Memoised roots at most; past it the memo starts again (a policy has far fewer)."""
NONCE_BYTES = 16
CHECK_BYTES = 8


class PrefixSecret:
    """Keyed prefix roots, trace hashes and sealed stream entries (see the module docstring)."""

    __slots__ = ("_roots", "_secret", "_stream_key", "_trace", "shared")

    def __init__(self, secret: bytes, *, shared: bool = True) -> None:
        if not secret:
            raise ValueError("the cache-salt secret must not be empty")
        self._secret = secret
        self._roots: dict[tuple[str, str], int] = {}
        self._trace = hashlib.blake2b(digest_size=8, key=_derive(secret, b"trace"))
        self._stream_key = _derive(secret, b"stream")
        self.shared = shared
        """False when the secret is this process's own random one."""

    @classmethod
    def from_env(cls, env_name: str, environ: Mapping[str, str] | None = None) -> PrefixSecret:
        """The secret of ``env_name`` (the cache salter's); a random one of this process's when
        unset (the salter built beside it warns about that once)."""
        value = (os.environ if environ is None else environ).get(env_name, "")
        return cls(value.encode()) if value else cls(os.urandom(32), shared=False)

    def root(self, scope: str, model: str) -> int:
        """The seed of ``scope``'s chains for ``model``: 64 bits of an HMAC of the secret."""
        key = (scope, model)
        root = self._roots.get(key)
        if root is None:
            if len(self._roots) >= MAX_ROOTS:
                self._roots.clear()
            message = b"\x00".join((DOMAIN, b"root", scope.encode(), model.encode()))
            root = int.from_bytes(hmac.digest(self._secret, message, "sha256")[:8], "big")
            self._roots[key] = root
        return root

    def trace_hashes(self, blocks: Sequence[int]) -> tuple[str, ...]:
        """Each chain hash through the keyed BLAKE2b-64, as 16 hex digits: what a trace may hold."""
        copy = self._trace.copy
        out = []
        for h in blocks:
            keyed = copy()
            keyed.update(h.to_bytes(8, "little"))
            out.append(keyed.hexdigest())
        return tuple(out)

    def seal(self, data: bytes) -> bytes:
        """``data`` as a stream entry carries it: nonce, check bytes, then ``data`` XOR the keystream."""
        nonce = os.urandom(NONCE_BYTES)
        stream = self._keystream(nonce, len(data))
        return nonce + stream[:CHECK_BYTES] + _xor(data, stream[CHECK_BYTES:])

    def unseal(self, sealed: bytes) -> bytes | None:
        """What ``seal`` was given; None when the entry was sealed under another secret (or is not one)."""
        head = NONCE_BYTES + CHECK_BYTES
        if len(sealed) < head:
            return None
        nonce, check = sealed[:NONCE_BYTES], sealed[NONCE_BYTES:head]
        stream = self._keystream(nonce, len(sealed) - head)
        if not hmac.compare_digest(stream[:CHECK_BYTES], check):
            return None
        return _xor(sealed[head:], stream[CHECK_BYTES:])

    def _keystream(self, nonce: bytes, size: int) -> bytes:
        return hashlib.shake_128(self._stream_key + nonce).digest(CHECK_BYTES + size)

    def __repr__(self) -> str:
        return f"PrefixSecret(shared={self.shared}, roots={len(self._roots)})"


def _derive(secret: bytes, purpose: bytes) -> bytes:
    """A 32-byte key of the secret's for one purpose (``DOMAIN ␀ purpose``)."""
    return hmac.digest(secret, DOMAIN + b"\x00" + purpose, "sha256")


def _xor(data: bytes, stream: bytes) -> bytes:
    """``data`` XOR ``stream`` (as long), in C: one big-integer XOR."""
    size = len(data)
    return (int.from_bytes(data, "little") ^ int.from_bytes(stream[:size], "little")).to_bytes(size, "little")
