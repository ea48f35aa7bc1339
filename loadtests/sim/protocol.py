"""vLLM's OpenAI-compatible wire format: strict request parsing and byte-exact response shapes.

Shapes follow vLLM's ``entrypoints/openai/protocol.py`` and ``serving_chat.py`` /
``serving_completion.py``: a chat stream starts with a chunk whose delta is only
``{"role": "assistant", "content": ""}``; content chunks carry ``"logprobs": null`` and
``"finish_reason": null`` (and ``"usage": null`` when ``stream_options.include_usage``); the last
content chunk carries ``finish_reason`` and ``stop_reason``; with ``include_usage`` a final chunk
has ``"choices": []`` and the usage totals; then ``data: [DONE]``. With
``stream_options.continuous_usage_stats`` (and ``include_usage``) every chunk carries the usage so
far instead of ``null``, as vLLM does: the gateway reads the exact count of tokens already streamed
from it when it migrates a broken stream to another engine. Errors use vLLM's shape
``{"error": {"message", "type", "param", "code"}}``.

Content chunks are built from pre-rendered byte templates: the per-token cost is one
``orjson.dumps`` of the token text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import orjson

from loadtests.sim.tokenizer import count_tokens, render_chat, tokenize


class Endpoint(enum.Enum):
    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"


class ApiError(Exception):
    """An error answered to the client in vLLM's JSON shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind  # the error's "type"; by default derived from the status, as vLLM does

    def body(self) -> bytes:
        kind = self.kind or {
            400: "BadRequestError",
            404: "NotFoundError",
            405: "MethodNotAllowed",
            503: "ServiceUnavailableError",
        }.get(self.status, "InternalServerError")
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.status}
        return orjson.dumps({"error": error})


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated generation or embedding request."""

    endpoint: Endpoint
    model: str
    token_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    priority: int
    continuous_usage: bool
    cache_salt: str | None


def field_of(body: dict[str, Any], key: str, kinds: type | tuple[type, ...], default: Any) -> Any:
    """``body[key]`` checked against ``kinds`` (a bool is not an int), ``default`` when absent or null."""
    value = body.get(key, default)
    if value is None:
        return default
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise ApiError(400, f"'{key}' has the wrong type", param=key)
    return value


def model_body(raw: bytes, served_model: str) -> dict[str, Any]:
    """A request body as a JSON object naming the served model (400 otherwise; 404 for another model)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"invalid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = field_of(body, "model", str, served_model)
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model")
    return body


def _message_text(message: Any, index: int) -> dict[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(400, f"messages[{index}] must be an object with a string 'role'", param="messages")
    content = message.get("content") or ""
    if isinstance(content, list):
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{index}].content must be a string or parts", param="messages")
    return {"role": message["role"], "content": content}


def _chat_prompt(body: dict[str, Any]) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    rendered = [_message_text(m, i) for i, m in enumerate(messages)]
    add_prompt = field_of(body, "add_generation_prompt", bool, True)
    cont = field_of(body, "continue_final_message", bool, False)
    if cont and add_prompt:
        raise ApiError(400, "continue_final_message requires add_generation_prompt=false")
    if cont and rendered[-1]["role"] != "assistant":
        raise ApiError(400, "continue_final_message needs a final assistant message", param="messages")
    return tokenize(render_chat(rendered, add_generation_prompt=add_prompt, continue_final_message=cont))


def _completion_prompt(body: dict[str, Any], key: str) -> list[int]:
    prompt = body.get(key)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenize(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise ApiError(400, f"'{key}' must be a string, a list of token ids, or a list of one of them", param=key)


def parse_request(endpoint: Endpoint, raw: bytes, *, served_model: str, default_max_tokens: int) -> ParsedRequest:
    """Validate a request body; raise `ApiError` (400, or 404 for another model)."""
    body = model_body(raw, served_model)
    model = served_model
    if field_of(body, "n", int, 1) != 1:
        raise ApiError(400, "only n=1 is supported by the simulator", param="n")
    if endpoint is Endpoint.CHAT:
        tokens = _chat_prompt(body)
        max_tokens = field_of(body, "max_completion_tokens", int, None) or field_of(body, "max_tokens", int, None)
    elif endpoint is Endpoint.COMPLETION:
        tokens = _completion_prompt(body, "prompt")
        max_tokens = field_of(body, "max_tokens", int, None)
    else:
        tokens = _completion_prompt(body, "input")
        max_tokens = 0
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens < 0 or (max_tokens == 0 and endpoint is not Endpoint.EMBEDDING):
        raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
    options = field_of(body, "stream_options", dict, {})
    salt = field_of(body, "cache_salt", str, None)
    if salt == "":
        raise ApiError(400, "cache_salt must be a non-empty string", param="cache_salt")
    return ParsedRequest(
        endpoint=endpoint,
        model=model,
        token_ids=tokens,
        max_tokens=max_tokens,
        stream=field_of(body, "stream", bool, False),
        include_usage=bool(options.get("include_usage", False)),
        priority=field_of(body, "priority", int, 0),
        continuous_usage=bool(options.get("include_usage")) and bool(options.get("continuous_usage_stats")),
        cache_salt=salt,
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    """vLLM's ``UsageInfo``; the per-chunk usage of continuous stats has no details."""
    use: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if cached_tokens is not None:
        use["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return use


class StreamRenderer:
    """SSE byte chunks of one streamed chat or text completion.

    With ``continuous_prompt`` set (the prompt's token count), every chunk carries the usage so
    far (vLLM's ``continuous_usage_stats``); ``completion_tokens`` is the count including the chunk.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        req_id: str,
        model: str,
        created: int,
        include_usage: bool,
        continuous_prompt: int | None = None,
    ) -> None:
        self.chat = endpoint is Endpoint.CHAT
        self._head = {
            "id": req_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": created,
            "model": model,
        }
        self._include_usage = include_usage
        self._continuous_prompt = continuous_prompt
        head = orjson.dumps(self._head)[:-1]
        if self.chat:
            self._open = b"data: " + head + b',"choices":[{"index":0,"delta":{"content":'
            self._close = b'},"logprobs":null,"finish_reason":null}]'
        else:
            self._open = b"data: " + head + b',"choices":[{"index":0,"text":'
            self._close = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]'
        if continuous_prompt is None:
            self._close += (b',"usage":null}' if include_usage else b"}") + b"\n\n"

    def role_chunk(self) -> bytes:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._event({**self._head, "choices": [choice]}, 0)

    def content(self, text: str, completion_tokens: int = 0) -> bytes:
        if self._continuous_prompt is None:
            return self._open + orjson.dumps(text) + self._close
        use = usage(self._continuous_prompt, completion_tokens, None)
        return self._open + orjson.dumps(text) + self._close + b',"usage":' + orjson.dumps(use) + b"}\n\n"

    def final(self, text: str, finish_reason: str, completion_tokens: int = 0) -> bytes:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
        choice.update(finish_reason=finish_reason, stop_reason=None)
        return self._event({**self._head, "choices": [choice]}, completion_tokens)

    def usage_chunk(self, prompt: int, completion: int, cached: int) -> bytes:
        return self._event({**self._head, "choices": [], "usage": usage(prompt, completion, cached)}, completion)

    def _event(self, obj: dict[str, Any], completion_tokens: int) -> bytes:
        if self._include_usage and "usage" not in obj:
            prompt = self._continuous_prompt
            obj["usage"] = None if prompt is None else usage(prompt, completion_tokens, None)
        return b"data: " + orjson.dumps(obj) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def full_response(
    endpoint: Endpoint, req_id: str, model: str, created: int, text: str, finish_reason: str, use: dict[str, Any]
) -> bytes:
    """A non-streaming `chat.completion` or `text_completion` body."""
    if endpoint is Endpoint.CHAT:
        message = {"role": "assistant", "content": text, "tool_calls": []}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        obj = "text_completion"
    body = {"id": req_id, "object": obj, "created": created, "model": model, "choices": [choice], "usage": use}
    if endpoint is Endpoint.CHAT:
        body["prompt_logprobs"] = None
    return orjson.dumps(body)


def embedding_response(req_id: str, model: str, created: int, vector: list[float], prompt_tokens: int) -> bytes:
    data = [{"index": 0, "object": "embedding", "embedding": vector}]
    use = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
    return orjson.dumps(
        {"id": req_id, "object": "list", "created": created, "model": model, "data": data, "usage": use}
    )


def models_response(model: str, created: int, max_model_len: int) -> bytes:
    card = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": model,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [],
    }
    return orjson.dumps({"object": "list", "data": [card]})


__all__ = ["DONE", "ApiError", "Endpoint", "ParsedRequest", "StreamRenderer", "count_tokens", "parse_request"]
