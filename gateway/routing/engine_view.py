"""The engines' own word on what they hold (their KV events), as the prefix router reads it.

Why: the router's index (``prefix_index.py``) is a belief, built from where it sent prompts and
aged by an LRU it sizes itself; an engine that publishes its KV-cache events (vLLM, SGLang, the
simulator) says exactly which blocks it holds, evictions and restarts included, even for traffic
the gateway never saw (``gateway/kv_events/``: one exact ``BlockIndex`` per backend). To ask that
index about a request, the gateway computes the request's block hashes as the engine will:

1. the token ids the engine sees: the model's own tokenizer, and for chat its chat template
   (``tokenizer: {path, chat_template}`` on the model; ``gateway/request/engine_tokens.py``);
2. the engine's chain over them: its hash algorithm, its ``PYTHONHASHSEED`` and block size
   (``kv_events.hashing`` on the backend; ``gateway/kv_events/engine_hashes.py``), with the
   ``cache_salt`` the gateway sends that backend folded into the first block, as vLLM does.

**When it answers.** ``held`` gives an ``EngineMatch`` only for a backend whose feed is live (in
sequence and heard from within its ``silence_s``, ``gateway/kv_events/subscriber.py``) and that
has ``kv_events.hashing``, for a request the model's tokenizer can render as the engine does.
Otherwise None, and the router scores that backend on its estimate. The router keeps learning
its estimate from every dispatch either way, so a feed that falls silent falls back to an index
that is current. After an engine restarts, its first batch (``AllBlocksCleared``) empties its
index: from that batch on, nothing matches there.

**Tenant scope.** A salted backend (vLLM, SGLang, the simulator) gets the request's tenant-scope
salt (``isolation.CacheSalter``) in its first block, exactly as the attempt sends it, so a chain
under one scope shares no hash with another scope's: a match is only ever the request's own
scope's blocks. An unsalted kind (llama.cpp, openai) hashes with no salt, as its engine does;
isolation there rests on routing (``isolation.py``), and so does this.

**Cost**, once per request and hashing setting: the template, one tokenization (Rust), one hash
per block (vLLM's sha256 over CBOR, a few microseconds); memoised on the request
(``InferenceRequest.engine_keys``), since a queued request may be picked again. Each candidate is
then one dictionary lookup per matched block.

**A hashing that does not match the engine's** (another seed, algorithm, block size, tokenizer or
template than the engine's) would match nothing, ever, and routing "on the engine's word" would
ignore every cached prefix. The answers give it away: the engine says it reused a prompt's blocks
(``cached_tokens``) that its index matched none of. A backend whose index has never matched any
request's block, after ``MISMATCH_EVIDENCE`` answers reusing at least two of its blocks, is taken
as misconfigured: ``on_mismatch`` says so (an ERROR naming the backend, the metric
``gateway_kv_events_hashing_mismatch``) and it routes on the estimate until a reload changes its
hashing. One match ever proves the hashing right (a sha256 chain does not match by chance); a
match missed because the engine's batch had not arrived yet is not evidence, since a hashing
that matches will match the next time.

Not modelled: LoRA adapters (their name is in every block's extra keys) and multimodal inputs
(their hashes are): such requests route on the estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gateway.dispatch.router import CacheReport
from gateway.engines import engine
from gateway.kv_events.block_index import KvBlockIndexes
from gateway.kv_events.engine_hashes import EngineBlockHasher, EngineHashing, HashAlgorithm
from gateway.kv_events.wire import BlockHash
from gateway.policy.model import Backend, KvHashing, Tenant
from gateway.request.engine_tokens import EngineTokenizer, engine_prompt_ids
from gateway.routing.isolation import CacheSalter, tenant_scope
from gateway.types import InferenceRequest

if TYPE_CHECKING:
    from gateway.dispatch.backends import BackendState


@dataclass(frozen=True, slots=True)
class EngineMatch:
    """What one engine holds of a request's prompt, in its own blocks."""

    held: int
    """Leading blocks of the prompt the engine holds (prefix caching reuses a chain from its start)."""
    blocks: int
    """The prompt's full blocks."""


MISMATCH_EVIDENCE = 16
"""Answers reusing blocks the index never matched before a backend's hashing is judged wrong."""


class EngineView(Protocol):
    """What the prefix router asks of the engines' reports (``PrefixAffinityRouter``)."""

    def held(self, state: BackendState, request: InferenceRequest, tenant: Tenant) -> EngineMatch | None:
        """What ``state``'s engine holds of ``request``'s prompt; None: the engine's word is not
        available for it (no live feed, no hashing, a request it cannot hash): use the estimate."""
        ...

    def heard(self, backend: str, report: CacheReport) -> None:
        """An answer of ``backend`` routed on its engine's word said what it reused (``report``)."""
        ...


@dataclass(frozen=True, slots=True)
class _Hashing:
    hasher: EngineBlockHasher
    setting: KvHashing
    salted: bool


def engine_hashing(setting: KvHashing) -> EngineHashing:
    return EngineHashing(
        algorithm=HashAlgorithm(setting.algorithm),
        seed=setting.seed,
        block_size=setting.block_size,
        int_hashes=setting.int_hashes,
    )


class KvEngineView:
    """The ``EngineView`` over the gateway's KV-event indexes (see the module docstring).

    Long-lived, as the feeds and their indexes are: ``adopt`` takes each policy's backends, model
    tokenizers and cache salter, at start and at every reload."""

    def __init__(
        self,
        indexes: KvBlockIndexes,
        live: Callable[[str], bool],
        on_mismatch: Callable[[str, bool], None] | None = None,
    ) -> None:
        self._indexes = indexes
        self._live = live
        self._on_mismatch = on_mismatch or _ignore
        """Told ``(backend, True)`` when its hashing is judged wrong, ``(backend, False)`` when a
        reload gives it another (the metric and the log line are the caller's)."""
        self._hashing: dict[str, _Hashing] = {}
        self._matched: set[str] = set()
        """Backends whose index matched a request's block at least once under their hashing."""
        self._unmatched_reuse: dict[str, int] = {}
        self._mismatched: set[str] = set()
        self._tokenizers: Mapping[str, EngineTokenizer] = {}
        self._salter: CacheSalter | None = None

    def adopt(
        self, backends: Iterable[Backend], tokenizers: Mapping[str, EngineTokenizer], salter: CacheSalter
    ) -> None:
        """The hashing of each backend with ``kv_events.hashing``, each model's tokenizer, the salter."""
        hashing: dict[str, _Hashing] = {}
        for backend in backends:
            events = backend.kv_events
            if events is None or events.hashing is None:
                continue
            known = self._hashing.get(backend.name)
            if known is not None and known.setting == events.hashing:
                hasher = known.hasher
            else:
                hasher = EngineBlockHasher(engine_hashing(events.hashing))
                self._judge_again(backend.name)
            hashing[backend.name] = _Hashing(hasher, events.hashing, engine(backend.kind).salted)
        for gone in set(self._hashing) - set(hashing):
            self._judge_again(gone)
        self._hashing = hashing
        self._tokenizers = tokenizers
        self._salter = salter

    def routes_on_events(self, backend: str) -> bool:
        """Whether ``backend`` is read here now (a hashing setting judged right, and a live feed)."""
        return backend in self._hashing and backend not in self._mismatched and self._live(backend)

    def held(self, state: BackendState, request: InferenceRequest, tenant: Tenant) -> EngineMatch | None:
        name = state.name
        hashing = self._hashing.get(name)
        if hashing is None or name in self._mismatched or not self._live(name):
            return None
        hashes = self._hashes(request, tenant, hashing)
        if hashes is None:
            return None
        held = self._indexes.match(name, hashes)
        if held:
            self._matched.add(name)
        return EngineMatch(held, len(hashes))

    def heard(self, backend: str, report: CacheReport) -> None:
        """Evidence on ``backend``'s hashing (module docstring): an answer reusing two blocks or more
        of a prompt its index matched none of, on a backend whose index never matched anything."""
        hashing = self._hashing.get(backend)
        if hashing is None or backend in self._matched or backend in self._mismatched:
            return
        if report.predicted_tokens or report.cached_tokens < 2 * hashing.setting.block_size:
            return
        seen = self._unmatched_reuse[backend] = self._unmatched_reuse.get(backend, 0) + 1
        if seen >= MISMATCH_EVIDENCE:
            self._mismatched.add(backend)
            self._on_mismatch(backend, True)

    def mismatched(self, backend: str) -> bool:
        """Whether ``backend``'s hashing was judged not to be its engine's (it routes on the estimate)."""
        return backend in self._mismatched

    def _judge_again(self, backend: str) -> None:
        """A new hashing setting (or none): the evidence against the old one goes with it."""
        self._matched.discard(backend)
        self._unmatched_reuse.pop(backend, None)
        if backend in self._mismatched:
            self._mismatched.discard(backend)
            self._on_mismatch(backend, False)

    def _hashes(self, request: InferenceRequest, tenant: Tenant, hashing: _Hashing) -> Sequence[BlockHash] | None:
        salt = self._salter.salt(tenant_scope(tenant)) if hashing.salted and self._salter is not None else None
        memo = request.engine_keys
        if memo is None:
            memo = request.engine_keys = {}
        key = (hashing.setting, salt)
        if key in memo:
            hashes: Sequence[BlockHash] | None = memo[key]
            return hashes
        ids = self._token_ids(request, memo)
        hashes = None if ids is None else hashing.hasher.block_hashes(ids, cache_salt=salt)
        memo[key] = hashes
        return hashes

    def _token_ids(self, request: InferenceRequest, memo: dict[object, object]) -> list[int] | None:
        if "ids" in memo:
            ids = memo["ids"]
            return ids if isinstance(ids, list) else None
        tokenizer = self._tokenizers.get(request.model)
        ids = None if tokenizer is None else engine_prompt_ids(request.body, request.api.name, tokenizer)
        memo["ids"] = ids
        return ids


def _ignore(backend: str, mismatched: bool) -> None:
    pass
