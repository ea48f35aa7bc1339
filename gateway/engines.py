"""One record per engine kind: everything the gateway does differently for a vLLM, an SGLang, a
llama.cpp, an OpenAI-compatible server or the simulator (``BackendKind``).

Why one table: what a kind can do used to be spread over a dozen sets and dicts in as many
modules, each of which answered "no" for a kind it did not list, so a kind added to the enum
and forgotten in one of them silently lost a capability, or, for ``cache_salt``, its tenants'
cache isolation. Here every kind has a record (``ENGINES``), every record names every
capability (the dataclass has no defaults), and a kind without a record is an error at import
(``_check_complete``) and a ``KeyError`` at lookup (``engine``), never a quiet "no".

Who reads what (each field's docstring says it again):

==========================  ==============================================================
field                       read by
==========================  ==============================================================
``chat_output_field``,      ``CHAT.output_field``, ``COMPLETIONS.output_field``
``completions_output_…``    (``gateway/dialects/``), applied per attempt by ``output_length``
``salted``,                 ``isolation_fields``, ``isolates`` (``gateway/routing/isolation.py``)
``prompt_cache_switch``
``continuable``             ``can_continue`` (``gateway/pipeline/migration.py``)
``priority_sign``           ``engine_priority`` (``gateway/upstream/body.py``)
``serves_*``                each dialect's ``serves`` (``gateway/dialects/``)
``native_messages``         ``MESSAGES.translation`` (``gateway/dialects/messages.py``)
``metrics``                 ``gateway/dispatch/scrape.py`` (the union over every kind, see there)
==========================  ==============================================================

What does not vary by kind stays with its API: the Responses bound (``max_output_tokens``), the
Messages bound (``max_tokens``), none for embeddings and the tokenizer, rerank and score APIs.

Pure data: this module imports nothing of the gateway but ``BackendKind``, so every stage may
read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from gateway.policy.model import BackendKind


@dataclass(frozen=True, slots=True)
class ScrapedMetrics:
    """The Prometheus names of an engine's saturation signals on its ``/metrics`` page
    (``gateway/dispatch/scrape.py``: waiting and running are summed over label sets, KV usage is the
    maximum, the counters detect a restart). Empty tuples: the engine exposes none the scraper reads."""

    waiting: tuple[str, ...]
    """Requests waiting in the engine's scheduler."""
    running: tuple[str, ...]
    """Requests the engine is running."""
    kv_usage: tuple[str, ...]
    """The KV cache's fill, 0 to 1 (several names: one per engine release that renamed it)."""
    counters: tuple[str, ...]
    """Work counters that only grow within one process (prompt and generated tokens, finished
    requests): one going backwards means the engine restarted."""


NO_METRICS = ScrapedMetrics(waiting=(), running=(), kv_usage=(), counters=())
"""An engine whose ``/metrics`` page has none of the names the scraper reads."""

VLLM_METRICS = ScrapedMetrics(
    waiting=("vllm:num_requests_waiting",),
    running=("vllm:num_requests_running",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # the latter before v0.10
    counters=("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total"),
)
SGLANG_METRICS = ScrapedMetrics(
    waiting=("sglang:num_queue_reqs",),
    running=("sglang:num_running_reqs",),
    kv_usage=("sglang:token_usage",),
    counters=("sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:num_requests_total"),
)
LLAMACPP_METRICS = ScrapedMetrics(
    waiting=("llamacpp:requests_deferred",),  # tasks deferred for want of a free slot
    running=("llamacpp:requests_processing",),  # slots processing a task
    kv_usage=(),  # none since llamacpp:kv_cache_usage_ratio was dropped from the server
    counters=("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total"),
)
"""llama.cpp's server under ``--metrics`` (``tools/server``: gauges and counters, no labels)."""


@dataclass(frozen=True, slots=True)
class EngineKind:
    """What one kind of engine understands, and so what the gateway sends it (module docstring).

    Every field is required: a new kind states each capability, there is no default to forget."""

    kind: BackendKind
    """The kind this record describes (``ENGINES[kind].kind is kind``)."""

    chat_output_field: str
    """The one field the engine obeys as the output bound on ``/v1/chat/completions``; each
    attempt's body carries the request's bound in it and no other alias. Read by
    ``CHAT.output_field`` (``gateway/dialects/chat.py``), applied by ``output_length_edits``
    (``gateway/request/output_length.py``, whose docstring says why each engine gets the field it does)."""
    completions_output_field: str
    """The same on ``/v1/completions``: ``COMPLETIONS.output_field`` (``gateway/dialects/completions.py``)."""

    salted: bool
    """Security: whether the engine keys its prefix cache by ``cache_salt`` on chat and completions
    requests, which keeps tenants of different cache scopes from reusing (and timing) each other's
    cached blocks. True: every request carries its scope's salt (``isolation_fields``), and the
    backend isolates by itself (``isolates``, ``gateway/routing/isolation.py``); False: isolation
    rests on ``cache_isolation.unsalted`` and routing, checked at load (``check_isolation``).
    vLLM >= 0.9 and the simulator read it; so does SGLang (its OpenAI protocol takes ``cache_salt``
    and keys the radix cache with it; releases before sgl-project/sglang#23300 accepted the field
    without passing it to the scheduler, and an external KV store such as LMCache does not key by
    it: run a release with the fix, and no shared external cache tier across tenants). SGLang keys
    its cache by ``cache_salt`` followed by the client's own ``extra_key``; the salt's fixed length
    (32 hex digits) keeps two scopes' keys apart whatever ``extra_key`` a client sends."""
    prompt_cache_switch: bool
    """Whether the engine turns prompt reuse off per request: llama.cpp's server reads
    ``cache_prompt`` (default true), and false makes the slot recompute the whole prompt instead of
    reusing its cache. Under ``cache_isolation.unsalted: no_prompt_cache`` an unsalted kind with the
    switch gets ``cache_prompt: false`` and counts as isolating; one without it must be dedicated
    (``isolation_fields``, ``isolates``, the load-time messages of ``gateway/routing/isolation.py``)."""

    continuable: bool
    """Whether a stream that broke on this engine can be continued on another of the same kind:
    the engine knows vLLM's ``continue_final_message`` (with ``add_generation_prompt: false``) and
    reports per-chunk usage (``stream_options.continuous_usage_stats``). Read by ``can_continue``
    (``gateway/pipeline/migration.py``); False: a broken stream ends with the error event."""

    priority_sign: Literal[1, -1]
    """How the class rank becomes the engine's ``priority`` when the backend sets ``engine_priority``:
    ``priority = priority_sign * rank``. vLLM runs lower numbers first (1), SGLang higher ones (-1);
    llama.cpp and OpenAI read no ``priority``, and get the rank as is (1) if a policy asks anyway.
    Read by ``engine_priority`` (``gateway/upstream/body.py``)."""

    serves_chat: bool
    """Whether the engine answers ``/v1/chat/completions``: ``CHAT.serves`` (routing offers a request
    only the backends whose kind serves its API, ``Dispatcher``; a model none of whose backends
    does answers 404 ``api_not_served``). Also ``MESSAGES.serves``: a Messages request may always
    have to be translated to chat (``native_messages``)."""
    serves_completions: bool
    """``/v1/completions``: ``COMPLETIONS.serves`` (``gateway/dialects/completions.py``)."""
    serves_responses: bool
    """``/v1/responses``: ``serves_responses`` in ``gateway/dialects/openai_answers.py``."""
    serves_embeddings: bool
    """``/v1/embeddings``: ``serves_embeddings`` in ``gateway/dialects/openai_answers.py``."""
    native_messages: bool
    """Whether the engine answers Anthropic's ``/v1/messages`` itself. Read by
    ``MESSAGES.translation`` (``gateway/dialects/messages.py``): a Messages request is passed
    through only to such a backend, and only when one cache scope alone reaches it (the engine's
    Messages request drops ``cache_salt``); everywhere else it is translated to chat."""
    serves_tokenizer: bool
    """``/tokenize`` and ``/detokenize`` with vLLM's bodies: ``serves_tokenizer``
    (``gateway/dialects/tokenize.py``, whose docstring says why the others do not)."""
    serves_rerank: bool
    """``/v1/rerank`` in Jina's shape: ``RERANK.serves`` (``gateway/dialects/rerank.py``)."""
    serves_score: bool
    """``/v1/score`` in vLLM's shape: ``SCORE.serves`` (``gateway/dialects/rerank.py``)."""
    serves_count_tokens: bool
    """``/v1/messages/count_tokens``: ``serves_counting`` (``gateway/dialects/count_tokens.py``)."""

    metrics: ScrapedMetrics
    """The saturation names on the engine's ``/metrics`` page. ``gateway/dispatch/scrape.py`` reads the union
    of every kind's names on every backend's page, whatever its kind (names never collide)."""


VLLM = EngineKind(
    kind=BackendKind.VLLM,
    chat_output_field="max_tokens",
    completions_output_field="max_tokens",
    salted=True,
    prompt_cache_switch=False,
    continuable=True,
    priority_sign=1,
    serves_chat=True,
    serves_completions=True,
    serves_responses=True,
    serves_embeddings=True,
    native_messages=True,
    serves_tokenizer=True,
    serves_rerank=True,
    serves_score=True,
    serves_count_tokens=True,
    metrics=VLLM_METRICS,
)
"""vLLM's record; the simulator's is the same but for its kind."""


ENGINES: Mapping[BackendKind, EngineKind] = MappingProxyType(
    {
        BackendKind.VLLM: VLLM,
        BackendKind.SGLANG: EngineKind(
            kind=BackendKind.SGLANG,
            chat_output_field="max_tokens",
            completions_output_field="max_tokens",
            salted=True,
            prompt_cache_switch=False,
            continuable=False,
            priority_sign=-1,
            serves_chat=True,
            serves_completions=True,
            serves_responses=True,
            serves_embeddings=True,
            native_messages=False,
            serves_tokenizer=False,  # under /v1/tokenize, in its own shape
            serves_rerank=False,  # answers a bare JSON array, not an answer object
            serves_score=False,  # takes label_token_ids, answers scores
            serves_count_tokens=False,
            metrics=SGLANG_METRICS,
        ),
        BackendKind.LLAMACPP: EngineKind(
            kind=BackendKind.LLAMACPP,
            chat_output_field="n_predict",
            completions_output_field="n_predict",
            salted=False,
            prompt_cache_switch=True,
            continuable=False,
            priority_sign=1,
            serves_chat=True,
            serves_completions=True,
            serves_responses=True,
            serves_embeddings=True,
            native_messages=False,  # it has one, but whether it honours cache_prompt there is undocumented
            serves_tokenizer=False,  # another body (content, with_pieces) and answer
            serves_rerank=True,  # Jina's shape, under --reranking
            serves_score=False,
            serves_count_tokens=False,
            metrics=LLAMACPP_METRICS,  # under --metrics; without it the page is a 501 and nothing is read
        ),
        BackendKind.OPENAI: EngineKind(
            kind=BackendKind.OPENAI,
            chat_output_field="max_completion_tokens",  # its reasoning models refuse max_tokens
            completions_output_field="max_tokens",
            salted=False,
            prompt_cache_switch=False,
            continuable=False,
            priority_sign=1,
            serves_chat=True,
            serves_completions=True,
            serves_responses=True,
            serves_embeddings=True,
            native_messages=False,
            serves_tokenizer=False,
            serves_rerank=False,
            serves_score=False,
            serves_count_tokens=False,
            metrics=NO_METRICS,
        ),
        BackendKind.SIM: dataclasses.replace(
            VLLM, kind=BackendKind.SIM
        ),  # the simulator (loadtests/sim) answers as vLLM
    }
)
"""Every kind's record; ``engine`` reads it."""


def engine(kind: BackendKind) -> EngineKind:
    """The record of ``kind``; a ``KeyError`` naming this table for a kind without one (never a "no")."""
    try:
        return ENGINES[kind]
    except KeyError:
        raise KeyError(f"backend kind {kind!r} has no record in ENGINES (gateway/engines.py)") from None


def _check_complete(engines: Mapping[BackendKind, EngineKind]) -> None:
    """Refuse, at import, a table that misses a kind or files a record under another kind's name."""
    missing = [kind.value for kind in BackendKind if kind not in engines]
    if missing:
        raise TypeError(f"gateway/engines.py: no record for backend kind(s) {', '.join(missing)}")
    misfiled = [kind.value for kind, record in engines.items() if record.kind is not kind]
    if misfiled:
        raise TypeError(f"gateway/engines.py: the record under {', '.join(misfiled)} describes another kind")


_check_complete(ENGINES)
