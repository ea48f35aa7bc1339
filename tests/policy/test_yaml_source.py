"""``read_yaml``: a key written twice in one mapping is noted (and nothing built), whatever its depth;
merge keys and aliases still mean what YAML says."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from gateway.policy.yaml_source import StrictLoader, read_yaml


def repeated(text: str) -> list[tuple[str, int, int]]:
    """Each repeated key with the 1-based lines of its first and second occurrence."""
    document = read_yaml(text)
    assert document.data is None or not document.duplicates
    return [(d.key, d.first.start_mark.line + 1, d.second.start_mark.line + 1) for d in document.duplicates]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("a: 1\nb: 2\na: 3\n", [("a", 1, 3)], id="at the top level"),
        pytest.param("t:\n  limits: {rpm: 60}\n  limits: {rpm: 600000}\n", [("limits", 2, 3)], id="in a mapping"),
        pytest.param("l:\n  - {name: x, k: 1, k: 2}\n", [("k", 2, 2)], id="in a flow mapping inside a list"),
        pytest.param("a:\n  b:\n    c:\n      d: 1\n      d: 2\n", [("d", 4, 5)], id="four levels down"),
        pytest.param('a: 1\n"a": 2\n', [("a", 1, 2)], id="quoted and plain spellings of one key"),
        pytest.param("a: 1\na: 2\na: 3\n", [("a", 1, 2), ("a", 1, 3)], id="each repeat of a key thrice written"),
        pytest.param("x: {a: 1, a: 2}\ny: {b: 1, b: 2}\n", [("a", 1, 1), ("b", 2, 2)], id="every mapping's repeats"),
        pytest.param("d: &d {a: 1}\ne: {<<: *d, a: 2}\n", [], id="an explicit key over a merged one"),
        pytest.param("d: &d {a: 1}\nf: &f {a: 2}\ne: {<<: [*d, *f]}\n", [], id="the same key in two merged mappings"),
        pytest.param("d: &d {a: 1}\ne: {<<: *d, <<: *d}\n", [("<<", 2, 2)], id="the merge key itself twice"),
        pytest.param("a: &x {k: 1}\nb: *x\nc: *x\n", [], id="an alias used twice"),
    ],
)
def test_a_key_written_twice_in_one_mapping_is_noted(text: str, expected: list[tuple[str, int, int]]) -> None:
    assert repeated(text) == expected


@pytest.mark.parametrize(
    ("text", "data"),
    [
        pytest.param("d: &d {a: 1, b: 2}\ne: {<<: *d, a: 3}\n", {"a": 3, "b": 2}, id="explicit keys override merged"),
        pytest.param(
            "d: &d {a: 1}\nf: &f {a: 2, c: 4}\ne: {<<: [*d, *f]}\n",
            {"a": 1, "c": 4},
            id="the first mapping of a merge list wins",
        ),
        pytest.param(
            "d: &d {a: 1}\nm: &m {<<: *d, b: 2}\ne: {<<: *m, c: 3}\n", {"a": 1, "b": 2, "c": 3}, id="a merge of a merge"
        ),
        pytest.param(
            "s:\n  m: &m {<<: &d {rank: 0, slo: 1}, rank: 1}\ne: {<<: *m}\n",
            {"rank": 1, "slo": 1},
            id="a mapping that overrides what it merged, merged in turn",
        ),
    ],
)
def test_merges_build_what_safe_load_builds(text: str, data: dict[str, Any]) -> None:
    document = read_yaml(text)
    assert document.duplicates == ()
    assert document.data["e"] == data
    assert document.data == yaml.safe_load(text)


def test_the_loader_works_with_yaml_load_and_keeps_its_notes() -> None:
    loader = StrictLoader("a: 1\na: 2\n")
    try:
        assert loader.get_single_data() == {"a": 2}
        assert [d.key for d in loader.duplicates] == ["a"]
    finally:
        loader.dispose()


def test_an_empty_text_is_no_document() -> None:
    document = read_yaml("")
    assert (document.root, document.data, document.duplicates) == (None, None, ())


def test_bad_syntax_raises_the_parsers_error_with_its_mark() -> None:
    with pytest.raises(yaml.MarkedYAMLError) as caught:
        read_yaml("a: [1\n")
    assert caught.value.problem_mark is not None
