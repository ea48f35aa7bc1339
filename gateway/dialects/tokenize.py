"""``POST /tokenize`` and ``POST /detokenize``: the engine's tokenizer, as vLLM serves it.

vLLM serves both at the root (not under ``/v1``): ``vllm/entrypoints/serve/tokenize/protocol.py``,
``TokenizeCompletionRequest | TokenizeChatRequest`` and ``DetokenizeRequest``.

* **Served by** ``vllm`` and ``sim`` backends only (``EngineKind.serves_tokenizer`` in
  ``gateway/engines.py``): llama.cpp's ``/tokenize`` takes another body (``content``,
  ``with_pieces``) and answers another shape (``tokens`` only, or pieces), and its
  ``/detokenize`` answers ``content``; SGLang serves its tokenizer under another path
  (``/v1/tokenize``); OpenAI has none. A model none of whose backends serves them answers 404
  ``api_not_served`` (``Dispatcher``).
* **Tokenize fields**: the completion form, ``prompt`` (one string) with ``add_special_tokens``
  and ``return_token_strs``; or the chat form, ``messages`` with its template fields
  (``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``, ``tools``).
  Exactly one of ``prompt`` and ``messages``; a chat-only field with ``prompt`` is refused (vLLM
  would ignore it silently). ``chat_template`` is refused as on chat (``body_fields``);
  ``mm_processor_kwargs`` and ``media_io_kwargs`` only when the policy lists them
  (``limits.extra_body_fields``). The chat form follows chat's rules: template switches only in
  ``chat_template_kwargs``, chat's content-part types and function tools
  (``gateway/dialects/allowlists.py``, with the tenant's opt-ins), media URLs on the allowlist,
  ``limits.max_messages`` messages, ``max_content_parts`` parts, ``max_tools`` tools, all by
  length before any text is read.
* **Detokenize fields**: ``tokens``, a list of token ids (integers of at least 0), at most
  ``model.max_prompt_tokens`` of them: a longer list is refused as ``prompt_too_long`` before
  an item is read.
* **Prompt estimate**: tokenize, the prompt's text (the chat form: chat's estimate of its
  messages and tools, ``gateway/dialects/chat.py``); detokenize, the number of ids, exactly.
  Either is what the tenant's tokens per minute are charged, though the engine's GPU does no
  work for them: what the engine reads is the measure, as for every API. A prompt longer than
  the model's cap is refused like any other (``prompt_too_long``), even though the engine would
  count it.
* **Rendering for prefix keys**: the text as is (the chat form as chat renders it), the ids as
  their 4-byte array, each behind a marker of its own (``TOKENIZER_KEYS``): nothing is cached by
  these endpoints, so their keys must never match an inference prompt's (the prefix router would
  take a tokenized conversation for a cached one); they only keep equal requests on one backend.
* **Output**: none (``max_tokens`` 0), never streamed (``stream: true`` is refused), never
  continued. The answers: ``{"count", "max_model_len", "tokens", "token_strs"}``, whose usage is
  ``count`` prompt tokens; ``{"prompt"}``, which reports none (the request's reservation, its
  exact id count, is what it is charged).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any, final

from gateway.dialects.allowlists import CHAT_PARTS, CHAT_TOOLS, EngineGrants, check_items_parts, check_tools_allowed
from gateway.dialects.chat import CHAT, CONTENT, check_template_kwargs, render_chat
from gateway.dialects.defaults import WholeAnswerOnly, never_streamed
from gateway.dialects.text_prompt import render_text_prompt
from gateway.engines import engine
from gateway.errors import InvalidRequest
from gateway.policy.model import BackendKind, ModelPolicy, RequestLimits
from gateway.request.body_fields import screen_fields
from gateway.request.field_limits import prompt_too_long
from gateway.request.media import check_media_urls
from gateway.request.tokens import TokenEstimator

TOKENIZER_KEYS = "\x1dtokenizer\x1d"
"""Starts every rendered tokenizer prompt: its prefix keys never match a chat or completions
prompt's, so tokenizing a conversation does not tell the prefix router that a backend caches it
(nothing is cached by these endpoints)."""
TOKENIZER_ID_KEYS = 0xFFFFFFFF
"""The same for a detokenized id list (never a token id): a completions prompt of ids is not matched."""

TOKENIZE_CHAT_ONLY = frozenset(
    {"messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools"}
)
TOKENIZE_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs", "stream"}) | (
    TOKENIZE_CHAT_ONLY
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens", "stream"})


def serves_tokenizer(kind: BackendKind) -> bool:
    """``Dialect.serves`` of ``/tokenize`` and ``/detokenize``: vLLM's bodies (module docstring)."""
    return engine(kind).serves_tokenizer


@final
class TokenizeDialect(WholeAnswerOnly):
    """``POST /tokenize`` (module docstring); ``TOKENIZE`` is its one instance."""

    __slots__ = ()

    name = "tokenize"
    path = "/tokenize"
    operation = "tokenize"
    fields = TOKENIZE_FIELDS
    prompt_field = "prompt"
    serves = staticmethod(serves_tokenizer)

    def screen(self, body: dict[str, Any], limits: RequestLimits, grants: EngineGrants) -> bool:
        stripped = screen_fields(TOKENIZE_FIELDS, body, limits)
        check_template_kwargs(body.get("chat_template_kwargs"))
        check_items_parts(body.get("messages"), "messages", CHAT_PARTS, grants, CONTENT)  # vLLM parses them as chat's
        check_media_urls(body.get("messages"), limits.media_url_allowlist)
        check_tools_allowed(body, CHAT_TOOLS, grants, limits.max_tools)
        return stripped

    def stream_flags(self, body: dict[str, Any]) -> tuple[bool, bool]:
        return never_streamed(body, "Tokenization")

    def prompt_tokens(
        self, body: dict[str, Any], model: ModelPolicy, limits: RequestLimits, estimator: TokenEstimator
    ) -> int:
        if body.get("messages") is not None:
            if body.get("prompt") is not None:
                raise InvalidRequest("Send either 'prompt' or 'messages', not both.", param="messages")
            field, tokens = "messages", CHAT.prompt_tokens(body, model, limits, estimator)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise InvalidRequest("'prompt' (a string) or 'messages' is required.", param="prompt")
            chat_only = next((k for k, v in body.items() if k in TOKENIZE_CHAT_ONLY and v is not None), None)
            if chat_only is not None:
                raise InvalidRequest(f"'{chat_only}' applies to 'messages' only, not to 'prompt'.", param=chat_only)
            field, tokens = "prompt", estimator.count(prompt)
        if tokens > model.max_prompt_tokens:  # named by the field the client used
            raise prompt_too_long(field, model, f"about {tokens} tokens (estimated)")
        return tokens

    def render(self, body: dict[str, Any]) -> str | array[int]:
        rendered = render_chat(body) if body.get("messages") is not None else render_text_prompt(body.get("prompt"))
        return TOKENIZER_KEYS + rendered if isinstance(rendered, str) else rendered

    def is_answer(self, answer: dict[str, Any]) -> bool:
        return isinstance(answer.get("tokens"), list)

    def answer_usage(self, answer: dict[str, Any]) -> Mapping[str, Any] | None:
        count = answer.get("count")
        if not isinstance(count, int) or isinstance(count, bool):
            return None
        return {"prompt_tokens": count, "completion_tokens": 0, "total_tokens": count}


@final
class DetokenizeDialect(WholeAnswerOnly):
    """``POST /detokenize`` (module docstring); ``DETOKENIZE`` is its one instance."""

    __slots__ = ()

    name = "detokenize"
    path = "/detokenize"
    operation = "detokenize"
    fields = DETOKENIZE_FIELDS
    prompt_field = "tokens"
    serves = staticmethod(serves_tokenizer)

    def screen(self, body: dict[str, Any], limits: RequestLimits, grants: EngineGrants) -> bool:
        return screen_fields(DETOKENIZE_FIELDS, body, limits)

    def stream_flags(self, body: dict[str, Any]) -> tuple[bool, bool]:
        return never_streamed(body, "Detokenization")

    def prompt_tokens(
        self, body: dict[str, Any], model: ModelPolicy, limits: RequestLimits, estimator: TokenEstimator
    ) -> int:
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise InvalidRequest("'tokens' is required: an array of token ids.", param="tokens")
        if len(tokens) > model.max_prompt_tokens:  # known before an item is read
            raise prompt_too_long("tokens", model, f"{len(tokens)} tokens")
        # One C loop over the types, then one over the values: no Python call per id.
        if tokens and (set(map(type, tokens)) != {int} or min(tokens) < 0):
            raise InvalidRequest("'tokens' must hold token ids: integers of at least 0.", param="tokens")
        return len(tokens)

    def render(self, body: dict[str, Any]) -> str | array[int]:
        rendered = render_text_prompt(body.get("tokens"))
        return array("I", (TOKENIZER_ID_KEYS,)) + rendered if isinstance(rendered, array) else rendered

    def is_answer(self, answer: dict[str, Any]) -> bool:
        return isinstance(answer.get("prompt"), str)

    def answer_usage(self, answer: dict[str, Any]) -> Mapping[str, Any] | None:
        return None  # ``{"prompt"}`` only: the reservation (the exact id count) is charged


TOKENIZE = TokenizeDialect()
DETOKENIZE = DetokenizeDialect()
