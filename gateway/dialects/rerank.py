"""``POST /v1/rerank`` and ``POST /v1/score``: a query scored against documents, as vLLM serves them.

vLLM's ``RerankRequest`` and ``ScoreRequest`` (``vllm/entrypoints/pooling/scoring/protocol.py``):
rerank is Jina's and Cohere's shape, score vLLM's own.

* **Inputs**: each query, document or item is a string, or an object ``{"content": [parts]}``
  (text, image or video parts, for multimodal scorers). Rerank takes one ``query`` and
  ``documents`` (one input or a list) and ``top_n`` (an integer of at least 0; 0 keeps all).
  Score takes two sides under one of the pairs of names vLLM accepts: ``queries`` with
  ``documents`` or ``items``, ``text_1`` with ``text_2``, ``data_1`` with ``data_2``, each side
  one input or a list, paired 1:1, 1:N or N:N (a longer first side must match the second's
  length). Both take vLLM's scoring options (``SCORING_OPTIONS``); ``chat_template_kwargs``
  carries template switches only (``chat.check_template_kwargs``), parts are vLLM's score parts
  (``allowlists.SCORING_PARTS``: text, image, video; ``image_embeds`` for a tenant that opted in)
  and their media URLs must be on the allowlist (``gateway/request/media.py``).
* **Bounds, by length before any text is read**: at most ``limits.max_messages`` documents,
  items or inputs per side (400 ``too_many_messages``), ``max_content_parts`` parts per input.
* **Prompt estimate**: the engine scores each (query, document) pair as one prompt, so every
  text counts once per pair it is in: rerank's query (and ``instruction``) once per document
  plus each document; score's first side once per pair when it is one input (1:N), else each
  input once (N:N); plus ``PAIR_OVERHEAD_TOKENS`` per pair for the separator and special
  tokens. Object inputs count their text parts and their media at the policy's charge. The
  whole estimate is held against the model's prompt cap, as an embeddings list is.
* **Rendering for prefix keys**: the instruction, the query (score: the first side) then every
  document (the second side), each as ``\\x1e<query|document>\\x1f<text>`` (an object input as
  JSON with sorted keys), whatever the fields were called: the same pairs under another
  spelling key the same, and requests that share a query and their first documents share a
  prefix, as the engine's prefix cache does.
* **Served by** (``EngineKind.serves_rerank`` and ``serves_score``, ``gateway/engines.py``):
  rerank, ``vllm``, ``llamacpp`` (Jina's shape under ``--reranking``) and ``sim``; not
  ``sglang``, whose ``/v1/rerank`` answers a bare JSON array of ``{"score", "document",
  "index"}`` that the gateway does not pass as an answer (a whole answer is a JSON object,
  ``Upstream.answer``), nor ``openai``. Score, ``vllm`` and ``sim`` only (SGLang's ``/v1/score``
  takes ``label_token_ids`` and answers ``scores``).
* **Output**: none (``max_tokens`` 0), never streamed, never continued. Answers: rerank
  ``{"id", "model", "usage": {"prompt_tokens", "total_tokens"}, "results": [{"index",
  "document", "relevance_score"}]}``, score ``{"id", "object": "list", "created", "model",
  "data": [{"index", "object": "score", "score"}], "usage"}``; their usage, in the gateway's
  shape, is ``prompt_tokens`` (``total_tokens`` when only that is given, as Jina's) and
  ``completion_tokens`` 0.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any, final

import orjson

from gateway.dialects.allowlists import SCORING_PARTS, EngineGrants, check_parts
from gateway.dialects.base import FIELD_SEPARATOR, MESSAGE_START
from gateway.dialects.chat import check_template_kwargs
from gateway.dialects.counts import at_most
from gateway.dialects.defaults import WholeAnswerOnly, never_streamed
from gateway.engines import engine
from gateway.errors import InvalidRequest
from gateway.policy.model import BackendKind, MediaTokens, ModelPolicy, RequestLimits
from gateway.request.body_fields import screen_fields
from gateway.request.media import check_parts_urls
from gateway.request.tokens import TokenEstimator, parts_tokens

SCORING_OPTIONS = frozenset(
    {
        "model", "user", "truncate_prompt_tokens", "padding", "truncation_side", "use_activation",
        "max_tokens_per_query", "max_tokens_per_doc", "instruction", "chat_template_kwargs", "stream",
    }
)  # fmt: skip
"""vLLM's pooling and scoring options (``PoolingBasicRequestMixin``, ``ClassifyRequestMixin``,
``ScoringRequestMixin``) less the owned ones (``request_id``, ``priority``, ``cache_salt``);
``stream`` only to be refused by name; ``mm_processor_kwargs`` when the policy lists it."""
RERANK_FIELDS = SCORING_OPTIONS | {"query", "documents", "top_n"}
SCORE_PAIRS: Mapping[str, tuple[str, ...]] = {
    "queries": ("documents", "items"),
    "text_1": ("text_2",),
    "data_1": ("data_2",),
}
"""Score's first side by each name vLLM accepts, with the names its second side may have."""
SCORE_SIDES = ("queries", "documents", "items", "text_1", "text_2", "data_1", "data_2")
SCORE_FIELDS = SCORING_OPTIONS | frozenset(SCORE_SIDES)

PAIR_OVERHEAD_TOKENS = 3
"""Special tokens a cross-encoder adds around one pair (``[CLS] q [SEP] d [SEP]``)."""


def _serves_rerank(kind: BackendKind) -> bool:
    return engine(kind).serves_rerank


def _serves_score(kind: BackendKind) -> bool:
    return engine(kind).serves_score


# --- the inputs' structure, media and size ---------------------------------------------------


def score_inputs(value: Any, field: str, limits: RequestLimits, *, many: bool = True) -> list[Any]:
    """``value`` (one input, or a list when ``many``) as a list of inputs, its count and each input's
    shape checked (no text read); raises ``InvalidRequest`` naming the field or the input."""
    if value is None:
        raise InvalidRequest(f"'{field}' is required.", param=field)
    listed = isinstance(value, list)
    if listed and not many:
        raise InvalidRequest(f"'{field}' must be one input: a string or an object with 'content'.", param=field)
    items = value if listed else [value]
    if not items:
        raise InvalidRequest(f"'{field}' must not be empty.", param=field)
    at_most(items, limits.max_messages, field, "inputs", "too_many_messages")
    for i, item in enumerate(items):
        if isinstance(item, str):
            continue
        param = f"{field}[{i}]" if listed else field
        content = item.get("content") if isinstance(item, dict) else None
        if not isinstance(content, list):
            raise InvalidRequest(
                f"'{param}' must be a string or an object whose 'content' is an array of parts.", param=param
            )
        at_most(content, limits.max_content_parts, f"{param}.content", "parts", "too_many_content_parts")
    return items


def check_inputs_parts(value: Any, field: str, grants: EngineGrants) -> None:
    """400 ``content_part_not_allowed`` for the first part of an object input that is not one of
    vLLM's score parts (``allowlists.SCORING_PARTS``: text, image and video; ``image_embeds`` by
    the tenant's opt-in), named by its place in ``field``."""
    listed = isinstance(value, list)
    for i, item in enumerate(value if listed else [value]):
        if isinstance(item, dict) and isinstance(item.get("content"), list):
            where = f"{field}[{i}]" if listed else field
            check_parts(item["content"], f"{where}.content", SCORING_PARTS, grants)


def check_inputs_media(value: Any, field: str, allowlist: tuple[str, ...]) -> None:
    """400 ``media_url_not_allowed`` for the first media URL of an object input that the allowlist
    refuses, named by its place in ``field`` (``documents[2].content[0].image_url.url``)."""
    listed = isinstance(value, list)
    for i, item in enumerate(value if listed else [value]):
        if isinstance(item, dict) and isinstance(item.get("content"), list):
            where = f"{field}[{i}]" if listed else field
            check_parts_urls(item["content"], f"{where}.content", allowlist)


def input_tokens(item: Any, estimator: TokenEstimator, media: MediaTokens) -> int:
    """Tokens of one checked input: its text, or its parts (media at the policy's charge)."""
    if isinstance(item, str):
        return estimator.count(item)
    return parts_tokens(item["content"], estimator, media)


def _instruction_tokens(body: dict[str, Any], estimator: TokenEstimator) -> int:
    instruction = body.get("instruction")
    if instruction is None:
        return 0
    if not isinstance(instruction, str):
        raise InvalidRequest("'instruction' must be a string.", param="instruction")
    return estimator.count(instruction)


def _check_options(body: dict[str, Any]) -> None:
    check_template_kwargs(body.get("chat_template_kwargs"))


# --- rendering and answers -----------------------------------------------------------------


def _input_text(item: Any) -> str:
    return item if isinstance(item, str) else orjson.dumps(item, option=orjson.OPT_SORT_KEYS).decode()


def render_pairs(instruction: Any, queries: Any, documents: Any) -> str:
    """The canonical prompt of scored pairs (module docstring)."""
    parts: list[str] = []
    if isinstance(instruction, str):
        parts += (MESSAGE_START, "instruction", FIELD_SEPARATOR, instruction)
    for role, value in (("query", queries), ("document", documents)):
        for item in value if isinstance(value, list) else (value,):
            parts += (MESSAGE_START, role, FIELD_SEPARATOR, _input_text(item))
    return "".join(parts)


def pooling_usage(answer: dict[str, Any]) -> Mapping[str, Any] | None:
    """A rerank or score answer's usage in the gateway's shape (module docstring)."""
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return None
    total, prompt = usage.get("total_tokens"), usage.get("prompt_tokens")
    if not isinstance(prompt, int):
        prompt = total
    if not isinstance(prompt, int):
        return None
    return {
        "prompt_tokens": prompt,
        "completion_tokens": 0,
        "total_tokens": total if isinstance(total, int) else prompt,
    }


# --- the dialects --------------------------------------------------------------------------


@final
class RerankDialect(WholeAnswerOnly):
    """``POST /v1/rerank`` (module docstring); ``RERANK`` is its one instance."""

    __slots__ = ()

    name = "rerank"
    path = "/v1/rerank"
    operation = "rerank"
    fields = RERANK_FIELDS
    prompt_field = "query"
    serves = staticmethod(_serves_rerank)
    answer_usage = staticmethod(pooling_usage)

    def screen(self, body: dict[str, Any], limits: RequestLimits, grants: EngineGrants) -> bool:
        stripped = screen_fields(RERANK_FIELDS, body, limits)
        _check_options(body)
        for field in ("query", "documents"):
            check_inputs_parts(body.get(field), field, grants)
            check_inputs_media(body.get(field), field, limits.media_url_allowlist)
        return stripped

    def stream_flags(self, body: dict[str, Any]) -> tuple[bool, bool]:
        return never_streamed(body, "Reranking")

    def prompt_tokens(
        self, body: dict[str, Any], model: ModelPolicy, limits: RequestLimits, estimator: TokenEstimator
    ) -> int:
        documents = score_inputs(body.get("documents"), "documents", limits)
        (query,) = score_inputs(body.get("query"), "query", limits, many=False)
        top_n = body.get("top_n")
        if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0):
            raise InvalidRequest("'top_n' must be an integer of at least 0 (0: every document).", param="top_n")
        media = limits.media_tokens
        per_pair = input_tokens(query, estimator, media) + _instruction_tokens(body, estimator) + PAIR_OVERHEAD_TOKENS
        return len(documents) * per_pair + sum(input_tokens(d, estimator, media) for d in documents)

    def render(self, body: dict[str, Any]) -> str | array[int]:
        return render_pairs(body.get("instruction"), body.get("query"), body.get("documents"))

    def is_answer(self, answer: dict[str, Any]) -> bool:
        return isinstance(answer.get("results"), list)


def score_sides(body: dict[str, Any]) -> tuple[str, str]:
    """The names of a score body's two sides (one pair of ``SCORE_PAIRS``); 400 for none, a half, or two."""
    present = [name for name in SCORE_SIDES if body.get(name) is not None]
    first = next((name for name in present if name in SCORE_PAIRS), None)
    if first is None:
        raise InvalidRequest(
            "'queries' and 'documents' (or 'items'; or 'text_1' and 'text_2'; or 'data_1' and 'data_2') are required.",
            param="queries",
        )
    second = next((name for name in present if name in SCORE_PAIRS[first]), None)
    if second is None:
        wanted = SCORE_PAIRS[first][0]
        raise InvalidRequest(f"'{wanted}' is required with '{first}'.", param=wanted)
    stray = next((name for name in present if name not in (first, second)), None)
    if stray is not None:
        raise InvalidRequest(
            f"'{stray}' cannot be sent with '{first}' and '{second}': name the two sides one way.", param=stray
        )
    return first, second


@final
class ScoreDialect(WholeAnswerOnly):
    """``POST /v1/score`` (module docstring); ``SCORE`` is its one instance."""

    __slots__ = ()

    name = "score"
    path = "/v1/score"
    operation = "score"
    fields = SCORE_FIELDS
    prompt_field = "queries"
    serves = staticmethod(_serves_score)
    answer_usage = staticmethod(pooling_usage)

    def screen(self, body: dict[str, Any], limits: RequestLimits, grants: EngineGrants) -> bool:
        stripped = screen_fields(SCORE_FIELDS, body, limits)
        _check_options(body)
        for field in SCORE_SIDES:
            check_inputs_parts(body.get(field), field, grants)
            check_inputs_media(body.get(field), field, limits.media_url_allowlist)
        return stripped

    def stream_flags(self, body: dict[str, Any]) -> tuple[bool, bool]:
        return never_streamed(body, "Scoring")

    def prompt_tokens(
        self, body: dict[str, Any], model: ModelPolicy, limits: RequestLimits, estimator: TokenEstimator
    ) -> int:
        first, second = score_sides(body)
        queries = score_inputs(body[first], first, limits)
        documents = score_inputs(body[second], second, limits)
        if len(queries) > 1 and len(queries) != len(documents):
            raise InvalidRequest(
                f"'{first}' has {len(queries)} inputs and '{second}' {len(documents)}: pair them 1:1, 1:N or N:N.",
                param=second,
            )
        media = limits.media_tokens
        per_pair = _instruction_tokens(body, estimator) + PAIR_OVERHEAD_TOKENS
        if len(queries) == 1:  # 1:N, the query in every pair
            per_pair += input_tokens(queries[0], estimator, media)
            own = 0
        else:
            own = sum(input_tokens(q, estimator, media) for q in queries)
        return len(documents) * per_pair + own + sum(input_tokens(d, estimator, media) for d in documents)

    def render(self, body: dict[str, Any]) -> str | array[int]:
        first, second = score_sides(body)
        return render_pairs(body.get("instruction"), body.get(first), body.get(second))

    def is_answer(self, answer: dict[str, Any]) -> bool:
        return isinstance(answer.get("data"), list)


RERANK = RerankDialect()
SCORE = ScoreDialect()
