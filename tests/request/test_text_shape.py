"""What a text's bytes show about its tokens: pieces and kinds of character, and the two ways of
counting them (``bytes.count`` for short texts, numpy from ``VECTOR_FROM`` bytes) agreeing."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.request import text_shape
from gateway.request.text_shape import Leads, leads, pieces


@pytest.mark.parametrize(
    ("text", "count"),
    [
        pytest.param("a", 1, id="a letter"),
        pytest.param("hello world", 2, id="two words: the space joins the second"),
        pytest.param("a a a a", 4, id="single letters"),
        pytest.param("a\na\na", 5, id="newlines are pieces of their own"),
        pytest.param("!,!,!", 5, id="each mark"),
        pytest.param("1 2 3 4", 7, id="each digit, and each space before one"),
        pytest.param("a  b  c", 5, id="a run of two spaces or more"),
        pytest.param("   a", 2, id="a run of spaces at the start"),
        pytest.param("a^b^c", 5, id="letters after a mark"),
        pytest.param("a1b2", 4, id="letters after a digit"),
        pytest.param("abcdefghij" * 3, 4, id="one more per ten letters of a run"),
        pytest.param("é", 1, id="a non-ASCII character counts as a letter here"),
    ],
)
def test_pieces_of_a_text(text: str, count: int) -> None:
    assert pieces(text.encode()) == count


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("abc", Leads(0, 0, 0, 0), id="ASCII: nothing"),
        pytest.param("🙂🙂", Leads(2, 0, 0, 0), id="4-byte characters"),
        pytest.param("“a” — «b» e\u0301", Leads(0, 6, 0, 0), id="symbols, Latin-1 punctuation, combining marks"),
        pytest.param("éàß ŁŚ", Leads(0, 0, 5, 0), id="accented Latin"),
        pytest.param("你 好 世界", Leads(0, 0, 0, 2), id="3-byte characters after a space"),
    ],
)
def test_kinds_of_character(text: str, expected: Leads) -> None:
    assert leads(text.encode()) == expected


TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=3000) | st.text(
    alphabet=st.sampled_from(list("aZ09 \n\t!,.-'“”—é你🙂\u0301\u00a0")), max_size=3000
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXT)
def test_numpy_and_bytes_count_alike(text: str) -> None:
    data = text.encode("utf-8", "surrogatepass")
    if not data:
        return
    original = text_shape.VECTOR_FROM
    try:
        text_shape.VECTOR_FROM = len(data) + 1
        short = pieces(data), leads(data)
        text_shape.VECTOR_FROM = 0
        vector = pieces(data), leads(data)
    finally:
        text_shape.VECTOR_FROM = original
    assert short == vector
