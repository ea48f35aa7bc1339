"""The tokenizer endpoints' prompts never share prefix keys with inference prompts: nothing is
cached by a ``/tokenize``, so the prefix router must not learn from one that a backend holds a
conversation (``gateway/dialects/tokenize.py``, ``TOKENIZER_KEYS``)."""

from __future__ import annotations

from array import array

from gateway.dialects.chat import CHAT
from gateway.dialects.completions import COMPLETIONS
from gateway.dialects.tokenize import DETOKENIZE, TOKENIZE

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, how are you?"}]


def test_a_tokenized_conversation_renders_apart_from_the_same_chat() -> None:
    chat = CHAT.render({"model": "m", "messages": MESSAGES})
    tokenized = TOKENIZE.render({"model": "m", "messages": MESSAGES})
    assert isinstance(chat, str)
    assert isinstance(tokenized, str)
    assert chat in tokenized  # the same text, for equal tokenize requests to meet on one backend
    assert not tokenized.startswith(chat[:1])  # but no common prefix: no prefix key in common


def test_a_tokenized_prompt_and_detokenized_ids_render_apart_from_the_same_completion() -> None:
    text = COMPLETIONS.render({"model": "m", "prompt": "Once upon a time"})
    tokenized = TOKENIZE.render({"model": "m", "prompt": "Once upon a time"})
    assert isinstance(text, str)
    assert isinstance(tokenized, str)
    assert not tokenized.startswith(text[:1])
    ids = COMPLETIONS.render({"model": "m", "prompt": [1, 2, 3]})
    detokenized = DETOKENIZE.render({"model": "m", "tokens": [1, 2, 3]})
    assert ids == array("I", [1, 2, 3])
    assert isinstance(detokenized, array)
    assert detokenized[1:] == ids
    assert detokenized[0] != ids[0]
