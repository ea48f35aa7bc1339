"""A tiny real Hugging Face tokenizer for tests and the simulator: one id per byte, no download.

Why: the engine-side token ids (``gateway/request/engine_tokens.py``) and their block hashes
are only worth testing against a real ``tokenizers.Tokenizer`` (added tokens, post-processor,
``add_special_tokens``), yet no model's vocabulary can be fetched here. This one is built in
code: a BPE model over the 256 byte-level symbols with no merges, so a text's ids are its UTF-8
bytes (``ids == list(text.encode())``), known by eye and deterministic, plus three special
tokens, ``<|im_start|>`` (256), ``<|im_end|>`` (257) and ``<s>`` (258, the BOS that
``add_special_tokens=True`` prepends). The ChatML template beside the simulator
(``loadtests/sim/chat_template.jinja``) writes the first two.

Usage::

    tokenizer = byte_level_tokenizer()
    tokenizer.encode("<|im_start|>hi", add_special_tokens=False).ids   # [256, 104, 105]
    write_tokenizer(tmp_path)                                         # tmp_path/"tokenizer.json"
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

IM_START, IM_END, BOS = "<|im_start|>", "<|im_end|>", "<s>"
SPECIAL_TOKENS = (IM_START, IM_END, BOS)
"""In id order from 256."""

IM_START_ID, IM_END_ID, BOS_ID = 256, 257, 258


def byte_symbols() -> list[str]:
    """GPT-2's byte-to-symbol table (what the ByteLevel pre-tokenizer writes), indexed by byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + shifted)
            shifted += 1
    return [symbols[b] for b in range(256)]


def byte_level_tokenizer() -> Tokenizer:
    """A fresh tokenizer: byte ids 0-255, then the special tokens (module docstring)."""
    vocab = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tokenizer


def write_tokenizer(path: str | Path) -> Path:
    """Save the tokenizer as ``tokenizer.json`` (``path`` a directory) or at ``path``; the file written."""
    target = Path(path)
    if target.is_dir():
        target = target / "tokenizer.json"
    byte_level_tokenizer().save(str(target))
    return target
