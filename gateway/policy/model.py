"""Typed model of a policy file (``policies/*.yaml``).

A policy declares the backends, the models they serve, the tenants and their keys, the
priority classes with their SLOs, and the request limits. Unknown keys are rejected and
every number is range-checked here, so that a typo fails at load time and never silently
falls back to a default at request time. Cross-references (a tenant naming a model that no
backend serves, ...) are checked in ``loader.py``, which knows the file's name.

Example::

    version: demo-1
    classes:
      interactive: {rank: 0, slo: {ttft_ms: 500, itl_ms: 30, e2e_ms: 30000}}
      batch:       {rank: 1, slo: {ttft_ms: 5000, itl_ms: 100, e2e_ms: 300000}}
    models:
      - name: meta-llama/Llama-3.1-8B-Instruct
        max_prompt_tokens: 8192
        max_output_tokens: 2048
    backends:
      - {name: h100-a, url: "http://127.0.0.1:8001", kind: vllm, models: [meta-llama/Llama-3.1-8B-Instruct]}
    tenants:
      - name: acme
        key_hashes: ["sha256:<64 hex digits>"]
        models: ["*"]
        default_class: interactive
        limits: {rpm: 600, tpm: 2000000, max_concurrent: 32}

A model may choose its routing strategy (``routing``, see ``Routing``); tenants may opt into
a named shared prefix-cache scope declared under ``cache_scopes`` (see ``CacheScope``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Literal
from urllib.parse import unquote

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from gateway.policy.body_names import TENSOR_PART_TYPES, owned_field_reason
from gateway.policy.groups import ModelGroup
from gateway.policy.media_allowlist import MediaUrlRefused, parse_allowlist_entry

KEY_HASH_PATTERN = re.compile(r"^sha256:[0-9a-f]{64}$")
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}$"

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Name = Annotated[str, Field(pattern=NAME_PATTERN)]
EnvName = Annotated[str, Field(pattern=r"^[A-Z_][A-Z0-9_]*$")]
Weight = Annotated[float, Field(ge=0, le=1000)]


def check_key_hashes(hashes: list[str]) -> list[str]:
    """Keys are stored as ``sha256:<hex>`` digests only; anything else is refused at load."""
    for value in hashes:
        if not KEY_HASH_PATTERN.match(value):
            raise ValueError(
                "must be 'sha256:' followed by 64 lowercase hex digits "
                "(make one with `inference-gateway keys hash`); never a raw key"
            )
    return hashes


class Strict(BaseModel):
    """Base for every policy section: frozen, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class BackendKind(StrEnum):
    """What speaks behind a backend URL; decides which request fields it understands."""

    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"
    OPENAI = "openai"
    SIM = "sim"


class OverLimit(StrEnum):
    """What to do with a ``max_tokens`` above the model's cap."""

    REJECT = "reject"
    CLAMP = "clamp"


class MediaTokens(Strict):
    """Tokens charged to the prompt estimate for each non-text content part, by part type.

    The gateway cannot see an image's or a clip's size in tokens without the model's processor,
    so each part costs a fixed, conservative amount: an image about what a 1024x1024 image costs
    the common vision models (OpenAI's high detail 765, Qwen2-VL about 1,300, Llama 3.2 Vision
    about 1,600); audio about 40 s at Whisper-style encoders' 25 tokens a second; a video or a
    file (a PDF's pages) several images. Raise them for models that spend more.
    """

    image_url: Annotated[int, Field(ge=0)] = 1024
    input_audio: Annotated[int, Field(ge=0)] = 1024
    video_url: Annotated[int, Field(ge=0)] = 4096
    file: Annotated[int, Field(ge=0)] = 4096


class RequestLimits(Strict):
    """Limits applied while a request is read and parsed, before any backend sees it.

    The structural bounds (``max_json_containers``, ``max_json_keys``, ``max_content_parts``,
    ``max_tools``) bound the CPU one request can cost before it is refused: they are checked
    before the steps whose cost grows with them (parsing, the prompt estimate), see
    ``gateway/request/json_bounds.py``. A generous legitimate chat body (512 messages with a few parts
    each, 128 tools with their schemas) holds well under 16,384 objects and arrays, and as many keys.
    """

    max_body_bytes: PositiveInt = 1_048_576
    max_json_depth: PositiveInt = 32
    max_messages: PositiveInt = 512
    max_n: PositiveInt = 8
    max_tokens_over_limit: OverLimit = OverLimit.REJECT
    max_json_containers: PositiveInt = 16_384
    max_json_keys: PositiveInt = 16_384
    """Object keys in the whole body (a chat of 512 messages with tool schemas has a few thousand)."""
    max_json_values: PositiveInt | None = None
    """Array elements and object members in the whole body. Unset: the largest ``max_prompt_tokens``
    of the policy's models plus ``max_json_keys`` and ``max_json_containers`` (a prompt as token
    ids is the longest list a request may hold, and one longer than the cap is refused anyway).
    Each value costs an object to parse and to write back for the duplicate-key check: a body of
    460,000 numbers cost 2.3x the CPU of a text body of its size before its list was refused."""
    max_content_parts: PositiveInt = 256
    """Content parts of one message (text, images, ...)."""
    max_tools: PositiveInt = 128
    """Tools (functions) one request may declare; OpenAI's own limit."""
    max_stop_sequences: PositiveInt = 16
    """Stop strings one request may give (``stop``, Messages' ``stop_sequences``, llama.cpp's
    ``dry_sequence_breakers``). The engine looks for every one in the output at every decoding
    step, so their number costs every step of the batch, whatever the token limits say; OpenAI
    takes 4, real clients send a handful. Over it: 400 ``too_many_items``."""
    max_stop_chars: PositiveInt = 256
    """Characters in one stop string or banned word (``bad_words``): each step searches the
    output's tail as long as the longest one. Over it: 400 ``invalid_field`` naming the string."""
    max_bad_words: PositiveInt = 128
    """Banned words (vLLM's ``bad_words``): each is two token sequences the engine compares with
    the output's tail at every step, one by one. A profanity list fits; 20,000 words slowed
    every request on the engine. Over it: 400 ``too_many_items``."""
    max_logit_bias: PositiveInt = 300
    """Entries of ``logit_bias``: the engine rebuilds its bias tables from every running
    request's entries whenever its batch changes. Enough to ban or force a few hundred tokens
    (a word list, a label set). Over it: 400 ``too_many_items``."""
    max_logprobs: Annotated[int, Field(ge=0, le=1000)] = 20
    """The most log-probabilities per token a request may ask for (``top_logprobs``,
    completions' ``logprobs``, ``prompt_logprobs``, llama.cpp's ``n_probs``): OpenAI's range and
    vLLM's default ``--max-logprobs``; vLLM's ``-1`` (the whole vocabulary) is refused. Raise it
    with the engine's own flag."""
    max_list_items: PositiveInt = 1024
    """Entries of every other list or map a request may carry whose size no token bound limits:
    ``stop_token_ids``, ``allowed_token_ids``, ``guided_choice`` and ``structured_outputs.choice``,
    ``include``, a structural tag's structures and triggers. Over it: 400 ``too_many_items``
    naming the field."""
    media_tokens: MediaTokens = MediaTokens()
    extra_body_fields: frozenset[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]] = frozenset()
    """Body fields clients may send beyond the default allowlist (``gateway/request/body_fields.py``),
    e.g. ``[mm_processor_kwargs, documents]``; a field the gateway owns is refused here."""
    media_url_allowlist: tuple[str, ...] = ()
    """URL prefixes an engine may fetch media from (``gateway/request/media.py``), e.g.
    ``["https://cdn.example.com/images/"]``; ``data:`` URLs are always accepted, nothing else is."""

    @field_validator("extra_body_fields")
    @classmethod
    def _never_owned(cls, names: frozenset[str]) -> frozenset[str]:
        for name in sorted(names):
            reason = owned_field_reason(name)
            if reason is not None:
                raise ValueError(f"{name!r} is set by the gateway and can never come from a client: {reason}")
        return names

    @field_validator("media_url_allowlist")
    @classmethod
    def _media_prefixes(cls, entries: tuple[str, ...]) -> tuple[str, ...]:
        for entry in entries:
            try:
                parse_allowlist_entry(entry)
            except MediaUrlRefused as why:
                raise ValueError(f"{entry!r}: {why}") from None
        return entries


class Slo(Strict):
    """Latency objectives of a priority class, in milliseconds, and the share of requests that
    must meet all of them (``objective``; its complement is the burn-rate alerts' error budget)."""

    ttft_ms: PositiveFloat
    itl_ms: PositiveFloat
    e2e_ms: PositiveFloat
    objective: Annotated[float, Field(gt=0, lt=1)] = 0.99


class QueuePolicy(Strict):
    """Bounds of one class's queue (per model): how many may wait, and for how long.

    ``max_wait_s`` defaults to the class's TTFT objective less what the backends currently take
    from dispatch to first token (measured): a request that cannot get its first token within
    its objective would miss its SLO anyway, so it is refused at once (and retried elsewhere or
    later) rather than served late and counted against goodput.
    """

    max_depth: Annotated[int, Field(ge=0)] = 256
    max_wait_s: PositiveFloat | None = None


class PriorityClass(Strict):
    """A priority class; a lower ``rank`` is served first (interactive 0, batch 1).

    ``max_share`` caps the share of every backend's capacity (requests and tokens) that
    requests of this class may hold at once, so that batch work always leaves room for an
    interactive arrival. ``deadline_s`` is the end-to-end deadline when the client sends no
    ``x-request-timeout``.
    """

    rank: Annotated[int, Field(ge=0, le=100)]
    slo: Slo
    queue: QueuePolicy = QueuePolicy()
    max_share: Annotated[float, Field(gt=0, le=1)] = 1.0
    deadline_s: PositiveFloat = 600.0
    max_prefilling: PositiveInt | None = None
    """At most this many requests of the class per backend still waiting for their first token.

    Prefill is compute-bound and an engine step runs it together with every decode: a burst of
    long batch prefills stretches the steps that interactive requests wait on. Pacing the
    class's prefills keeps those steps short; decodes, which cost little, are not limited.
    A paced class also yields: none of its prefills starts on a backend while a request of
    a higher class is prefilling there."""


class PrefixIndexPolicy(Strict):
    """Bounds of the per-backend index of recently served prefix blocks.

    ``max_blocks`` per backend defaults to the backend's ``capacity.kv_cache_tokens`` (else its
    ``max_tokens_in_flight``) divided by the routing ``block_tokens``; an entry older than
    ``ttl_s`` no longer counts as cached. ``closed_loop`` (on by default) corrects the index from
    the engines' answers: when an engine reports fewer cached tokens than the index predicted, it
    evicted what it was sent no later than the missing block, and the index forgets that too
    (``gateway/dispatch/cache_report.py``); off, the index is the gateway's belief alone (to
    measure what the loop is worth: ``python -m loadtests.proofs.routing_bench --truth``).
    """

    max_blocks: PositiveInt | None = None
    ttl_s: PositiveFloat = 600.0
    closed_loop: bool = True


class Routing(Strict):
    """How a model's requests choose among its backends with room (``gateway/routing/``).

    Usage::

        routing:
          strategy: prefix_affinity     # or round_robin, least_load, session_affinity
          weights: {prefix-affinity-scorer: 3, in-flight-scorer: 1, queue-depth-scorer: 1, kv-usage-scorer: 0.5}
          block_tokens: 64              # prefix block size, in (estimated) tokens
          epsilon: 0.25                 # bounded load: nobody above (1 + epsilon) x the average
          tokenizer: estimate           # or words: real token ids of a word tokenizer
          index: {ttl_s: 600}

    ``weights`` name scorers of the registry (``gateway/routing/registry.py``); a scorer left out
    does not run. Weights apply to the scored strategies (``prefix_affinity``).
    """

    strategy: Name = "prefix_affinity"
    weights: dict[Name, Weight] | None = None
    block_tokens: Annotated[int, Field(ge=4, le=4096)] = 64
    epsilon: Annotated[float, Field(ge=0, le=10)] = 0.25
    tokenizer: Literal["estimate", "words"] = "estimate"
    index: PrefixIndexPolicy = PrefixIndexPolicy()

    @field_validator("weights")
    @classmethod
    def _some_weight(cls, weights: dict[str, float] | None) -> dict[str, float] | None:
        if weights is not None and not any(w > 0 for w in weights.values()):
            raise ValueError("at least one weight must be greater than 0")
        return weights


class TokenizerPolicy(Strict):
    """The model's own Hugging Face ``tokenizer.json``, read from a local file (nothing is downloaded),
    so that prompt-token limits and TPM reservations count real tokens, not the character estimate.
    A relative ``path`` is read from the policy file's folder; a file that cannot be read or parsed
    refuses the policy (``gateway/request/estimators.py``).

    Usage in a policy file::

        models:
          - name: meta-llama/Llama-3.1-8B-Instruct
            tokenizer: {path: tokenizers/llama-3.1.json}
    """

    path: Annotated[str, Field(min_length=1)]
    chat_template: Annotated[str, Field(min_length=1)] | None = None
    """The model's chat template (a Jinja file, or the model's ``tokenizer_config.json``), read from a
    local file as ``path`` is. Needed to route chat requests on an engine's KV events: the gateway
    computes the engine's block hashes from the token ids the engine sees, template included
    (``gateway/routing/engine_view.py``); without it chat requests route on the estimate."""


class ModelPolicy(Strict):
    """A model clients may ask for, with its per-request limits and its routing."""

    name: Name
    max_prompt_tokens: PositiveInt = 32_768
    max_output_tokens: PositiveInt = 4_096
    default_max_tokens: PositiveInt | None = None
    upstream_name: Name | None = None
    routing: Routing = Routing()
    tokenizer: TokenizerPolicy | None = None
    """Count this model's prompts with its own tokenizer (``TokenizerPolicy``); else the character estimate."""


EngineField = Literal["max_concurrent", "kv_cache_tokens"]
"""A capacity figure an engine may give of itself (``Capacity.from_engine``)."""
ENGINE_FIELDS: tuple[EngineField, ...] = ("max_concurrent", "kv_cache_tokens")
AUTO = "auto"
_UNREAD: Mapping[str, int | None] = {"max_concurrent": 0, "kv_cache_tokens": None}
"""What an ``auto`` field holds until the engine's figure is read: no room for any reader."""


class Capacity(Strict):
    """What one backend may hold at once: requests, and tokens (prompt plus ``max_tokens``).

    Usage in a policy file::

        capacity: {max_concurrent: 32, max_tokens_in_flight: 400000, kv_cache_tokens: 262144}
        capacity: {max_concurrent: 32, kv_cache_tokens: auto}     # vLLM: its KV cache from the engine
        capacity: auto                                           # llama.cpp, SGLang: both from the engine
        capacity: {max_concurrent: auto, kv_cache_tokens: auto, max_waiting: 2}

    **From the engine** (``auto``): ``max_concurrent`` and ``kv_cache_tokens`` may each be ``auto``,
    the engine's own figure (``gateway/dispatch/engine_limits.py``: llama.cpp's ``/props``,
    SGLang's ``/server_info``, vLLM's ``vllm:cache_config_info``), read at start, at every reload
    and again on the health rounds until read (backing off). ``capacity: auto`` is short for both,
    every other field at its default; written per field, the others stay settable. Until every
    ``auto`` figure is read the backend takes no request (``GET /admin/backends`` says it is not
    ready), and a replica of a fleet offers the ledger no capacity for it: never a guessed figure.
    Each replica reads the engine itself and reports what it read, as it would a declared figure.
    A kind that does not publish a figure is refused ``auto`` for it at load, naming the backend and
    the field (vLLM and the simulator do not publish ``--max-num-seqs``; an OpenAI-compatible server
    publishes nothing): a fall-back would be a guess, which ``auto`` is there to remove.
    In memory, an ``auto`` field is listed in ``from_engine`` and holds 0 (``max_concurrent``) or
    None (``kv_cache_tokens``) until read, so that every reader of the capacity sees no room;
    ``with_engine`` fills them in, and a dump writes ``auto`` back.

    The scraped saturation signals tighten it at run time: no new request is dispatched to a
    backend whose engine has more than ``max_waiting`` requests waiting in its own queue (vLLM's and
    SGLang's waiting requests, llama.cpp's deferred ones), whatever the room here, nor, unless the
    gateway has nothing in flight there, to one whose KV cache is fuller than ``max_kv_usage``. The
    default ``max_waiting: 0`` holds dispatch while the engine queues anything of its own: a request
    queued inside an engine is out of the gateway's sight (its class, deadline and fair share no
    longer apply), so it waits in the gateway's queue instead. A larger figure opts out, e.g. for an
    engine whose step budget (``--max-num-batched-tokens``) often leaves a request waiting one step.
    """

    from_engine: frozenset[EngineField] = Field(default=frozenset(), exclude=True)
    """The fields whose figure is the engine's (written ``auto``); set from the file, never written."""
    max_concurrent: Annotated[int, Field(ge=0)] = 256
    max_tokens_in_flight: PositiveInt = 1_000_000
    max_waiting: Annotated[int, Field(ge=0)] = 0
    max_kv_usage: Annotated[float, Field(gt=0, le=1)] = 0.97
    kv_cache_tokens: PositiveInt | None = None
    """The engine's KV-cache size in tokens (vLLM logs it at start); sizes the routing prefix index."""

    @model_validator(mode="before")
    @classmethod
    def _auto(cls, data: object) -> object:
        """``auto``, whole or per field, into ``from_engine`` and the not-yet-read placeholders."""
        if data == AUTO:
            data = dict.fromkeys(ENGINE_FIELDS, AUTO)
        if not isinstance(data, Mapping):
            return data
        if "from_engine" in data:
            raise ValueError("from_engine: unknown key (write max_concurrent: auto or kv_cache_tokens: auto)")
        auto = frozenset(field for field in ENGINE_FIELDS if data.get(field) == AUTO)
        return {**data, **{field: _UNREAD[field] for field in auto}, "from_engine": auto} if auto else data

    @field_validator("max_concurrent")
    @classmethod
    def _positive(cls, value: int, info: ValidationInfo) -> int:
        if value == 0 and "max_concurrent" not in info.data.get("from_engine", ()):
            raise ValueError("must be greater than 0, or auto (the engine's own figure)")
        return value

    @model_serializer(mode="wrap")
    def _written(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        """As the file wrote it: ``auto`` in the engine's fields, read or not."""
        written: dict[str, object] = handler(self)
        return {**written, **dict.fromkeys(self.from_engine, AUTO)}

    @property
    def awaiting_engine(self) -> tuple[EngineField, ...]:
        """The ``auto`` fields whose figure is not read from the engine yet (empty: none)."""
        return tuple(f for f in ENGINE_FIELDS if f in self.from_engine and getattr(self, f) == _UNREAD[f])

    def with_engine(self, max_concurrent: int | None, kv_cache_tokens: int | None) -> Capacity:
        """This capacity with the engine's figures in its ``auto`` fields (a None leaves one unread)."""
        figures = {"max_concurrent": max_concurrent, "kv_cache_tokens": kv_cache_tokens}
        update: dict[str, int | None] = {f: figures[f] for f in self.from_engine if figures[f] is not None}
        return self.model_copy(update=update) if update else self

    @property
    def as_written(self) -> Capacity:
        """This capacity as the policy has it: every ``auto`` field not read."""
        update: dict[str, int | None] = {field: _UNREAD[field] for field in self.from_engine}
        return self.model_copy(update=update) if update else self


class Timeouts(Strict):
    """Per-phase upstream timeouts in seconds; none is a total, so long streams live."""

    connect_s: PositiveFloat = 2.0
    first_byte_s: PositiveFloat = 60.0
    between_chunks_s: PositiveFloat = 30.0


class KvHashing(Strict):
    """How an engine computes its prefix-cache block hashes, so the gateway can compute the same ones.

    vLLM: ``algorithm`` is its ``--prefix-caching-hash-algo`` (default ``sha256``, vLLM's own
    default, over Python's pickle; ``sha256_cbor`` is the one that does not depend on the engine's
    Python, and what llm-d's precise scorer requires), ``seed`` the engine's ``PYTHONHASHSEED``
    (without it vLLM draws a random seed at start and no one else can compute its hashes),
    ``block_size`` its ``--block-size``, ``int_hashes`` whether it runs with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (events then carry the low 64 bits).

    Usage in a policy file::

        kv_events:
          endpoint: tcp://10.0.0.5:5557
          hashing: {algorithm: sha256_cbor, seed: "0", block_size: 16}
    """

    algorithm: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] = "sha256"
    seed: Annotated[str, Field(min_length=1)]
    block_size: PositiveInt = 16
    int_hashes: bool = False


class KvEvents(Strict):
    """Where a backend's engine publishes its KV-cache events (vLLM's ``--kv-events-config``,
    ``publisher: zmq``; ``inference-gateway sim --kv-events``).

    ``kv_events: {endpoint: "tcp://10.0.0.5:5557", replay_endpoint: "tcp://10.0.0.5:5558"}``:
    ``endpoint`` is the engine's PUB socket, ``replay_endpoint`` its replay ROUTER (unset: a gap
    in the batches cannot be replayed, the index is emptied instead), ``topic`` the engine's
    ``topic`` ("" is vLLM's default and takes every message), ``silence_s`` the longest the
    gateway trusts the engine's index without hearing from it (vLLM publishes only when blocks
    change, so an idle engine is silent too). Read by ``gateway/dispatch/kv_feeds.py``.
    """

    endpoint: Annotated[str, Field(pattern=r"^(tcp|ipc|inproc)://\S+$")]
    replay_endpoint: Annotated[str, Field(pattern=r"^(tcp|ipc|inproc)://\S+$")] | None = None
    topic: str = ""
    silence_s: PositiveFloat = 30.0
    hashing: KvHashing | None = None
    """How the engine hashes its blocks; set, and with the model's ``tokenizer`` (and ``chat_template``
    for chat), the gateway routes on the engine's own index (``gateway/routing/engine_view.py``).
    Unset: the feed is read (metrics, ``/admin/backends``) but routing keeps the estimate."""


class Backend(Strict):
    """One OpenAI-compatible server (a vLLM engine, an SGLang server, ...)."""

    name: Name
    url: Annotated[str, Field(pattern=r"^https?://[^\s/]+(:\d+)?(/[^\s]*)?$")]
    """Base URL of the server, with or without a trailing ``/v1`` (the gateway adds ``/v1/...``)."""
    kind: BackendKind
    models: Annotated[list[Name], Field(min_length=1)]
    capacity: Capacity = Capacity()
    credential_env: EnvName | None = None
    timeouts: Timeouts = Timeouts()
    engine_priority: bool = False
    """Pass the class on as the request's ``priority`` (vLLM needs ``--scheduling-policy priority``)."""
    price_per_gpu_hour: Annotated[float, Field(ge=0)] | None = None
    """What one of its GPUs costs an hour (dollars); unset: the backend costs nothing (``telemetry/cost.py``)."""
    gpus: PositiveInt = 1
    """GPUs the backend holds (tensor parallel, ...): it costs ``price_per_gpu_hour × gpus`` an hour."""
    tenants: Annotated[list[Name], Field(min_length=1)] | None = None
    """Serve only these tenants (names under ``tenants``); unset: every tenant allowed its models.

    Dedicated capacity for any kind, and how tenants of different cache scopes are kept apart on
    engines that cannot salt their prefix cache (``CacheIsolation.unsalted``)."""
    kv_events: KvEvents | None = None
    """Subscribe to the engine's KV-cache events (``KvEvents``); unset: no feed."""

    @field_validator("url")
    @classmethod
    def _strip_slash(cls, url: str) -> str:
        return url.rstrip("/").removesuffix("/v1")


class TenantLimits(Strict):
    """Per-tenant limits (the admission issue enforces them)."""

    rpm: PositiveInt | None = None
    tpm: PositiveInt | None = None
    max_concurrent: PositiveInt | None = None


class Tenant(Strict):
    """A client organisation: its key hashes, what it may use, its default class."""

    name: Name
    key_hashes: Annotated[list[str], Field(min_length=1)]
    models: Annotated[list[str], Field(min_length=1)]
    default_class: Name
    limits: TenantLimits = TenantLimits()
    weight: PositiveFloat = 1.0
    cache_scope: Name | None = None
    """Opt into a shared prefix-cache scope declared under ``cache_scopes``; else private."""
    allow_costlier_fallback: bool = True
    """False: a model group's fallback never sends this tenant's requests to a target that costs
    more than the one chosen first (its backends' ``price_per_gpu_hour × gpus``, averaged)."""
    allow_builtin_tools: frozenset[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,63}$")]] = frozenset()
    """Tool types beyond functions this tenant may declare, by their exact ``type``: the Responses
    API's built-in tools (``web_search_preview``, ``mcp``, ``code_interpreter``, ...) and
    Anthropic's server tools (``web_search_20250305``, ``bash_20250124``, ...). An engine started
    with a tool server runs them for the tenant (browses, runs code, calls an MCP server), so by
    default only ``function`` tools (Messages: custom tools) pass and any other is 400
    ``tool_type_not_allowed``. An ``mcp`` tool's ``server_url`` must still be https to a public
    host (``gateway/request/media.py``). Usage: ``allow_builtin_tools: [web_search_preview]``."""
    allow_content_parts: frozenset[str] = frozenset()
    """Content-part types that hand the engine raw tensors which this tenant may send
    (``image_embeds``, ``audio_embeds``, ``prompt_embeds``: ``body_names.TENSOR_PART_TYPES``).
    A tensor of the wrong shape can crash the engine (vLLM enables them for trusted users only),
    so they are 400 ``content_part_not_allowed`` unless listed. Usage: ``allow_content_parts: [image_embeds]``."""

    @field_validator("key_hashes")
    @classmethod
    def _hashes_not_keys(cls, hashes: list[str]) -> list[str]:
        return check_key_hashes(hashes)

    @field_validator("allow_content_parts")
    @classmethod
    def _tensor_parts_only(cls, names: frozenset[str]) -> frozenset[str]:
        unknown = sorted(names - TENSOR_PART_TYPES.keys())
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a part type to opt into: one of {sorted(TENSOR_PART_TYPES)}")
        return names


class HealthChecks(Strict):
    """Active health checks of every backend's /health."""

    interval_s: PositiveFloat = 5.0
    timeout_s: PositiveFloat = 2.0


class Scrape(Strict):
    """Scrapes of every backend's /metrics for its saturation signals (0 disables)."""

    interval_s: Annotated[float, Field(ge=0)] = 1.0
    timeout_s: PositiveFloat = 1.0

    @property
    def fresh_s(self) -> float:
        """How long scraped signals count as current: three intervals, at least one second
        (one missed scrape must not make a saturated backend look idle)."""
        return max(3 * self.interval_s, 1.0)


class CacheScope(Strict):
    """A named prefix-cache scope that tenants may opt into (``tenants[i].cache_scope``).

    Every tenant's prompts are hashed (routing keys) and salted (the engine's ``cache_salt``)
    with its own name, so no tenant's cached blocks ever serve another. Tenants that name the
    same scope share one seed and one salt instead: a prompt one of them sent warms the cache
    for all of them (a public system prompt, say), and each can time whether the others sent
    a given text. That is why sharing is opt-in, per tenant, and nothing else is shared.
    """

    description: Annotated[str, Field(max_length=200)] = ""


class UnsaltedMode(StrEnum):
    """How tenants are kept apart on backends whose engine has no ``cache_salt`` (llama.cpp, openai).

    ``shared``: they are not; the policy loads with a warning naming each such backend and the
    tenants of different cache scopes that reach it. ``no_prompt_cache``: every request to a
    llama.cpp backend carries ``cache_prompt: false`` (no reuse, so nothing to time); refused at
    load while an ``openai`` backend, which has no such switch, is shared. ``dedicated``: refused
    at load unless each such backend is reached by tenants of one cache scope only (``tenants:``).
    """

    SHARED = "shared"
    NO_PROMPT_CACHE = "no_prompt_cache"
    DEDICATED = "dedicated"


class CacheIsolation(Strict):
    """Where the secret that keys every ``cache_salt`` comes from (HMAC-SHA256 of the scope), and
    how backends that cannot be salted are isolated (``unsalted``, see ``UnsaltedMode``).

    Replicas that share the secret share engine caches; without it each process draws a
    random secret (and logs a warning).

    Usage::

        cache_isolation: {secret_env: GATEWAY_CACHE_SALT_SECRET, unsalted: dedicated}
    """

    secret_env: EnvName = "GATEWAY_CACHE_SALT_SECRET"
    unsalted: UnsaltedMode = UnsaltedMode.SHARED


RETRYABLE_STATUSES = frozenset({429, 502, 503})


class RetryPolicy(Strict):
    """How a failed attempt is retried (see the module docstring).

    Usage in a policy file::

        retry: {max_retries: 2, backoff_base_s: 0.025, backoff_cap_s: 0.25,
                retryable_statuses: [429, 502, 503],
                budget_ratio: 0.2, budget_min_per_s: 3, budget_window_s: 10,
                migrate_streams: true}

    ``migrate_streams`` continues a stream whose backend died on another backend
    (``gateway/pipeline/migration.py``); a migration is a retry: same budget, same attempt bound.
    """

    max_retries: Annotated[int, Field(ge=0, le=10)] = 2
    backoff_base_s: PositiveFloat = 0.025
    backoff_cap_s: PositiveFloat = 0.25
    retryable_statuses: frozenset[int] = RETRYABLE_STATUSES
    budget_ratio: Annotated[float, Field(ge=0, le=1)] = 0.2
    budget_min_per_s: Annotated[float, Field(ge=0)] = 3.0
    budget_window_s: PositiveFloat = 10.0
    migrate_streams: bool = True

    @field_validator("retryable_statuses")
    @classmethod
    def _no_client_errors(cls, statuses: frozenset[int]) -> frozenset[int]:
        for status in sorted(statuses):
            if status != 429 and not 500 <= status <= 599:
                raise ValueError(f"{status}: only 429 and 5xx statuses may be retried")
        return statuses


class BreakerPolicy(Strict):
    """Thresholds of every backend's breaker (see the module docstring for the rule).

    Usage in a policy file::

        breaker: {consecutive_failures: 5, failure_ratio: 0.5, min_requests: 20, window_s: 10,
                  open_s: 30, max_open_s: 300, open_growth: 2, half_open_probes: 1}
    """

    consecutive_failures: PositiveInt | None = 5
    failure_ratio: Annotated[float, Field(gt=0, le=1)] | None = 0.5
    min_requests: PositiveInt = 20
    window_s: PositiveFloat = 10.0
    open_s: PositiveFloat = 30.0
    max_open_s: PositiveFloat = 300.0
    open_growth: Annotated[float, Field(ge=1, le=10)] = 2.0
    half_open_probes: PositiveInt = 1
    probe_timeout_s: PositiveFloat = 60.0

    @model_validator(mode="after")
    def _cap_above_base(self) -> BreakerPolicy:
        if self.max_open_s < self.open_s:
            raise ValueError("max_open_s must not be less than open_s")
        return self


class Admin(Strict):
    """Who may call ``/admin/*`` (reload, policy in force): SHA-256 hashes of admin keys.

    With no key the admin endpoints answer 403; tenants' keys never open them."""

    key_hashes: list[str] = []

    @field_validator("key_hashes")
    @classmethod
    def _hashes_not_keys(cls, hashes: list[str]) -> list[str]:
        return check_key_hashes(hashes)


class Lifecycle(Strict):
    """Drain and reload: how long SIGTERM waits for requests in flight, how often the file is polled."""

    drain_timeout_s: PositiveFloat = 30.0
    watch_interval_s: Annotated[float, Field(ge=0)] = 1.0


class TracingConfig(Strict):
    """OpenTelemetry traces (``gateway/telemetry/tracing.py``): whether, how many, and where to.

    ``endpoint`` is the OTLP/HTTP traces URL (``http://collector:4318/v1/traces``); when None
    the exporter reads ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``.
    A policy without ``telemetry.tracing`` takes the standard ``OTEL_*`` variables
    (``from_env``). ``headers`` go with every export (a collector's credentials: name an
    environment variable's value there through ``OTEL_EXPORTER_OTLP_HEADERS`` rather than
    writing a secret into the policy). ``capture_content`` records prompts and completions:
    off unless opted in.
    """

    enabled: bool = False
    sampling_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0
    endpoint: str | None = None
    headers: dict[str, str] = {}
    service_name: str = "inference-gateway"
    capture_content: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TracingConfig:
        """The standard variables: on when an OTLP endpoint is set and the SDK is not disabled."""
        env = os.environ if env is None else env
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        generic = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        disabled = env.get("OTEL_SDK_DISABLED", "").lower() == "true" or env.get("OTEL_TRACES_EXPORTER") == "none"
        ratio = env.get("OTEL_TRACES_SAMPLER_ARG")
        headers = env.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or env.get("OTEL_EXPORTER_OTLP_HEADERS") or ""
        return cls(
            enabled=bool(endpoint or generic) and not disabled,
            sampling_ratio=float(ratio) if ratio else 1.0,
            endpoint=endpoint or (generic.rstrip("/") + "/v1/traces" if generic else None),
            headers=_otlp_headers(headers),
            service_name=env.get("OTEL_SERVICE_NAME", "inference-gateway"),
        )


def _otlp_headers(text: str) -> dict[str, str]:
    """``OTEL_EXPORTER_OTLP_HEADERS``: ``key1=value1,key2=value2``, values URL-encoded."""
    pairs = (item.split("=", 1) for item in text.split(",") if "=" in item)
    return {unquote(k.strip()).lower(): unquote(v.strip()) for k, v in pairs}


class Telemetry(Strict):
    """Label bounds: tenants beyond the ``top_tenants`` busiest are counted as ``other``.

    Cost is charged per accounting interval of ``cost_interval_s`` seconds (``gateway/telemetry/cost.py``):
    a few times the typical E2E, so that a request rarely straddles two intervals."""

    top_tenants: Annotated[int, Field(ge=0, le=1000)] = 50
    cost_interval_s: Annotated[float, Field(gt=0, le=3600)] = 15.0
    tracing: TracingConfig | None = None
    """None: configured by the standard ``OTEL_*`` environment variables."""


class FleetPolicy(Strict):
    """How processes and replicas share each backend's capacity (``gateway/fleet/``).

    Usage in a policy file (it applies when ``state.backend`` is ``redis``)::

        fleet: {sync_interval_s: 0.05, lease_ttl_s: 2, timeout_ms: 200, outage_s: 30,
                prefix_view: true, prefix_flush_s: 0.05, prefix_history: 10000}

    Every ``sync_interval_s`` (and at once when a request must wait for lack of this process's
    part) a process tells the ledger what it uses, what waits and what part it enforces, and
    learns what it may hold (``gateway/fleet/ledger.py`` states the rule). A sync slower than
    ``timeout_ms`` fails. A process whose syncs fail keeps starting requests within its last
    part for its lease (``entry_ttl_s``: three sync intervals less than ``lease_ttl_s``) and
    ``outage_s`` more, measured from when it sent its last successful sync; then it starts
    nothing until a sync succeeds (Redis lost for longer than ``outage_s`` stops the fleet:
    no process can know what the others use). The ledger counts a silent process as still
    holding its part for as long as it may be using it: its lease, ``outage_s``, then the
    longest class ``deadline_s`` for its last requests to end (``Policy.fleet_drain_s``; a
    client's ``x-request-timeout`` may only shorten a deadline). A process known dead is dropped
    at once (one on the same host sees it gone; a graceful exit leaves the ledger). A process
    that has never reached the ledger holds nothing, unless ``processes_when_unknown`` says how
    many processes at most ever run without it: then it takes an equal share among them (safe
    only if that bound holds).

    With ``prefix_view`` (read at start-up), every process also publishes its routing decisions
    every ``prefix_flush_s`` and folds in the others', so that prefix-affinity routing on one
    replica sees what the others sent where (``gateway/fleet/prefix_sync.py``).
    """

    sync_interval_s: Annotated[float, Field(ge=0.005, le=5)] = 0.05
    lease_ttl_s: Annotated[float, Field(gt=0, le=600)] = 2.0
    timeout_ms: Annotated[float, Field(gt=0, le=5000)] = 200.0
    outage_s: Annotated[float, Field(ge=0, le=3600)] = 30.0
    """How long past its lease a process cut off from the ledger keeps starting requests within
    its last part. Longer: more tolerance of a Redis outage; but the part of a process that
    crashed on another host stays counted that much longer (plus the longest deadline)."""
    processes_when_unknown: Annotated[int, Field(ge=1, le=10_000)] | None = None
    """Unset: a process that never reached the ledger holds nothing (the invariant cannot be
    kept otherwise). Set: such a process takes ``1/processes_when_unknown`` of every backend."""
    prefix_view: bool = True
    """Share routing decisions (tenant-scoped block hashes and the backend chosen) so that every
    process's prefix index sees where the fleet sent each prefix (``gateway/fleet/prefix_sync.py``)."""
    prefix_flush_s: Annotated[float, Field(ge=0.001, le=5)] = 0.05
    """How often a process publishes its batch of decisions (one stream entry) and reads the
    others' (one round trip for both)."""
    cell: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{0,32}$")] = ""
    """The cell this replica is in: replicas of one cell share its ledger and prefix view (keys
    under its own hash tag, ``{fleet:<cell>}``), and should front engines of their own. Unset: the
    one unnamed cell. A ledger's cost grows with the square of its replicas (every sync reads every
    replica's entry), so past about 20 replicas at 2,000 req/s each, split the fleet into cells
    and map each tenant to one cell at the load balancer (its cache entries are its own, so it
    loses no prefix reuse); tenant limits stay fleet-wide. Read at start-up (``deploy/README.md``,
    "Redis for many replicas")."""
    prefix_history: Annotated[int, Field(ge=100, le=10_000_000)] = 10_000
    """Stream entries kept, about: what a new process catches up on (those of the last index TTL
    among them). An entry is one process's flush: its decisions times their prompt blocks times
    8 bytes, e.g. 1,000 requests/s over 3 replicas of 4k-token prompts (64 blocks) is 150
    entries/s of about 3.5 KB, so 10,000 entries are about a minute of history and 35 MB of
    Redis memory."""

    @property
    def entry_ttl_s(self) -> float:
        """How long a process's ledger entry outlives its last sync (the class docstring says why)."""
        return self.lease_ttl_s - 3 * self.sync_interval_s

    @model_validator(mode="after")
    def _lease_outlives_syncs(self) -> FleetPolicy:
        if self.lease_ttl_s < 6 * self.sync_interval_s:
            raise ValueError("lease_ttl_s must be at least 6 x sync_interval_s (leases are renewed at every sync)")
        return self


class StatePolicy(Strict):
    """Where tenant limits (rpm, tpm, concurrency) live (``gateway/limitstore/``).

    Usage in a policy file::

        state: {backend: redis, redis_url: "redis://redis:6379/0", key_prefix: "gw:", timeout_ms: 50,
                request_budget_ms: 20}

    ``memory`` (the default) keeps them in the process: right for one replica. ``redis`` shares
    them between replicas; the environment variable named by ``url_env`` replaces ``redis_url``
    when set (use it, from a Secret, when the URL carries a password), and one of the two is
    required. When Redis is unreachable or slower than ``timeout_ms``, every replica enforces
    the limits on its own until Redis answers again, as ``on_store_loss`` says
    (``gateway/limitstore/redis.py``). Each process spends leases of a tenant's budget taken
    from Redis in batches (``gateway/limitstore/lease.py``), so most requests wait on Redis
    not at all. ``request_budget_ms`` is what one request may wait on Redis in all (an
    admission whose lease is short asks at once): past it the request is answered
    from the in-process limits and Redis counts as down until a background ping answers within
    half of it, so a slow Redis costs one request this budget, not every request a round trip.
    Both count only the time the process's event loop was free to read Redis's answer: a
    process that is merely busy never takes Redis for lost (``gateway/shared/lag.py``).
    A Redis in the same zone answers a script in well under a millisecond; 20 ms leaves room
    for a busy one.
    A replica renews its leases every ``ping_interval_s``; a dead replica's slots are freed,
    and its tokens counted spent, ``lease_ttl_s`` after its last renewal. Read at start-up only: a reload that
    changes this section is logged and takes effect at the next restart.
    """

    backend: Literal["memory", "redis"] = "memory"
    redis_url: Annotated[str, Field(pattern=r"^(rediss?(\+sentinel|\+cluster)?|unix)://\S+$")] | None = None
    url_env: EnvName = "GATEWAY_REDIS_URL"
    key_prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9._:/-]{0,64}$")] = "gw:"
    timeout_ms: Annotated[float, Field(gt=0, le=5000)] = 50.0
    request_budget_ms: Annotated[float, Field(gt=0, le=5000)] = 20.0
    ping_interval_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    lease_ttl_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    on_store_loss: Literal["share", "open", "closed"] = "share"
    """What each process enforces while Redis is lost (``gateway/limitstore/outage.py``):

    * ``share`` (the default): its share of every tenant limit, the limit divided by the live
      gateway processes the fleet last counted (``fleet.processes_when_unknown`` when it never
      counted them; unset, a limited tenant is refused as with ``closed``). It starts from its
      share of each bucket's last level seen in Redis, not a full bucket, and what it admitted
      is charged to Redis when Redis is back: a tenant gets about its limit across an outage.
      A share below one request (a limit smaller than the processes) admits nothing.
    * ``open``: the whole limit in every process (up to N processes x the limit), as before.
    * ``closed``: a limited tenant's requests are refused (503 ``limits_unavailable``, with
      Retry-After) until Redis is back; tenants without limits are served as always.

    E.g. ``state: {backend: redis, on_store_loss: open}`` for availability before accuracy."""

    @model_validator(mode="after")
    def _leases_outlive_renewals(self) -> StatePolicy:
        if self.lease_ttl_s < 3 * self.ping_interval_s:
            raise ValueError("lease_ttl_s must be at least 3 x ping_interval_s (leases are renewed at every ping)")
        return self

    def resolved_url(self, env: Mapping[str, str] | None = None) -> str | None:
        """The Redis URL in force: the ``url_env`` variable when set, else ``redis_url``."""
        return (os.environ if env is None else env).get(self.url_env) or self.redis_url


class Policy(Strict):
    """The whole policy file."""

    version: Annotated[str, Field(min_length=1, max_length=64)]
    limits: RequestLimits = RequestLimits()
    classes: Annotated[dict[Name, PriorityClass], Field(min_length=1)]
    models: Annotated[list[ModelPolicy], Field(min_length=1)]
    model_groups: list[ModelGroup] = []
    """Public model names mapped onto the served models above (``gateway/policy/groups.py``)."""
    backends: Annotated[list[Backend], Field(min_length=1)]
    tenants: Annotated[list[Tenant], Field(min_length=1)]
    health_checks: HealthChecks = HealthChecks()
    scrape: Scrape = Scrape()
    cache_scopes: dict[Name, CacheScope] = {}
    cache_isolation: CacheIsolation = CacheIsolation()
    admin: Admin = Admin()
    lifecycle: Lifecycle = Lifecycle()
    retry: RetryPolicy = RetryPolicy()
    breaker: BreakerPolicy = BreakerPolicy()
    telemetry: Telemetry = Telemetry()
    state: StatePolicy = StatePolicy()
    fleet: FleetPolicy = FleetPolicy()
    kind: Literal["gateway-policy"] = "gateway-policy"

    @property
    def fleet_drain_s(self) -> float:
        """How long past its lease the ledger counts a silent process's part: it may start
        requests for ``fleet.outage_s``, and none outlives the longest class deadline."""
        return self.fleet.outage_s + max(c.deadline_s for c in self.classes.values())
