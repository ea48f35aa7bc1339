"""API keys: how a presented key is read and hashed, written once for tenants and admins.

Keys are never stored: a policy holds ``sha256:<hex>`` digests (``inference-gateway keys hash``
makes one) and a presented key is hashed and looked up. The lookup is a dict or set membership
on the digest, so its timing depends on the digest (which an attacker cannot steer towards a
valid key), not on how many leading characters of a key are right.
"""

from __future__ import annotations

import hashlib

PREFIX = "sha256:"


def hash_api_key(key: str | bytes) -> str:
    """The form in which policies store keys: ``sha256:`` and the hex digest of the key."""
    raw = key.encode() if isinstance(key, str) else key
    return PREFIX + hashlib.sha256(raw).hexdigest()


def bearer_key(authorization: bytes | None) -> bytes | None:
    """The key of an ``Authorization: Bearer <key>`` header; None when absent or not a bearer key."""
    if not authorization:
        return None
    scheme, _, key = authorization.partition(b" ")
    key = key.strip()
    if scheme.lower() != b"bearer" or not key:
        return None
    return key
