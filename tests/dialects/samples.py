"""Each registered dialect's sample bodies, streams and answers, for the conformance suite.

A new dialect adds its entry here (the suite fails for a registered dialect without one). The
samples are what an engine behind the gateway really sends: the chat and completions streams
are vLLM's (role-only first chunk, one token a chunk, a finish chunk, the usage-only chunk of
``include_usage``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MODEL = "m"
SYSTEM = "You are the assistant of a large company."

Body = dict[str, Any]


@dataclass(frozen=True)
class Refusal:
    """A body the dialect refuses, with the error ``code`` and ``param`` it must name."""

    body: Body
    code: str
    param: str
    why: str


@dataclass(frozen=True)
class DialectSamples:
    """What the suite feeds one dialect.

    ``with_prompt(text)``: a valid body whose prompt is ``text``. ``turns(first, answer, second)``:
    the bodies of a conversation's turn and of its next turn (which resends the first, the answer
    and adds ``second``). ``stream``: the events of a streamed answer (None: never streamed),
    whose first output is ``stream[first_output]``; ``stream_usage`` its usage in the gateway's
    shape, ``finish_reasons`` its finish reasons. ``answer``/``answer_usage``: a whole answer and
    its usage (None: the API's answer reports none, as vLLM's ``/detokenize``).
    """

    with_prompt: Callable[[str], Body]
    turns: Callable[[str, str, str], tuple[Body, Body]]
    refused: list[Refusal]
    answer: Body
    answer_usage: dict[str, int] | None
    stream: list[Body] | None = None
    first_output: int = 0
    stream_usage: dict[str, int] = field(default_factory=dict)
    finish_reasons: tuple[str, ...] = ()


# --- chat ----------------------------------------------------------------------------------


def _chat(text: str) -> Body:
    return {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]}


def _chat_turns(first: str, answer: str, second: str) -> tuple[Body, Body]:
    turn = _chat(first)
    following = {
        **turn,
        "messages": [*turn["messages"], {"role": "assistant", "content": answer}, {"role": "user", "content": second}],
    }
    return turn, following


_CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL}


def _chat_chunk(delta: Body, finish: str | None = None) -> Body:
    return {**_CHUNK, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


CHAT = DialectSamples(
    with_prompt=_chat,
    turns=_chat_turns,
    refused=[
        Refusal({"model": MODEL}, "invalid_field", "messages", "a chat without messages"),
        Refusal(
            {"model": MODEL, "messages": [{"role": "wizard", "content": "Hi"}]},
            "invalid_field",
            "messages[0].role",
            "an unknown role",
        ),
        Refusal(
            {**_chat("Hi"), "chat_template_kwargs": {"chat_template": "{{ x }}"}},
            "unsupported_field",
            "chat_template_kwargs.chat_template",
            "a template smuggled in as a switch",
        ),
        Refusal(
            {**_chat("Hi"), "stream_options": {"include_usage": True, "verbose": True}},
            "unsupported_field",
            "stream_options.verbose",
            "an unknown stream option",
        ),
        Refusal(
            {**_chat("Hi"), "max_tokens": 8, "max_completion_tokens": 9},
            "conflicting_max_tokens",
            "max_tokens",
            "two output bounds that disagree",
        ),
        Refusal({**_chat("Hi"), "stream": "yes"}, "invalid_field", "stream", "a stream flag that is not a boolean"),
        Refusal(
            {**_chat("Hi"), "stop": ["."] * 17}, "too_many_items", "stop", "more stop strings than the policy's bound"
        ),
        Refusal(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "image_embeds", "image_embeds": "AA"}]}],
            },
            "content_part_not_allowed",
            "messages[0].content[0].type",
            "an image_embeds part from a tenant that did not opt in",
        ),
        Refusal(
            {**_chat("Hi"), "tools": [{"type": "custom", "custom": {"name": "c"}}]},
            "tool_type_not_allowed",
            "tools[0].type",
            "a tool that is not a function",
        ),
    ],
    answer={
        **_CHUNK,
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
    },
    answer_usage={"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
    stream=[
        _chat_chunk({"role": "assistant", "content": ""}),
        _chat_chunk({"content": "Hel"}),
        _chat_chunk({"content": "lo"}),
        _chat_chunk({}, "stop"),
        {**_CHUNK, "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14}},
    ],
    first_output=1,
    stream_usage={"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14},
    finish_reasons=("stop",),
)


# --- completions ---------------------------------------------------------------------------


def _completion(text: str) -> Body:
    return {"model": MODEL, "prompt": text}


def _completion_turns(first: str, answer: str, second: str) -> tuple[Body, Body]:
    return _completion(first), _completion(first + answer + second)


_TEXT_CHUNK = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL}


def _text_chunk(text: str, finish: str | None = None) -> Body:
    return {**_TEXT_CHUNK, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


COMPLETIONS = DialectSamples(
    with_prompt=_completion,
    turns=_completion_turns,
    refused=[
        Refusal({"model": MODEL}, "invalid_field", "prompt", "a completion without a prompt"),
        Refusal({"model": MODEL, "prompt": [1, "two"]}, "invalid_field", "prompt", "token ids mixed with text"),
        Refusal(
            {"model": MODEL, "prompt": list(range(100_001))},
            "prompt_too_long",
            "prompt",
            "more token ids than the model's prompt cap, refused before they are read",
        ),
        Refusal({**_completion("Hi"), "n_predict": 0}, "invalid_field", "n_predict", "a bound that is not positive"),
        Refusal(
            {**_completion("Hi"), "logit_bias": {str(i): -100 for i in range(301)}},
            "too_many_items",
            "logit_bias",
            "more logit biases than the policy's bound",
        ),
        Refusal({**_completion("Hi"), "logprobs": 21}, "invalid_field", "logprobs", "more logprobs than the bound"),
    ],
    answer={
        **_TEXT_CHUNK,
        "choices": [{"index": 0, "text": " there", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
    },
    answer_usage={"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
    stream=[
        _text_chunk(""),
        _text_chunk(" Once"),
        _text_chunk(" upon", "length"),
        {**_TEXT_CHUNK, "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}},
    ],
    first_output=1,
    stream_usage={"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
    finish_reasons=("length",),
)


# --- embeddings ----------------------------------------------------------------------------


def _embedding(text: str) -> Body:
    return {"model": MODEL, "input": text, "encoding_format": "float"}


def _embedding_turns(first: str, answer: str, second: str) -> tuple[Body, Body]:
    return _embedding(first), _embedding(first + answer + second)


EMBEDDINGS = DialectSamples(
    with_prompt=_embedding,
    turns=_embedding_turns,
    refused=[
        Refusal({"model": MODEL}, "invalid_field", "input", "an embedding without input"),
        Refusal({**_embedding("Hi"), "stream": True}, "invalid_field", "stream", "a streamed embedding"),
        Refusal({**_embedding("Hi"), "max_tokens": 8}, "unsupported_field", "max_tokens", "an output bound"),
        Refusal({"model": MODEL, "input": [[1, 2], []]}, "invalid_field", "input", "an empty token-id list"),
    ],
    answer={
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.1, -0.2]}],
        "model": MODEL,
        "usage": {"prompt_tokens": 2, "total_tokens": 2},
    },
    answer_usage={"prompt_tokens": 2, "total_tokens": 2},
)

# --- responses -----------------------------------------------------------------------------
# vLLM's Responses objects and events (``vllm/entrypoints/openai/serving_responses.py``).


def _responses(text: str) -> Body:
    return {"model": MODEL, "instructions": SYSTEM, "input": [{"role": "user", "content": text}]}


def _responses_turns(first: str, answer: str, second: str) -> tuple[Body, Body]:
    turn = _responses(first)
    following = {
        **turn,
        "input": [
            *turn["input"],
            {"role": "assistant", "content": [{"type": "output_text", "text": answer}]},
            {"role": "user", "content": [{"type": "input_text", "text": second}]},
        ],
    }
    return turn, following


_RESPONSE_USAGE = {
    "input_tokens": 9,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 2,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 11,
}
_MESSAGE_ITEM = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "output_text", "text": " Once upon", "annotations": []}],
}


def _response(status: str, usage: Body | None, output: list[Body]) -> Body:
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "model": MODEL,
        "status": status,
        "output": output,
        "usage": usage,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
    }


def _event(kind: str, number: int, **fields: Any) -> Body:
    return {"type": kind, "sequence_number": number, **fields}


RESPONSES = DialectSamples(
    with_prompt=_responses,
    turns=_responses_turns,
    refused=[
        Refusal({"model": MODEL}, "invalid_field", "input", "a response without input"),
        Refusal({**_responses("Hi"), "background": True}, "unsupported_field", "background", "a background response"),
        Refusal({"model": MODEL, "input": [1]}, "invalid_field", "input[0]", "an item that is not an object"),
        Refusal(
            {**_responses("Hi"), "max_output_tokens": 0}, "invalid_field", "max_output_tokens", "a non-positive bound"
        ),
        Refusal(
            {**_responses("Hi"), "tools": [{"type": "web_search_preview"}]},
            "tool_type_not_allowed",
            "tools[0].type",
            "a built-in tool from a tenant that did not opt in",
        ),
        Refusal(
            {"model": MODEL, "input": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
            "content_part_not_allowed",
            "input[0].content[0].type",
            "a part type the Responses API does not take",
        ),
        Refusal(
            {**_responses("Hi"), "metadata": {str(i): "v" for i in range(17)}},
            "too_many_items",
            "metadata",
            "more metadata pairs than OpenAI's 16",
        ),
    ],
    answer=_response("incomplete", _RESPONSE_USAGE, [_MESSAGE_ITEM]),
    answer_usage={
        "prompt_tokens": 9,
        "completion_tokens": 2,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0},
    },
    stream=[
        _event("response.created", 0, response=_response("in_progress", None, [])),
        _event("response.in_progress", 1, response=_response("in_progress", None, [])),
        _event("response.output_item.added", 2, output_index=0, item={**_MESSAGE_ITEM, "content": []}),
        _event("response.content_part.added", 3, output_index=0, content_index=0, item_id="msg_1", part={}),
        _event("response.output_text.delta", 4, output_index=0, content_index=0, item_id="msg_1", delta=" Once"),
        _event("response.output_text.delta", 5, output_index=0, content_index=0, item_id="msg_1", delta=" upon"),
        _event("response.output_text.done", 6, output_index=0, content_index=0, item_id="msg_1", text=" Once upon"),
        _event("response.output_item.done", 7, output_index=0, item=_MESSAGE_ITEM),
        _event("response.completed", 8, response=_response("incomplete", _RESPONSE_USAGE, [_MESSAGE_ITEM])),
    ],
    first_output=4,
    stream_usage={
        "prompt_tokens": 9,
        "completion_tokens": 2,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0},
    },
    finish_reasons=("length",),
)

# --- messages ------------------------------------------------------------------------------
# vLLM's Anthropic Messages objects and events (``vllm/entrypoints/anthropic/serving.py``).


def _messages(text: str) -> Body:
    return {"model": MODEL, "max_tokens": 16, "system": SYSTEM, "messages": [{"role": "user", "content": text}]}


def _messages_turns(first: str, answer: str, second: str) -> tuple[Body, Body]:
    turn = _messages(first)
    following = {
        **turn,
        "messages": [
            *turn["messages"],
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            {"role": "user", "content": [{"type": "text", "text": second}]},
        ],
    }
    return turn, following


def _anthropic(kind: str, **fields: Any) -> Body:
    return {"type": kind, **fields}


_ANTHROPIC_MESSAGE = {
    "id": "chatcmpl-1",
    "type": "message",
    "role": "assistant",
    "content": [{"type": "text", "text": " Once upon"}],
    "model": MODEL,
    "stop_reason": "max_tokens",
    "stop_sequence": None,
    "usage": {"input_tokens": 9, "output_tokens": 2},
}

MESSAGES = DialectSamples(
    with_prompt=_messages,
    turns=_messages_turns,
    refused=[
        Refusal({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}, "invalid_field", "max_tokens",
                "no max_tokens (the API requires it)"),
        Refusal({"model": MODEL, "max_tokens": 8}, "invalid_field", "messages", "no messages"),
        Refusal({**_messages("Hi"), "messages": [{"role": "system", "content": "Hi"}]}, "invalid_field",
                "messages[0].role", "a system message (system is a top-level field)"),
        Refusal({**_messages("Hi"), "messages": [{"role": "user", "content": [{"text": "Hi"}]}]}, "invalid_field",
                "messages[0].content[0]", "a block without a type"),
        Refusal({**_messages("Hi"), "max_tokens": 0}, "invalid_field", "max_tokens", "a non-positive bound"),
        Refusal({**_messages("Hi"), "stop_sequences": ["."] * 17}, "too_many_items", "stop_sequences",
                "more stop sequences than the policy's bound"),
        Refusal({**_messages("Hi"), "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
                "tool_type_not_allowed", "tools[0].type", "a server tool from a tenant that did not opt in"),
        Refusal({**_messages("Hi"), "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
                "content_part_not_allowed", "messages[0].content[0].type", "a block type Messages does not take"),
    ],
    answer=_ANTHROPIC_MESSAGE,
    answer_usage={"prompt_tokens": 9, "completion_tokens": 2},
    stream=[
        _anthropic("message_start", message={**_ANTHROPIC_MESSAGE, "content": [], "stop_reason": None,
                                             "usage": {"input_tokens": 9, "output_tokens": 0}}),
        _anthropic("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        _anthropic("content_block_delta", index=0, delta={"type": "text_delta", "text": " Once"}),
        _anthropic("content_block_delta", index=0, delta={"type": "text_delta", "text": " upon"}),
        _anthropic("content_block_stop", index=0),
        _anthropic("message_delta", delta={"stop_reason": "max_tokens"}, usage={"input_tokens": 9, "output_tokens": 2}),
        _anthropic("message_stop"),
    ],
    first_output=2,
    stream_usage={"prompt_tokens": 9, "completion_tokens": 2},
    finish_reasons=("length",),
)  # fmt: skip

# --- messages count_tokens ------------------------------------------------------------------
# vLLM's ``AnthropicCountTokensResponse`` (``vllm/entrypoints/anthropic/protocol.py``).


def _count_tokens(text: str) -> Body:
    return {"model": MODEL, "system": SYSTEM, "messages": [{"role": "user", "content": text}]}


def _count_tokens_turns(first: str, answer: str, second: str) -> tuple[Body, Body]:
    turn, following = _messages_turns(first, answer, second)
    return _without_bound(turn), _without_bound(following)


def _without_bound(body: Body) -> Body:
    return {k: v for k, v in body.items() if k != "max_tokens"}


COUNT_TOKENS = DialectSamples(
    with_prompt=_count_tokens,
    turns=_count_tokens_turns,
    refused=[
        Refusal({"model": MODEL}, "invalid_field", "messages", "no messages"),
        Refusal({**_count_tokens("Hi"), "max_tokens": 8}, "unsupported_field", "max_tokens",
                "an output bound (nothing is generated)"),
        Refusal({**_count_tokens("Hi"), "messages": [{"role": "system", "content": "Hi"}]}, "invalid_field",
                "messages[0].role", "a system message (system is a top-level field)"),
        Refusal({**_count_tokens("Hi"), "tools": {"name": "t"}}, "invalid_field", "tools", "tools not in an array"),
        Refusal({**_count_tokens("Hi"), "chat_template_kwargs": {"chat_template": "{{ x }}"}}, "unsupported_field",
                "chat_template_kwargs.chat_template", "a template smuggled in as a switch"),
        Refusal({**_count_tokens("Hi"), "tools": [{"type": "bash_20250124", "name": "bash"}]},
                "tool_type_not_allowed", "tools[0].type", "a server tool, as Messages refuses it"),
    ],
    answer={"input_tokens": 9, "context_management": {"original_input_tokens": 9}},
    answer_usage={"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9},
)  # fmt: skip

# --- tokenize, detokenize ------------------------------------------------------------------
# vLLM's tokenizer endpoints (``vllm/entrypoints/serve/tokenize/protocol.py``).


def _tokenize(text: str) -> Body:
    return {"model": MODEL, "prompt": text, "add_special_tokens": False, "return_token_strs": True}


def _tokenize_turns(first: str, answer: str, second: str) -> tuple[Body, Body]:
    return _tokenize(first), _tokenize(first + answer + second)


_USER_HI = [{"role": "user", "content": "Hi"}]

TOKENIZE = DialectSamples(
    with_prompt=_tokenize,
    turns=_tokenize_turns,
    refused=[
        Refusal({"model": MODEL}, "invalid_field", "prompt", "neither a prompt nor messages"),
        Refusal({**_tokenize("Hi"), "messages": _USER_HI}, "invalid_field", "messages", "both a prompt and messages"),
        Refusal({"model": MODEL, "prompt": [1, 2]}, "invalid_field", "prompt", "token ids, not text"),
        Refusal(
            {**_tokenize("Hi"), "add_generation_prompt": True},
            "invalid_field",
            "add_generation_prompt",
            "a chat template switch with a prompt (vLLM would ignore it)",
        ),
        Refusal(
            {"model": MODEL, "messages": [{"role": "wizard", "content": "Hi"}]},
            "invalid_field",
            "messages[0].role",
            "the chat form's messages checked as chat's",
        ),
        Refusal(
            {"model": MODEL, "messages": _USER_HI, "chat_template": "{{ x }}"},
            "unsupported_field",
            "chat_template",
            "a template of the request's own",
        ),
        Refusal(
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "prompt_embeds", "data": "AA"}]}]},
            "content_part_not_allowed",
            "messages[0].content[0].type",
            "a prompt_embeds part, as chat refuses it",
        ),
    ],
    answer={"count": 2, "max_model_len": 4096, "tokens": [9906, 1917], "token_strs": ["Hello", " world"]},
    answer_usage={"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2},
)


def _detokenize(text: str) -> Body:
    return {"model": MODEL, "tokens": list(text.encode())}  # a byte-level tokenizer's ids


def _detokenize_turns(first: str, answer: str, second: str) -> tuple[Body, Body]:
    return _detokenize(first), _detokenize(first + answer + second)


DETOKENIZE = DialectSamples(
    with_prompt=_detokenize,
    turns=_detokenize_turns,
    refused=[
        Refusal({"model": MODEL}, "invalid_field", "tokens", "no token ids"),
        Refusal({"model": MODEL, "tokens": "Hi"}, "invalid_field", "tokens", "text instead of token ids"),
        Refusal({"model": MODEL, "tokens": [1, -2]}, "invalid_field", "tokens", "a negative id"),
        Refusal({"model": MODEL, "tokens": [1, True]}, "invalid_field", "tokens", "a boolean for an id"),
        Refusal(
            {"model": MODEL, "tokens": list(range(100_001))},
            "prompt_too_long",
            "tokens",
            "more ids than the model's prompt cap, refused before they are read",
        ),
    ],
    answer={"prompt": "Hello world"},
    answer_usage=None,  # vLLM's answer carries no usage: the reservation (the ids' count) is charged
)

# --- rerank, score -------------------------------------------------------------------------
# vLLM's ``RerankResponse`` and ``ScoreResponse`` (``vllm/entrypoints/pooling/scoring/protocol.py``).

_DOCUMENTS = ["The quick fox jumps.", "A lazy dog sleeps."]
_QUERY = "Which one is about the fox?"


def _rerank(text: str) -> Body:
    return {"model": MODEL, "query": text, "documents": _DOCUMENTS, "top_n": 1}


def _rerank_turns(first: str, answer: str, second: str) -> tuple[Body, Body]:
    # No conversation here: a longer last document extends the rendered pairs all the same.
    turn = {"model": MODEL, "query": _QUERY, "documents": [first]}
    return turn, {**turn, "documents": [first + answer + second]}


def _image(url: str) -> Body:
    return {"content": [{"type": "image_url", "image_url": {"url": url}}]}


RERANK = DialectSamples(
    with_prompt=_rerank,
    turns=_rerank_turns,
    refused=[
        Refusal({"model": MODEL, "query": "q"}, "invalid_field", "documents", "no documents"),
        Refusal({"model": MODEL, "documents": ["d"]}, "invalid_field", "query", "no query"),
        Refusal({**_rerank("q"), "query": ["q", "r"]}, "invalid_field", "query", "a list of queries"),
        Refusal(
            {**_rerank("q"), "documents": ["d"] * 513},
            "too_many_messages",
            "documents",
            "more documents than limits.max_messages, refused before they are read",
        ),
        Refusal(
            {**_rerank("q"), "documents": ["d", {"text": "e"}]},
            "invalid_field",
            "documents[1]",
            "a document object without content parts",
        ),
        Refusal({**_rerank("q"), "top_n": -1}, "invalid_field", "top_n", "a negative top_n"),
        Refusal(
            {**_rerank("q"), "documents": ["d", _image("https://evil.test/a.png")]},
            "media_url_not_allowed",
            "documents[1].content[0].image_url.url",
            "a media URL off the allowlist",
        ),
        Refusal(
            {**_rerank("q"), "documents": ["d", {"content": [{"type": "image_embeds", "image_embeds": "AA"}]}]},
            "content_part_not_allowed",
            "documents[1].content[0].type",
            "an image_embeds part from a tenant that did not opt in",
        ),
    ],
    answer={
        "id": "rerank-1",
        "model": MODEL,
        "usage": {"prompt_tokens": 21, "total_tokens": 21},
        "results": [{"index": 0, "document": {"text": _DOCUMENTS[0], "multi_modal": None}, "relevance_score": 0.97}],
    },
    answer_usage={"prompt_tokens": 21, "completion_tokens": 0, "total_tokens": 21},
)


def _score(text: str) -> Body:
    return {"model": MODEL, "text_1": text, "text_2": _DOCUMENTS}


def _score_turns(first: str, answer: str, second: str) -> tuple[Body, Body]:
    turn = {"model": MODEL, "queries": _QUERY, "documents": [first]}
    return turn, {**turn, "documents": [first + answer + second]}


SCORE = DialectSamples(
    with_prompt=_score,
    turns=_score_turns,
    refused=[
        Refusal({"model": MODEL, "text_1": "q"}, "invalid_field", "text_2", "one side only"),
        Refusal({"model": MODEL, "items": ["d"]}, "invalid_field", "queries", "no first side"),
        Refusal(
            {"model": MODEL, "queries": "q", "documents": ["d"], "text_2": ["e"]},
            "invalid_field",
            "text_2",
            "sides named two ways",
        ),
        Refusal(
            {"model": MODEL, "text_1": ["a", "b"], "text_2": ["c", "d", "e"]},
            "invalid_field",
            "text_2",
            "two queries for three documents (neither 1:N nor N:N)",
        ),
        Refusal({"model": MODEL, "data_1": [], "data_2": ["d"]}, "invalid_field", "data_1", "an empty side"),
        Refusal(
            {"model": MODEL, "data_1": "q", "data_2": ["d"] * 513},
            "too_many_messages",
            "data_2",
            "more items than limits.max_messages, refused before they are read",
        ),
    ],
    answer={
        "id": "score-1",
        "object": "list",
        "created": 1,
        "model": MODEL,
        "data": [{"index": 0, "object": "score", "score": 0.97}, {"index": 1, "object": "score", "score": 0.02}],
        "usage": {"prompt_tokens": 30, "total_tokens": 30, "completion_tokens": 0, "prompt_tokens_details": None},
    },
    answer_usage={"prompt_tokens": 30, "completion_tokens": 0, "total_tokens": 30},
)

SAMPLES: dict[str, DialectSamples] = {
    "chat": CHAT,
    "completions": COMPLETIONS,
    "embeddings": EMBEDDINGS,
    "responses": RESPONSES,
    "messages": MESSAGES,
    "count_tokens": COUNT_TOKENS,
    "tokenize": TOKENIZE,
    "detokenize": DETOKENIZE,
    "rerank": RERANK,
    "score": SCORE,
}
"""Samples by dialect name."""
