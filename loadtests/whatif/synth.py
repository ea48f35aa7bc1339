"""Prompts from prefix signatures: the text a replayed request sends, rebuilt from its hash chain.

A trace holds no text, only each prompt's tenant-scoped block-hash chain (``prefix_hashes``), its
block size and its length. The replay needs prompts whose *sharing* is the recorded one, so:

* each hash id becomes one deterministic block of exactly ``block_tokens`` words (``block_text``):
  equal ids give equal text, so two requests whose chains share a head send prompts sharing
  exactly that many leading tokens, and the engine's prefix cache and the gateway's prefix
  routing see the recorded sharing. Tenants' chains never meet (the trace scoped them), so their
  texts never do either;
* an unshared tail, seeded by the request's index in the trace (``tail_text``), fills the prompt
  up to its recorded length.

Words are three lowercase letters and a space: one token for the simulator's tokenizer (one word
or punctuation mark a token, ``loadtests/sim/tokenizer.py``) and exactly ``CHARS_PER_TOKEN``
(4) bytes for the gateway's estimate (``gateway/routing/prefix_keys.py``), so that a length means
the same to both and a block of ``block_tokens`` tokens is ``4 × block_tokens`` bytes.

The body is **one user message** holding the whole prompt. Why not a system/user split: the
chain says where sharing ends, not where a message ended, and a split adds role markers
(``\\x1euser\\x1f`` for the gateway, ``<|end|> <|user|>`` for the engine) at a place that would
have to be guessed; with one message, a shared chain head is a shared text prefix, byte for byte.

Lengths: the content is sized so that the *simulator's* prompt (content plus its chat template,
``TEMPLATE_TOKENS``) has the recorded ``prompt_tokens`` (what an engine's usage reported), never
fewer words than the chain's blocks. ``max_tokens`` is the recorded output length (the simulator
generates exactly ``max_tokens``), at least 1.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import orjson

from gateway.routing.prefix_keys import CHARS_PER_TOKEN
from loadtests.sim.tokenizer import count_tokens, render_chat
from loadtests.whatif.model import ReplayRequest

CHAT_PATH = "/v1/chat/completions"
LETTERS_PER_WORD = 3
WORD_BYTES = LETTERS_PER_WORD + 1
"""Three letters and a space."""
assert WORD_BYTES == CHARS_PER_TOKEN, "a word must be one estimated token"

TEMPLATE_TOKENS = count_tokens(
    render_chat([{"role": "user", "content": ""}], add_generation_prompt=True, continue_final_message=False)
)
"""Tokens the simulator's chat template adds around one user message (``<|user|> ... <|end|> <|assistant|>``)."""

_LETTER_OF_BYTE = bytes(ord("a") + b % 26 for b in range(256))
_BLOCK_CACHE_SIZE = 8192
"""Distinct blocks kept rendered: 16 MiB at 512-token blocks; a shared prefix is rendered once."""


def words(seed: bytes, count: int) -> str:
    """``count`` pseudo-random three-letter words, each followed by a space, from ``seed``."""
    letters = hashlib.shake_256(seed).digest(LETTERS_PER_WORD * count).translate(_LETTER_OF_BYTE)
    out = bytearray(b" " * (WORD_BYTES * count))
    for i in range(LETTERS_PER_WORD):
        out[i::WORD_BYTES] = letters[i::LETTERS_PER_WORD]
    return out.decode("ascii")


@functools.lru_cache(maxsize=_BLOCK_CACHE_SIZE)
def block_text(block_id: str, block_tokens: int) -> str:
    """The text of one shared block: a function of its hash id (and size) alone."""
    return words(f"block:{block_tokens}:{block_id}".encode(), block_tokens)


def tail_text(index: int, tokens: int) -> str:
    """The unshared rest of request ``index``'s prompt: unique per request, the same in every replay."""
    return words(f"tail:{index}".encode(), tokens) if tokens > 0 else ""


def content_tokens(request: ReplayRequest) -> int:
    """Words in the message: the recorded prompt less the engine's template, at least the chain."""
    shared = len(request.prefix_hashes) * request.block_tokens
    return max(shared, request.prompt_tokens - TEMPLATE_TOKENS)


def prompt_text(request: ReplayRequest, index: int) -> str:
    """The chain's blocks in order, then the tail (module docstring)."""
    head = "".join(block_text(block_id, request.block_tokens) for block_id in request.prefix_hashes)
    shared = len(request.prefix_hashes) * request.block_tokens
    return head + tail_text(index, content_tokens(request) - shared)


def chat_body(request: ReplayRequest, index: int) -> dict[str, Any]:
    """The chat body of trace request ``index`` (module docstring)."""
    body: dict[str, Any] = {
        "model": request.model,
        "messages": [{"role": "user", "content": prompt_text(request, index)}],
        "max_tokens": max(1, request.output_tokens),
        "stream": request.stream,
    }
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def request_body(request: ReplayRequest, index: int) -> bytes:
    """``chat_body`` as the bytes sent."""
    return orjson.dumps(chat_body(request, index))


def request_headers(request: ReplayRequest, *, api_key: str, send_class: str | None) -> dict[str, str]:
    """The tenant's bearer key, ``x-priority`` when a class is sent, ``x-session-id`` when recorded."""
    headers = {"authorization": f"Bearer {api_key}", "content-type": "application/json"}
    if send_class is not None:
        headers["x-priority"] = send_class
    if request.session is not None:
        headers["x-session-id"] = request.session
    return headers
