"""A request's prefix-structure signature, computed: what a replay needs of its prompt, never its text.

The value (``PrefixSignature``) and the fields a trace writes of it are telemetry's
(``gateway/telemetry/prefix_signature.py``, below this stage: the trace log writes it); computing
one takes this stage's block chain and secret, so the functions that compute it are here.

Why: a what-if replay (``loadtests/whatif/``) must send prompts that share prefixes exactly as
the recorded ones did, and keep two tenants' prompts apart, without the trace ever holding a
word of them. The signature is the prompt's block-hash chain under the routing rule
(``gateway/routing/prefix_keys.py``): the dialect's canonical rendering cut into blocks of
``block_tokens`` *estimated* tokens (``CHARS_PER_TOKEN`` bytes each; token-id prompts
``block_tokens`` ids), ``h_0 = xxh64(block_0, seed=root)``, ``h_i = xxh64(block_i, seed=h_{i-1})``,
each hash written as 16 hex digits. So:

* two requests share a cached prefix exactly as long as their chains share a head;
* a conversation's next turn (which resends the previous ones) extends the previous chain;
* two scopes' chains never meet (the scope seeds the root).

The gateway signs with the tenant's cache scope (``isolation.tenant_scope``) and its cache-salt
secret (``gateway/routing/prefix_secret.py``): the root is ``PrefixSecret.root(scope, model)``,
and each hash is written through the secret's keyed one-way function
(``PrefixSecret.trace_hashes``), which keeps equal hashes equal. The load generator, which knows
no policy and no secret, signs with the unkeyed root ``prefix_keys.scope_root(private_scope(tenant
name), model)`` and writes the hashes as they are. The two never agree, and need not: a replay
only compares chains inside one trace, so equality inside a trace is all a signature must give.

Bounds: a chain holds at most ``MAX_SIGNATURE_BLOCKS`` (4,096) blocks, 262,144 estimated tokens
at the default 64-token block; the bytes past it are never hashed, and a replay treats them as
an unshared tail (``prompt_tokens_est`` still counts them). Only full blocks are hashed, as an
engine caches only full blocks.

What the hashes disclose: nothing can be read back from them, and without the cache-salt secret
a guessed prompt cannot be checked against a gateway's trace either: its chain starts from a
keyed root, and the hashes written are keyed one-way images of the chain, so none is the seed
of the next. What a trace does tell is the structure: prompt sizes, and which requests of one
tenant share a prefix. The session field is a plain digest of (tenant, id) (``session_hash``,
the load generator computes the same): a guessed session id can be checked. A load generator's
records are unkeyed: whoever guesses their synthetic prompts can check them. Treat a trace log
like the access log it is.

Cost: one rendering and one xxh64 per block, then one keyed BLAKE2b-64 per block (about 0.45 µs),
only when a trace log is configured (the recorder computes it at the end of the request); keys
the router already computed for the same root and block size (``InferenceRequest.prefix_keys``)
are reused, not hashed again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

import xxhash

from gateway.dialects.base import Dialect
from gateway.errors import GatewayError
from gateway.policy.model import ModelPolicy, RequestLimits
from gateway.request.tokens import CharRatioEstimator
from gateway.routing.prefix_keys import CHARS_PER_TOKEN, chain, scope_root
from gateway.routing.prefix_secret import PrefixSecret
from gateway.telemetry.prefix_signature import PrefixSignature
from gateway.types import InferenceRequest

MAX_SIGNATURE_BLOCKS = 4096
"""Blocks kept per chain; the rest of a longer prompt is an unshared tail to a replay."""
DEFAULT_BLOCK_TOKENS = 64
"""The routing default (``Routing.block_tokens``): the block size of the load generator's signatures."""
SESSION_FIELD = "prompt_cache_key"
"""A body field some clients (OpenAI's SDKs) set per conversation; read when the header is absent."""

_UNBOUNDED = ModelPolicy(name="signature", max_prompt_tokens=1 << 40)
"""A model without a prompt cap, for estimating a body client-side."""


def private_scope(tenant: str) -> str:
    """The cache scope of a tenant that shares none (``isolation.tenant_scope`` of such a tenant)."""
    return f"tenant:{tenant}"


def request_signature(
    request: InferenceRequest, scope: str, block_tokens: int, *, secret: PrefixSecret, reuse_keys: bool = True
) -> PrefixSignature:
    """The signature of a validated request under ``scope``, keyed with ``secret`` (the gateway's view).

    ``reuse_keys``: take the router's keys when they were computed for this root and block size;
    pass False when the model routes with a configured tokenizer (its blocks are not byte blocks).
    """
    root = secret.root(scope, request.model)
    keys = request.prefix_keys
    if reuse_keys and keys is not None and keys.root == root and keys.block_tokens == block_tokens:
        blocks = keys.blocks[:MAX_SIGNATURE_BLOCKS]
    else:
        blocks = _chain(request.api.render(request.body), block_tokens, root)
    return PrefixSignature(block_tokens, secret.trace_hashes(blocks), request.prompt_tokens)


def body_signature(
    api: Dialect, body: dict[str, Any], *, scope: str, block_tokens: int = DEFAULT_BLOCK_TOKENS
) -> PrefixSignature:
    """The signature of a request body as a client sends it (the load generator's view), under the
    unkeyed root (``prefix_keys.scope_root``): a client knows no secret.

    The model is the body's; the estimate is the gateway's own (the dialect's estimate with the
    default estimator), or the rendering's length when the body would exceed the default limits.
    """
    model = str(body.get("model", ""))
    rendered = api.render(body)
    blocks = _chain(rendered, block_tokens, scope_root(scope, model))
    return PrefixSignature(block_tokens, hex_chain(blocks), estimate_prompt_tokens(api, body, rendered))


def estimate_prompt_tokens(api: Dialect, body: dict[str, Any], rendered: str | array[int] | None = None) -> int:
    """The gateway's prompt estimate of ``body`` under default limits (its rendering's size when
    the body breaks them: a client-side record must never fail on what the gateway would refuse)."""
    estimator = CharRatioEstimator()
    try:
        return api.prompt_tokens(body, _UNBOUNDED, RequestLimits(), estimator)
    except GatewayError:
        text = api.render(body) if rendered is None else rendered
        return len(text) if isinstance(text, array) else estimator.count(text)


def hex_chain(blocks: Sequence[int]) -> tuple[str, ...]:
    """Each hash as 16 hex digits (``map`` of a bound ``%``: half the cost of an f-string loop)."""
    return tuple(map(_HEX64, blocks))


_HEX64 = "%016x".__mod__


def request_session(request: InferenceRequest) -> str | None:
    """The client's conversation id: ``x-session-id``, else the body's ``prompt_cache_key`` (raw)."""
    if request.session_id:
        return request.session_id
    value = request.body.get(SESSION_FIELD)
    return value if isinstance(value, str) and value else None


def session_hash(tenant: str, session: str) -> str:
    """A conversation id as a trace keeps it: 16 hex digits of BLAKE2b over (tenant, id), so equal
    ids of one tenant stay equal, two tenants' never meet, and the raw id is never written."""
    digest = hashlib.blake2b(f"{private_scope(tenant)}\x00{session}".encode(), digest_size=8)
    return digest.hexdigest()


def scoped_block_id(scope: str, model: str, block_id: str) -> str:
    """A foreign trace's block id (a Mooncake ``hash_ids`` entry) as a chain hash of ``scope``:
    the same id under one scope gives the same hash, under two scopes two unrelated ones."""
    return f"{xxhash.xxh64_intdigest(block_id.encode(), scope_root(scope, model)):016x}"


def _chain(rendered: str | array[int], block_tokens: int, root: int) -> tuple[int, ...]:
    """The capped chain of a rendering: only the bytes of the first ``MAX_SIGNATURE_BLOCKS`` blocks are hashed."""
    if isinstance(rendered, array):
        data, block_bytes = rendered.tobytes(), 4 * block_tokens
    else:
        data, block_bytes = rendered.encode(), CHARS_PER_TOKEN * block_tokens
    return chain(data[: MAX_SIGNATURE_BLOCKS * block_bytes], block_bytes, root)
