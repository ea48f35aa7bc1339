"""What a text's UTF-8 bytes show cheaply about its token count: pieces and kinds of character.

Read by the prompt estimate (``gateway/request/tokens.py``), which must bound a tokenizer's count
without running one.

* **Pieces** (``pieces``): the pre-tokenizer of a byte-level BPE vocabulary (Llama 3, Qwen,
  Mistral's Tekken, OpenAI's o200k/cl100k; ``\\p{L}+``, ``\\p{N}{1,3}``, punctuation runs,
  whitespace runs) cuts text into pieces, and every piece is at least one token. Counted here,
  one each: a run of letters (the space or mark before it joins it, as in those pre-tokenizers);
  a digit (Qwen, Tekken and SentencePiece vocabularies give every digit its own token); a mark
  (punctuation, symbol, tab, newline, control: BPE merges few of them, SentencePiece none); a
  space before a digit (digits take no space); a run of two spaces or more. Plus one per ten
  letters of a run, so that long words mixed with short ones are not left to the character
  count alone. Every byte of a non-ASCII character counts as a letter here: what those
  characters cost is ``Leads``.
* **Kinds of character** (``leads``): the UTF-8 lead bytes of 4-byte characters (emoji: up to a
  token a byte), of symbols and combining marks (each splits the word it touches), of accented
  Latin letters (the words around them are not English: ~3.5 characters a token), and of 3-byte
  characters after a space (``" 你"`` is two tokens in Qwen and Tekken).

**How**: one ``bytes.translate`` into a class per byte, then counts, no Python loop per byte.
A short text is counted with ``bytes.count`` (a C scan per pattern; about 2 us for a 250-byte
message, 5-6 us a KiB); from ``VECTOR_FROM`` bytes on, the transitions are counted with numpy
comparisons over the classes (about 10 us of set-up, then 1.6-3 us a KiB): the same counts,
``tests/request/test_text_shape.py`` checks that the two agree. Figures: ``loadtests/proofs/estimator_cost.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

VECTOR_FROM = 2048
"""Bytes from which numpy counts faster than ``bytes.count`` (``loadtests/proofs/estimator_cost.py``)."""

LONG_RUN = 10
"""Letters of a run per extra token."""


@dataclass(frozen=True, slots=True)
class Leads:
    """Counts of the UTF-8 lead bytes of a non-ASCII text, by kind (module docstring)."""

    astral: int
    symbols: int
    accented: int
    spaced_wide: int


def _byte_table(classify: Callable[[int], bytes]) -> bytes:
    return b"".join(classify(byte) for byte in range(256))


def _piece_class(byte: int) -> bytes:
    """``a`` letter (and every non-ASCII byte), ``d`` digit, space, ``.`` anything else."""
    char = chr(byte)
    if byte >= 0x80 or char.isalpha():
        return b"a"
    if char.isdigit():
        return b"d"
    return b" " if byte == 0x20 else b"."


def _lead_class(byte: int) -> bytes:
    """``4`` a 4-byte character; ``S`` a symbol or mark (U+0080-00BF: Latin-1 punctuation;
    U+0300-037F: combining accents; U+2000-2FFF: punctuation, arrows, maths, box drawing,
    dingbats); ``L`` accented Latin (U+00C0-017F); ``3`` another 3-byte character (CJK, kana,
    Hangul, Indic scripts); space; ``.`` anything else (ASCII, continuation bytes)."""
    if 0xF0 <= byte <= 0xF7:
        return b"4"
    if byte in (0xC2, 0xCC, 0xCD, 0xE2):
        return b"S"
    if 0xC3 <= byte <= 0xC5:
        return b"L"
    if 0xE0 <= byte <= 0xEF:
        return b"3"
    return b" " if byte == 0x20 else b"."


_PIECE_CLASS = _byte_table(_piece_class)
_LETTER_OR_NOT = _byte_table(lambda byte: b"a" if _piece_class(byte) == b"a" else b".")
_SPACE_OR_NOT = _byte_table(lambda byte: b" " if byte == 0x20 else b"x")
_LEAD_CLASS = _byte_table(_lead_class)
_LONG = b"a" * LONG_RUN
_LETTER, _SPACE, _DIGIT = ord("a"), ord(" "), ord("d")


def pieces(data: bytes) -> int:
    """Pieces of ``data`` (module docstring); ``data`` not empty."""
    classes = data.translate(_PIECE_CLASS)
    total = classes.count(_LONG)  # non-overlapping, so floor(length / 10) per run
    total += len(classes.translate(None, b"a "))  # marks and digits
    total += (classes[0] == _LETTER) + (classes[:2] == b"  ")  # a letter run, a run of spaces at the start
    if len(data) >= VECTOR_FROM:
        return total + _transitions(np.frombuffer(classes, dtype=np.uint8))
    total += data.translate(_LETTER_OR_NOT).count(b".a") + classes.count(b" d")
    if data.find(b"  ") >= 0:  # one C scan, cheaper than the two that count runs of spaces
        total += data.translate(_SPACE_OR_NOT).count(b"x  ")
    return total


def _transitions(classes: npt.NDArray[np.uint8]) -> int:
    """Letter runs after the first byte, spaces before a digit, runs of two spaces or more after
    the first byte: the counts ``pieces`` takes from ``bytes.count`` on a short text."""
    letter, space = classes == _LETTER, classes == _SPACE
    pairs = space[:-1] & space[1:]  # pairs[i]: bytes i and i+1 are spaces
    return int(
        np.count_nonzero(letter[1:] > letter[:-1])
        + np.count_nonzero(space[:-1] & (classes[1:] == _DIGIT))
        + np.count_nonzero(pairs[1:] > pairs[:-1])
    )


def leads(data: bytes) -> Leads:
    """Lead-byte counts of ``data`` (module docstring)."""
    kinds = data.translate(_LEAD_CLASS)
    if len(data) < VECTOR_FROM:
        return Leads(kinds.count(b"4"), kinds.count(b"S"), kinds.count(b"L"), kinds.count(b" 3"))
    codes = np.frombuffer(kinds, dtype=np.uint8)
    return Leads(
        int(np.count_nonzero(codes == ord("4"))),
        int(np.count_nonzero(codes == ord("S"))),
        int(np.count_nonzero(codes == ord("L"))),
        int(np.count_nonzero((codes[:-1] == _SPACE) & (codes[1:] == ord("3")))),
    )
