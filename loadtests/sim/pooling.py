"""The engine's small endpoints, in vLLM's shapes: ``POST /tokenize``, ``/detokenize``,
``/v1/rerank`` (also ``/rerank``, ``/v2/rerank``) and ``/v1/score`` (also ``/score``).

vLLM answers the first two in its API server with the model's tokenizer, and the others with a
cross-encoder's pooling pass. The simulator answers all four at once, without its step loop:
no prefill time, no KV blocks, which is enough for a gateway that only routes, limits and
counts them. What they do:

* **Tokenize**: ``prompt`` (a string) or ``messages`` (rendered with the simulator's chat
  template, ``add_generation_prompt`` true by default as vLLM's tokenize), through the
  simulator's tokenizer (``tokenizer.py``); answers ``{"count", "max_model_len", "tokens",
  "token_strs"}`` (the pieces when ``return_token_strs``, else null).
* **Detokenize**: ``tokens`` back to text. The tokenizer hashes pieces to ids, so the engine
  keeps the pieces it has tokenized (``Vocabulary``, bounded): a known id is its piece, joined
  with a space before each word (none before punctuation), an unknown one ``<id>``; an id past
  the vocabulary is a 400, as vLLM's.
* **Rerank and score**: each (query, document) pair gets a deterministic relevance, the
  Jaccard overlap of their lower-cased word sets (``relevance``); text parts of an object input
  ``{"content": [parts]}`` count, other parts do not. Rerank answers vLLM's
  ``RerankResponse`` (results by relevance, highest first, cut to ``top_n`` when it is above 0),
  score its ``ScoreResponse`` (one score per pair, in order; sides 1:1, 1:N or N:N under any of
  vLLM's names). Usage: the tokens of every pair (query and document, and the instruction),
  also counted in ``vllm:prompt_tokens_total``, and each request in
  ``vllm:request_success_total{finished_reason="stop"}``, as vLLM counts pooling requests.

Faults (``faults.py``): ``fail_503`` answers these 503 as every other endpoint; ``stall`` and
``close_mid_stream`` leave them alone, since they generate no token (a request asking for no
more than ``after_tokens`` tokens is never affected).
"""

from __future__ import annotations

import itertools
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from loadtests.sim.faults import Fault, FaultMode, unavailable
from loadtests.sim.metrics import EngineMetrics
from loadtests.sim.protocol import ApiError, field_of, model_body
from loadtests.sim.tokenizer import VOCAB_SIZE, render_chat, tokenize

_PIECES = re.compile(r"\w+|[^\w\s]")
"""The tokenizer's split (``tokenizer.tokenize``): one token a piece."""
_WORDS = re.compile(r"\w+")
MAX_VOCABULARY = 65_536
SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("text_1", "text_2"), ("data_1", "data_2"))


class Vocabulary:
    """The pieces behind the ids this engine has handed out, at most ``MAX_VOCABULARY`` of them."""

    def __init__(self) -> None:
        self._pieces: dict[int, str] = {}

    def learn(self, ids: list[int], pieces: list[str]) -> None:
        room = MAX_VOCABULARY - len(self._pieces)
        for token, piece in itertools.islice(zip(ids, pieces, strict=True), max(room, 0)):
            self._pieces.setdefault(token, piece)

    def text(self, ids: list[int]) -> str:
        parts: list[str] = []
        for token in ids:
            piece = self._pieces.get(token, f"<{token}>")
            parts.append(piece if not parts or not _WORDS.match(piece) else " " + piece)
        return "".join(parts)


class PoolingEndpoints:
    """The four endpoints of one engine (module docstring); ``answer`` gives a 200 body or raises ``ApiError``."""

    def __init__(self, model: str, max_model_len: int, metrics: EngineMetrics) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.vocabulary = Vocabulary()
        self._ids = itertools.count()
        self._id_base = os.urandom(6).hex()
        self._routes: Mapping[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "/tokenize": self._tokenize,
            "/detokenize": self._detokenize,
            "/v1/rerank": self._rerank,
            "/rerank": self._rerank,
            "/v2/rerank": self._rerank,
            "/v1/score": self._score,
            "/score": self._score,
        }
        self.paths = frozenset(self._routes)
        """Every path served here (the server routes them to ``answer``)."""

    def answer(self, path: str, raw: bytes, fault: Fault) -> bytes:
        """The JSON answer to ``raw`` at ``path`` under ``fault``."""
        if fault.mode is FaultMode.FAIL_503:
            self.metrics.faults[fault.mode.value].inc()
            raise unavailable()
        return orjson.dumps(self._routes[path](model_body(raw, self.model)))

    # --- the tokenizer -----------------------------------------------------------------------

    def _tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        text = _tokenize_text(body)
        ids, pieces = tokenize(text), _PIECES.findall(text)
        self.vocabulary.learn(ids, pieces)
        strs = pieces if field_of(body, "return_token_strs", bool, False) else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def _detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise ApiError(400, "'tokens' must be a list of token ids", param="tokens")
        wrong = next((t for t in ids if not 0 <= t < VOCAB_SIZE), None)
        if wrong is not None:
            raise ApiError(400, f"Token id {wrong} is out of vocabulary", param="tokens")
        return {"prompt": self.vocabulary.text(ids)}

    # --- scoring -----------------------------------------------------------------------------

    def _rerank(self, body: dict[str, Any]) -> dict[str, Any]:
        query = body.get("query")
        if isinstance(query, list):
            raise ApiError(400, "'query' must be one input", param="query")
        documents = _inputs(body, "documents")
        (query,) = _inputs(body, "query")
        top_n = field_of(body, "top_n", int, 0)
        if top_n < 0:
            raise ApiError(400, "'top_n' must be at least 0", param="top_n")
        scores, tokens = self._pairs(body, [query] * len(documents), documents)
        ranked = sorted(range(len(documents)), key=lambda i: (-scores[i], i))
        results = [
            {"index": i, "document": _document(documents[i]), "relevance_score": scores[i]}
            for i in ranked[: top_n or None]
        ]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"id": self._id("rerank-"), "model": self.model, "usage": usage, "results": results}

    def _score(self, body: dict[str, Any]) -> dict[str, Any]:
        first, second = next(((a, b) for a, b in SCORE_PAIRS if a in body and b in body), (None, None))
        if first is None or second is None:
            raise ApiError(400, "'text_1' and 'text_2' (or 'queries' and 'documents' or 'items') are required")
        left, right = _inputs(body, first), _inputs(body, second)
        if len(left) > 1 and len(left) != len(right):
            raise ApiError(400, "Input lengths must be either 1:1, 1:N or N:N")
        scores, tokens = self._pairs(body, left * len(right) if len(left) == 1 else left, right)
        data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}
        return {
            "id": self._id("score-"),
            "object": "list",
            "created": int(time.time()),
            "model": self.model,
            "data": data,
            "usage": usage,
        }

    def _pairs(self, body: dict[str, Any], queries: list[Any], documents: list[Any]) -> tuple[list[float], int]:
        """Each pair's relevance and the tokens of all pairs; counted in the engine's metrics."""
        instruction = field_of(body, "instruction", str, "")
        scores, total = [], 0
        for query, document in zip(queries, documents, strict=True):
            q, d = _text(query), _text(document)
            tokens = len(tokenize(instruction)) + len(tokenize(q)) + len(tokenize(d))
            if tokens > self.max_model_len:
                limit = self.max_model_len
                raise ApiError(400, f"A pair has {tokens} tokens; this model's maximum context length is {limit}.")
            scores.append(relevance(q, d))
            total += tokens
        self.metrics.prompt_tokens.inc(total)
        self.metrics.success["stop"].inc()
        return scores, total

    def _id(self, prefix: str) -> str:
        return f"{prefix}{self._id_base}{next(self._ids):x}"


def relevance(query: str, document: str) -> float:
    """The Jaccard overlap of the two texts' lower-cased word sets: 1 for the same words, 0 for none shared."""
    a, b = set(_WORDS.findall(query.lower())), set(_WORDS.findall(document.lower()))
    return round(len(a & b) / len(a | b), 6) if a | b else 0.0


def _tokenize_text(body: dict[str, Any]) -> str:
    """The text a tokenize body stands for: its prompt, or its messages through the chat template."""
    messages = body.get("messages")
    if messages is None:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' (a string) or 'messages' is required", param="prompt")
        return prompt
    if not isinstance(messages, list):
        raise ApiError(400, "'messages' must be a list", param="messages")
    rendered = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        rendered.append({"role": message["role"], "content": _text(message.get("content") or "")})
    return render_chat(
        rendered,
        add_generation_prompt=field_of(body, "add_generation_prompt", bool, True),
        continue_final_message=field_of(body, "continue_final_message", bool, False),
    )


def _inputs(body: dict[str, Any], field: str) -> list[Any]:
    """``body[field]``, one input or a list of them (strings or ``{"content": [parts]}``)."""
    value = body.get(field)
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(i, str) or (isinstance(i, dict) and "content" in i) for i in items):
        what = "a string, an object with 'content', or a non-empty list of them"
        raise ApiError(400, f"'{field}' must be {what}", param=field)
    return items


def _text(value: Any) -> str:
    """The text of an input or a message content: a string, or its text parts joined."""
    if isinstance(value, dict):
        value = value.get("content")
    if isinstance(value, list):
        return " ".join(p["text"] for p in value if isinstance(p, dict) and isinstance(p.get("text"), str))
    return value if isinstance(value, str) else ""


def _document(value: Any) -> dict[str, Any]:
    """vLLM's ``RerankDocument``: the text, or the multimodal parts."""
    if isinstance(value, str):
        return {"text": value, "multi_modal": None}
    return {"text": None, "multi_modal": value.get("content")}
