"""The ``Dialect`` protocol: everything the request path knows about one API, in one object.

The gateway serves several APIs (``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``, ``/v1/responses``, ``/v1/messages`` and the engines' small endpoints), and each differs in the same
handful of places: the body fields it takes, where its prompt is and how big it is, which field
bounds its output, what its stream's chunks look like and where usage is in them, and whether
a broken stream can be continued. Each API is one module of ``gateway/dialects/`` with one
object implementing this protocol, registered by path in ``gateway/dialects/registry.py``;
the request path asks the request's dialect (``InferenceRequest.api``) and never tests which
API it is. Adding an API is one module, one registration line, and its samples for the
conformance suite (``tests/dialects/``).

**Roles.** ``Dialect`` is the union of the roles the stages read, each a smaller protocol here, so
that a function that needs one role can take that role alone and say in its signature what it
reads of an API (every dialect is all of them). About in the order a request meets them:

* ``ApiIdentity`` (``name``, ``path``, ``operation``): the routes and each backend's URL
  (``gateway/app.py``, ``gateway/upstream/client.py``), the ``api`` label of the metrics
  (``gateway/pipeline/recorder.py``), the request's span (``gateway/telemetry/tracing.py``), dispatch's 404 for an
  API no backend of the model serves. Declared in telemetry (``gateway/telemetry/api_identity.py``),
  below this stage, since traces read it;
* ``BodyRules`` (``fields``, ``screen``, ``stream_flags``, ``output_aliases``, ``prompt_field``,
  ``prompt_tokens``, ``render``, ``output_field``, ``stream_usage_fields``): the body. The
  handler screens it (``gateway/pipeline/handler.py``: what a client may send, with the tenant's opt-ins,
  ``allowlists.EngineGrants``), validation reads its flags, output bound and prompt size
  (``gateway/admission/build.py``), routing hashes its canonical prompt
  (``gateway/routing/prefix_keys.py``), and each attempt sets the bound in the one field its
  backend's kind obeys and asks the engine for usage in a stream (``gateway/request/output_length.py``,
  ``gateway/upstream/body.py``). Output length, a stage below this one, takes only the two members
  it reads (``output_aliases``, ``output_field``) as its own ``OutputBound``, which every
  ``BodyRules`` is (mypy checks it where ``upstream/body.py`` hands it the request's dialect);
* ``Translating`` (``serves``, ``translation``): which backends can answer it, and how; read by
  dispatch (``Dispatcher``: ``serves``) and each attempt's isolation
  (``upstream_body.attempt_isolation``: ``translation``);
* ``StreamFormat`` (``sse_event_names``, ``ends_with_done``, ``read_chunk``, ``error_event``): a
  stream's events, read by the relay (``gateway/pipeline/relay.py``: each event's output, usage and
  finish reasons, its framing and end, an error as a stream reports one) and a shadow's reader
  (``gateway/shadow/runner.py``);
* ``AnswerFormat`` (``is_answer``, ``answer_usage``, ``error_body``): a whole answer's shape and
  usage, read by the upstream client (``gateway/upstream/client.py``) and the attempt
  (``gateway/pipeline/attempt.py``), and the API's error answer, by the error responses
  (``gateway/pipeline/client_response.py``, ``gateway/app.py``);
* ``AnswerState`` (``keeps_state``, ``answer_id``, ``previous_id``): answers the engine keeps and
  later requests name, read by the handler and the attempt (``gateway/responses/affinity.py``);
* ``Continuation`` (``can_continue``, ``continue_body``): a broken stream continued elsewhere,
  read by migration (``gateway/pipeline/migration.py``).

Most members are the same on most APIs: the OpenAI APIs' values are written once, in
``gateway/dialects/defaults.py`` (``OpenAIDialect``, and ``WholeAnswerOnly`` for the APIs that
generate nothing), and each dialect class states only what differs.

Rules every dialect keeps (``tests/dialects/test_dialect_conformance.py`` checks them on each
registered dialect): no owned field (``body_fields.OWNED_FIELDS``) is in ``fields``; a body
refused anywhere gets an ``InvalidRequest`` naming its field; the estimate counts everything
the engine turns into prompt tokens and at least one token per CJK character; equal prompts
render to equal text and a conversation's next turn renders to an extension of the previous
one; usage is reported in the gateway's shape (``prompt_tokens``, ``completion_tokens``,
optionally ``total_tokens`` and ``prompt_tokens_details``), whatever the API calls it.

Members are read on the hot path (every request, every stream event): plain attributes of a
module-level instance (a shared function is the class attribute itself, a ``staticmethod``),
and a reading that allocates nothing for the common token event.

**APIs that name their events, keep state, or are translated.** Responses and Messages streams
name their events (``sse_event_names``: the relay keeps the ``event:`` line) and end without
``[DONE]`` (``ends_with_done``); Responses answers live on the engine that made them
(``keeps_state``, ``answer_id``, ``previous_id``: ``gateway/responses/affinity.py``); Messages is
answered natively where that weakens no guarantee and through chat completions elsewhere
(``translation``: a ``Translation`` turns the body, the answer and each stream event). Each
API's errors keep its own shape (``error_body``, ``error_event``), and an API only some kinds of
engine serve says which (``serves``: ``/tokenize``, ``/v1/score``).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import orjson

from gateway.dialects.allowlists import EngineGrants
from gateway.errors import GatewayError
from gateway.policy.model import Backend, BackendKind, ModelPolicy, RequestLimits
from gateway.request.tokens import TokenEstimator
from gateway.telemetry.api_identity import ApiIdentity

ChunkReading = tuple[bool, Mapping[str, Any] | None, tuple[str, ...], bool]
"""What one parsed stream event says, as the relay needs it (``Dialect.read_chunk``):
``(output, usage, finish_reasons, usage_only)``.

``output``: it carries generated output (text, reasoning, a tool call), so its arrival times
TTFT and the inter-token gaps; a role-only or usage-only event does not. ``usage``: the usage
totals it reports, in the gateway's shape (None when none); the last one of a stream is the
stream's. ``finish_reasons``: one per choice that finished in it. ``usage_only``: the event
exists only to carry usage (dropped when the client did not ask for usage,
``InferenceRequest.client_wants_usage``).

A plain tuple, not a ``NamedTuple``: it is built for every event of every stream, and a named
tuple costs five times as much to build (220 ns against 45 ns); the relay unpacks it."""

MESSAGE_START = "\x1e"
"""Starts each message (or turn) of a rendered prompt: ``ChainMemo`` (``gateway/routing/prefix_keys.py``)
looks up a prompt's prefixes ending at these, so a dialect that renders a conversation marks its turns."""
FIELD_SEPARATOR = "\x1f"
"""Separates a rendered message's role from its content, and its content from its tool calls."""


def render_conversation(tools: Any, turns: Iterable[tuple[object, str]]) -> str:
    """A conversation's canonical text (``Dialect.render``): the tools as sorted JSON, then each
    turn as ``MESSAGE_START<role>FIELD_SEPARATOR<text>``."""
    out = [orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode()] if tools else []
    out.extend(f"{MESSAGE_START}{role}{FIELD_SEPARATOR}{text}" for role, text in turns)
    return "".join(out)


NO_OUTPUT: ChunkReading = (False, None, (), False)
"""An event with nothing the relay times or counts (a role chunk, a keep-alive payload)."""
OUTPUT: ChunkReading = (True, None, (), False)
"""The common event: output and nothing else (shared, so that reading it allocates nothing)."""


class StreamTranslator(Protocol):
    """One stream of another API turned into the client's events (``Translation.stream``)."""

    def event(self, chunk: dict[str, Any]) -> bytes:
        """The client's events (SSE-framed, possibly none) for one parsed upstream event."""
        ...

    def end(self) -> bytes:
        """The client's closing events once the upstream stream completed."""
        ...


class Translation(Protocol):
    """How a request of one API is answered through another API a backend serves (Messages
    through chat completions, ``gateway/dialects/messages_chat.py``). The request is validated,
    estimated, routed and counted as the client's API; each attempt to such a backend sends
    ``request_body``'s body to ``upstream``'s path and translates what comes back."""

    @property
    def upstream(self) -> Dialect:
        """The API the backend is called with; it reads the upstream answer and stream events."""
        ...

    def request_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The upstream API's body for a validated client body (a new object)."""
        ...

    def answer(self, document: dict[str, Any]) -> dict[str, Any]:
        """The client's whole answer for the upstream API's whole answer."""
        ...

    def stream(self) -> StreamTranslator:
        """A translator for one stream (it holds that stream's state)."""
        ...


class BodyRules(Protocol):
    """What a body of the API may hold and what the gateway reads from it and sets in it (module
    docstring: the handler's screen, validation, prefix keys, each attempt's body)."""

    @property
    def fields(self) -> frozenset[str]:
        """The body fields a client may send (beyond them: the policy's ``limits.extra_body_fields``).

        Never an owned field (``body_fields.OWNED_FIELDS``); includes ``model``, ``prompt_field``
        and every output alias."""
        ...

    def screen(self, body: dict[str, Any], limits: RequestLimits, grants: EngineGrants) -> bool:
        """Refuse what ``body`` may not carry, drop what the gateway owns; True when a field was dropped.

        First check of the body, before the model is looked up: unknown fields (400
        ``unsupported_field``, ``body_fields.screen_fields``), the engine features no token bound
        limits (``engine_fields.check_engine_fields``), then the nested objects this API gives
        their own rules (``stream_options``, template switches, content-part types and tool types
        beyond what the tenant's ``grants`` allow (``allowlists.py``), media URLs). Raises
        ``InvalidRequest``."""
        ...

    def stream_flags(self, body: dict[str, Any]) -> tuple[bool, bool]:
        """``(stream, client wants usage in the stream)`` from ``body``; raises ``InvalidRequest``
        for a malformed flag or a stream the API cannot give."""
        ...

    @property
    def output_aliases(self) -> tuple[str, ...]:
        """Every field a client may name the output bound with (read once, all must agree,
        ``output_length.requested_output_length``); empty when the API generates nothing
        (the request's ``max_tokens`` is then 0)."""
        ...

    @property
    def prompt_field(self) -> str:
        """The field that holds the prompt (``param`` of a ``prompt_too_long`` error)."""
        ...

    def prompt_tokens(
        self, body: dict[str, Any], model: ModelPolicy, limits: RequestLimits, estimator: TokenEstimator
    ) -> int:
        """Check the prompt's structure, then estimate its tokens.

        Structure first and cheapest first: counts bounded by ``limits`` (messages, parts, tools,
        list lengths, by ``len`` only; a list longer than ``model.max_prompt_tokens`` is refused
        as ``prompt_too_long`` before it is read), then the estimate, which reads every text.
        The estimate counts what the engine turns into prompt tokens (text, tool definitions,
        media parts at the policy's charge) and at least one token per CJK character."""
        ...

    def render(self, body: dict[str, Any]) -> str | array[int]:
        """The canonical prompt of a validated body, hashed into prefix keys
        (``gateway/routing/prefix_keys.py``): equal prompts give equal text, a conversation's
        next turn gives an extension of the previous turn's, each message starting with
        ``MESSAGE_START``; token ids as an ``array('I')``."""
        ...

    def output_field(self, kind: BackendKind) -> str | None:
        """The one output-bound field a backend of ``kind`` obeys on this API (one of
        ``output_aliases``); None exactly when ``output_aliases`` is empty."""
        ...

    def stream_usage_fields(self, body: dict[str, Any], per_chunk: bool) -> Mapping[str, Any]:
        """Body fields an attempt sets so that the engine reports usage at the end of a stream
        (and in every chunk when ``per_chunk``, for migration); empty when it needs none."""
        ...


class Translating(Protocol):
    """Which backends answer the API, and whether natively or through another API (module docstring)."""

    def serves(self, kind: BackendKind) -> bool:
        """Whether a backend of ``kind`` can answer this API (natively or translated): routing offers a
        request only the backends that can (``Dispatcher.acquire`` skips the others)."""
        ...

    def translation(self, backend: Backend, multi_scope: bool) -> Translation | None:
        """How a backend answers this API: None, natively (its request passed through), else the
        ``Translation`` to use. ``multi_scope``: tenants of several cache scopes reach the
        backend (``PolicySnapshot.multi_scope_backends``), so its requests must carry their salt."""
        ...


class StreamFormat(Protocol):
    """What the API's stream events look like (module docstring: the relay reads them)."""

    @property
    def sse_event_names(self) -> bool:
        """Whether its streams name their events (SSE ``event:`` lines) and clients dispatch on the
        names (Responses, Messages): the relay keeps an event's name with its data."""
        ...

    @property
    def ends_with_done(self) -> bool:
        """Whether its streams end with ``data: [DONE]`` (the OpenAI choice-chunk APIs); otherwise a
        stream is complete once an event reported a finish reason (``response.completed``)."""
        ...

    def read_chunk(self, chunk: dict[str, Any]) -> ChunkReading:
        """What a parsed stream event of this API says (``ChunkReading``). Called for every
        event of every stream: return ``OUTPUT`` or ``NO_OUTPUT`` when they say it all."""
        ...

    def error_event(self, error: GatewayError) -> bytes:
        """The gateway's error as this API's stream reports one (then the relay's ``[DONE]``):
        OpenAI's choice-chunk APIs ``data: {"error": {...}}``, as vLLM ends a failed stream."""
        ...


class AnswerFormat(Protocol):
    """What a whole answer of the API looks like, and its error answer (module docstring)."""

    def is_answer(self, answer: dict[str, Any]) -> bool:
        """Whether a whole (non-streamed) 200 JSON object is an answer of this API; when it is
        not, the backend failed (``upstream_errors.answer_error``)."""
        ...

    def answer_usage(self, answer: dict[str, Any]) -> Mapping[str, Any] | None:
        """The usage of a whole (non-streamed) answer, in the gateway's shape; None if it has none."""
        ...

    def error_body(self, error: GatewayError) -> bytes:
        """The gateway's error as this API's whole error answer (the status is the error's): the
        OpenAI shape ``{"error": {...}}`` (``GatewayError.body``), or Anthropic's for Messages."""
        ...


class AnswerState(Protocol):
    """Whether the engine keeps the API's answers for later requests to name (module docstring)."""

    @property
    def keeps_state(self) -> bool:
        """Whether its answers are kept by the engine and named by later requests (Responses'
        ``previous_response_id``): the gateway remembers where each lives (``gateway/responses/affinity.py``)."""
        ...

    def answer_id(self, document: dict[str, Any]) -> str | None:
        """The id a later request may name an answer by, from a whole answer or a stream event
        (None when this one does not carry it, or the API keeps no state)."""
        ...

    def previous_id(self, body: dict[str, Any]) -> str | None:
        """The earlier answer a validated body continues (``previous_response_id``), if any;
        raises ``InvalidRequest`` when it is not a string."""
        ...


class Continuation(Protocol):
    """Whether and how a broken stream of the API is continued elsewhere (``gateway/pipeline/migration.py``)."""

    def can_continue(self, body: dict[str, Any]) -> bool:
        """Whether a broken stream of this validated body could be continued from its partial output.

        True only for APIs whose engines can continue a partial answer exactly and whose streams
        are OpenAI choice chunks (the relay tracks and splices those, ``gateway/pipeline/relay.py``)."""
        ...

    def continue_body(self, body: dict[str, Any], partial: str) -> None:
        """Edit ``body`` (the caller's copy) into the request that continues after ``partial``.

        Only called when ``can_continue(body)``; the result is a valid body of the same API whose
        rendered prompt extends the original's (it routes to where the original's prefix is)."""
        ...


class Dialect(ApiIdentity, BodyRules, Translating, StreamFormat, AnswerFormat, AnswerState, Continuation, Protocol):
    """One API the gateway serves: every role (module docstring); implementations are module-level
    singletons, on the defaults of ``gateway/dialects/defaults.py``."""
