"""Prefix keys: a request's prompt as a chain of block hashes, scoped to a tenant and a model.

Rendering, canonical so that equal prompts give equal bytes, is the request's dialect's
(``Dialect.render``, ``gateway/dialects/``): chat renders the ``tools`` then every message in
order as ``\\x1e<role>\\x1f<content>``, so the system prompt leads; completions and embeddings
their text as is, token ids as their 4-byte array.

Blocks: ``block_tokens`` estimated tokens, i.e. ``4 × block_tokens`` bytes of the UTF-8
rendering (the estimator's four characters a token), or ``block_tokens`` tokens of a configured
tokenizer. Only full blocks are keyed, as an engine caches only full blocks.

Chain: ``h_0 = xxh64(block_0, seed=root)``, ``h_i = xxh64(block_i, seed=h_{i-1})`` with
``root = PrefixSecret.root(scope, model)``, an HMAC of the cache-salt secret
(``prefix_secret.py``), and ``scope`` from ``isolation.tenant_scope``. So the same prompt under
two tenants gives unrelated chains, tenants of one shared scope get the same chain, a
conversation's next turn (which resends the previous ones) extends the chain of the previous
turn, and only who holds the secret can compute a chain: replicas sharing it (as they share
engine caches) agree. A chain hash seeds the next, so the hashes themselves never leave the
process as they are: the trace log writes them through a keyed one-way function, the fleet
stream seals them (``prefix_secret.py``).

Cost: one dict lookup for the root (memoised per scope and model), one join and one encode of
the prompt, then one ``xxh64`` per block over a memoryview slice (no copy, no per-token Python
loop). Keys are computed once per request and kept on ``InferenceRequest.prefix_keys``: a
queued request may be picked several times.

Most of that cost is the per-block call, and a conversation's next turn resends the previous
prompt whole, so a router may pass a ``ChainMemo``: the chains of recent prompts by a 128-bit
digest of their exact rendered bytes (and the root). A new prompt looks up its own prefixes
ending at its last few message starts (``\x1e``), one ``xxh3_128`` each (about a microsecond for
20 kB), and hashes only the blocks after the longest one found. A chain depends on nothing but
the root and the bytes, so a continued chain equals a recomputed one; a false match needs a
128-bit collision. Token-id prompts and configured tokenizers do not use the memo.
"""

from __future__ import annotations

import re
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import xxhash

from gateway.dialects.base import MESSAGE_START, Dialect
from gateway.policy.model import Tenant
from gateway.routing.isolation import tenant_scope
from gateway.routing.prefix_secret import PrefixSecret
from gateway.types import InferenceRequest, PrefixKeys

CHARS_PER_TOKEN = 4
_MESSAGE_START = MESSAGE_START.encode()

Splitter = Callable[[str], list[str]]
"""A tokenizer as routing needs it: text to its tokens' strings (ids are not needed to hash)."""

_WORDS = re.compile(r"\w+|[^\w\s]")
TOKENIZERS: dict[str, Splitter] = {"words": _WORDS.findall}
"""Tokenizers by policy name (``routing.tokenizer``); ``estimate`` means none."""


def scope_root(scope: str, model: str) -> int:
    """An *unkeyed* root, ``xxh64(scope ␀ model)``: only for tools that know no secret and compare
    chains among themselves (the load generator's and a what-if replay's synthetic signatures,
    ``gateway/routing/prefix_signature.py``). The gateway's roots are ``PrefixSecret.root``."""
    return xxhash.xxh64_intdigest(f"{scope}\x00{model}".encode())


def prefix_keys(
    request: InferenceRequest,
    tenant: Tenant,
    block_tokens: int,
    tokenizer: Splitter | None = None,
    memo: ChainMemo | None = None,
    *,
    secret: PrefixSecret,
) -> PrefixKeys:
    """The request's keys, from its cache when they were computed with the same root and block size."""
    root = secret.root(tenant_scope(tenant), request.model)
    cached = request.prefix_keys
    if cached is not None and cached.root == root and cached.block_tokens == block_tokens:
        return cached
    text_or_ids = request.api.render(request.body)
    if isinstance(text_or_ids, array):
        blocks = chain(text_or_ids.tobytes(), 4 * block_tokens, root)
    elif tokenizer is None:
        data = text_or_ids.encode()
        block_bytes = CHARS_PER_TOKEN * block_tokens
        blocks = chain(data, block_bytes, root) if memo is None else memo.chain(data, block_bytes, root)
    else:
        blocks = chain_tokens(tokenizer(text_or_ids), block_tokens, root)
    keys = PrefixKeys(root, block_tokens, blocks)
    request.prefix_keys = keys
    return keys


def chain(data: bytes, block_bytes: int, root: int, start: int = 0) -> tuple[int, ...]:
    """Chained xxh64 of each full ``block_bytes`` block of ``data`` from byte ``start`` (a block
    boundary), continuing from ``root`` (the root, or the hash of the block before ``start``)."""
    view = memoryview(data)
    h = root
    digest = xxhash.xxh64_intdigest
    return tuple(
        [h := digest(view[i : i + block_bytes], h) for i in range(start, len(data) - block_bytes + 1, block_bytes)]
    )


class ChainMemo:
    """Chains of recently keyed prompts, to continue a conversation's chain (module docstring).

    Bounded by the blocks it holds (``max_blocks``, LRU); a router owns one, so it is only ever
    used from the event loop's thread.
    """

    __slots__ = ("_chains", "_held", "lookback", "max_blocks")

    def __init__(self, max_blocks: int = 262_144, lookback: int = 4) -> None:
        self.max_blocks = max_blocks
        self.lookback = lookback
        self._chains: OrderedDict[tuple[int, int], tuple[int, ...]] = OrderedDict()
        self._held = 0

    def __len__(self) -> int:
        return len(self._chains)

    def chain(self, data: bytes, block_bytes: int, root: int) -> tuple[int, ...]:
        """``chain(data, block_bytes, root)``, reusing the chain of a memoised prefix of ``data``."""
        view = memoryview(data)
        known: tuple[int, ...] = ()
        end = len(data)
        for _ in range(self.lookback):
            if end < block_bytes:
                break
            key = (xxhash.xxh3_128_intdigest(view[:end], root), block_bytes)
            found = self._chains.get(key)
            if found is not None:
                known = found
                if end == len(data):  # the very same prompt (a retry, a repeated question)
                    self._chains.move_to_end(key)
                    return found
                break
            end = data.rfind(_MESSAGE_START, 0, end)
        blocks = known + chain(data, block_bytes, known[-1] if known else root, len(known) * block_bytes)
        self._remember((xxhash.xxh3_128_intdigest(view, root), block_bytes), blocks)
        return blocks

    def _remember(self, key: tuple[int, int], blocks: tuple[int, ...]) -> None:
        if not blocks or len(blocks) > self.max_blocks:
            return
        chains = self._chains
        old = chains.pop(key, None)
        if old is not None:
            self._held -= len(old)
        chains[key] = blocks
        self._held += len(blocks)
        while self._held > self.max_blocks:
            _key, dropped = chains.popitem(last=False)
            self._held -= len(dropped)


def chain_tokens(tokens: list[str], block_tokens: int, root: int) -> tuple[int, ...]:
    """Chained xxh64 of each full block of ``block_tokens`` tokens (joined per block, in C)."""
    h = root
    out = []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        h = xxhash.xxh64_intdigest("\x00".join(tokens[start : start + block_tokens]).encode(), h)
        out.append(h)
    return tuple(out)


def render(api: Dialect, body: dict[str, Any]) -> str | array[int]:
    """The canonical prompt of a request, as its dialect renders it; token ids as an array."""
    return api.render(body)
