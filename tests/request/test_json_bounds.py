"""The raw-bytes structure scan: exact depth and container counts, and hostile bodies refused.

The shapes are the ones profiled for the issue (about 900 KiB each): each is either refused by
a structural bound before it is parsed, or cheap to parse; the CPU each costs is measured by
``python -m loadtests.proofs.hostile_tenant``, not asserted here.
"""

from __future__ import annotations

import json
import random
from typing import Any

import orjson
import pytest

from gateway.errors import InvalidRequest
from gateway.request.intake import parse_json_object
from gateway.request.json_bounds import SCAN_FROM_BYTES, check_structure, scan, structure


def reference(document: Any) -> tuple[int, int, int]:
    """Depth, containers and keys by walking the parsed document (what the scan must agree with)."""
    if isinstance(document, dict):
        children = [reference(v) for v in document.values()]
        keys = len(document)
    elif isinstance(document, list):
        children = [reference(v) for v in document]
        keys = 0
    else:
        return 0, 0, 0
    depth = 1 + max((d for d, _, _ in children), default=0)
    return depth, 1 + sum(c for _, c, _ in children), keys + sum(k for _, _, k in children)


def random_document(rng: random.Random, depth: int = 0) -> Any:
    tricky = ['a"b', "back\\slash\\", "[{", '}]":', "\\", '\\"', "漢字 ü", "", "k: v"]
    roll = rng.random()
    if depth > 6 or roll < 0.35:
        return rng.choice([rng.choice(tricky), rng.randint(-5, 5), 1.5, True, None])
    if roll < 0.7:
        return [random_document(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(tricky) + str(i): random_document(rng, depth + 1) for i in range(rng.randint(0, 4))}


@pytest.mark.parametrize("seed", range(40))
def test_the_scan_agrees_with_a_walk_of_the_parsed_document(seed: int) -> None:
    document = {"model": "m", "x": random_document(random.Random(seed))}
    assert structure(orjson.dumps(document)) == reference(document)


def colon_escapes(raw: bytes) -> int:
    """``\\u003a`` escapes by reading the text as a JSON parser does: escaped backslashes first."""
    stripped = raw.replace(b"\\\\", b"")
    return stripped.count(b"\\u003a") + stripped.count(b"\\u003A")


def escaped_text(rng: random.Random) -> str:
    """Text of backslashes, quotes, colons and ``u003a`` look-alikes; ``§`` and ``¤`` become real
    ``\\u003a`` and ``\\u003A`` escapes in the JSON text (``spelled``)."""
    pieces = ["x", ":", "\\", '"', "§", "¤", "\\u003a", "\\\\§", "\\\\\\u003A", "é", "[", "}", "u003a"]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))


def spelled(text: str) -> str:
    """The sentinels as colon escapes, whether ``json.dumps`` wrote them as is or escaped them."""
    for sentinel, escape in (("§", "\\u003a"), ("¤", "\\u003A")):
        text = text.replace(sentinel, escape).replace(f"\\u{ord(sentinel):04x}", escape)
    return text


@pytest.mark.parametrize("seed", range(40))
def test_the_scan_counts_every_colon_and_colon_escape_of_any_spacing(seed: int) -> None:
    rng = random.Random(seed)
    document = {"model": "m", "x": random_document(rng), escaped_text(rng): [escaped_text(rng), {"k": "v"}]}
    indent = rng.choice([None, 1])
    raw = spelled(json.dumps(document, indent=indent, ensure_ascii=rng.random() < 0.5)).encode()
    found = scan(raw)
    assert (found.depth, found.containers, found.keys) == reference(json.loads(raw))
    assert found.colons == raw.count(b":")
    assert found.colon_escapes == colon_escapes(raw)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(b'{"a": "[[[[{{{{::"}', (1, 1, 1), id="brackets and colons inside a string do not count"),
        pytest.param(b'{"a": "\\"[[", "b": [1]}', (2, 2, 2), id="an escaped quote does not end the string"),
        pytest.param(b'{"a": "\\\\", "b": [[1]]}', (3, 3, 2), id="an escaped backslash before the closing quote"),
        pytest.param(b"[]", (1, 1, 0), id="an empty array"),
    ],
)
def test_strings_and_escapes_are_skipped(text: bytes, expected: tuple[int, int, int]) -> None:
    assert structure(text) == expected


KIB = 1024


def hostile(shape: str) -> bytes:
    """About 900 KiB of the named shape."""
    target = 900 * KIB
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    if shape == "many messages":
        body["messages"] = [{"role": "user", "content": "hi"}] * (target // 31)
    elif shape == "many tiny parts":
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "a"}] * (target // 27)}]
    elif shape == "deep allowed nesting":
        node: Any = 1
        for _ in range(28):
            node = [node]
        body["tools"] = [node] * (target // 59)
    elif shape == "many keys":
        body.update({f"k{i}": 1 for i in range(target // 10)})
    elif shape == "many numbers":
        body["logit_bias"] = [1] * (target // 2)
    elif shape == "one giant string":
        body["messages"] = [{"role": "user", "content": "x" * target}]
    return orjson.dumps(body)


@pytest.mark.parametrize(
    ("shape", "outcome"),
    [
        pytest.param("many messages", "too_complex", id="30k messages are refused before parsing"),
        pytest.param("many tiny parts", "too_complex", id="33k content parts are refused before parsing"),
        pytest.param("deep allowed nesting", "too_complex", id="450k nested arrays within the depth are refused"),
        pytest.param("many keys", "too_complex", id="92k keys are refused before parsing"),
        pytest.param("many numbers", "parsed", id="460k numbers parse (cheap: no containers)"),
        pytest.param("one giant string", "parsed", id="one 900 KiB string parses"),
    ],
)
def test_hostile_900_kib_bodies_are_refused_by_structure_or_cheap_to_parse(shape: str, outcome: str) -> None:
    raw = hostile(shape)
    assert len(raw) > 850 * KIB
    try:
        parse_json_object(raw, 32, 16_384, 16_384)
        result = "parsed"
    except InvalidRequest as refused:
        result = refused.code
    assert result == outcome


def test_the_bounds_name_the_limit() -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_structure(b"[" * 40 + b"]" * 40, max_depth=32, max_containers=100, max_keys=100)
    assert (refused.value.code, refused.value.message) == ("too_deep", "Request JSON is nested deeper than 32 levels.")
    with pytest.raises(InvalidRequest) as refused:
        check_structure(b"[" + b"[]," * 200 + b"[]]", max_depth=32, max_containers=100, max_keys=100)
    assert refused.value.code == "too_complex"
    assert "202 objects and arrays; the limit is 100" in refused.value.message
    with pytest.raises(InvalidRequest) as refused:
        check_structure(orjson.dumps({f"k{i}": 1 for i in range(101)}), max_depth=32, max_containers=100, max_keys=100)
    assert "101 object keys; the limit is 100" in refused.value.message


def backslash_run(rng: random.Random) -> str:
    """Escaped backslashes (``\\\\``, up to 12 backslashes), then
    ``u003a`` as text or as an escape, or another escape, or a letter: always valid JSON."""
    run = "\\\\" * rng.randint(0, 6)
    return run + rng.choice(["u003a", "\\u003a", "\\u003A", "u003A", "\\u0030", "x", "\\n"])


@pytest.mark.parametrize("seed", range(30))
def test_colon_escapes_after_backslash_runs_of_any_length_are_counted_exactly(seed: int) -> None:
    """An escape is the byte after a backslash run of odd length, whatever the run's length, and
    whether or not the text also holds an escaped quote."""
    rng = random.Random(seed)
    raw = ('{"k": "' + "".join(backslash_run(rng) for _ in range(40)) + '"}').encode()
    json.loads(raw)  # valid JSON
    assert scan(raw).colon_escapes == scan(raw[:-2] + b'\\""}').colon_escapes == colon_escapes(raw)


def values(document: Any) -> int:
    """Array elements and object members, plus one per empty container (what the scan counts)."""
    if isinstance(document, dict):
        return (len(document) or 1) + sum(values(v) for v in document.values())
    if isinstance(document, list):
        return (len(document) or 1) + sum(values(v) for v in document)
    return 0


@pytest.mark.parametrize("seed", range(40))
def test_the_scan_counts_every_array_element_and_object_member(seed: int) -> None:
    document = {"model": "m", "x": random_document(random.Random(seed)), "ids": list(range(seed))}
    assert scan(orjson.dumps(document)).values == values(document)
    assert scan(json.dumps(document, indent=1).encode()).values == values(document)


@pytest.mark.parametrize(
    ("count", "refused"),
    [
        pytest.param(5_000, False, id="a body of 5,000 numbers within the bound is parsed"),
        pytest.param(5_001, True, id="one more number is refused before parsing"),
    ],
)
def test_a_body_of_more_values_than_the_bound_is_refused_before_parsing(count: int, refused: bool) -> None:
    raw = orjson.dumps({"prompt": list(range(count - 1))})  # the object's one member, then the list's
    assert len(raw) >= SCAN_FROM_BYTES
    if refused:
        with pytest.raises(InvalidRequest) as error:
            parse_json_object(raw, max_depth=32, max_values=5_000)
        assert error.value.code == "too_complex"
        assert "array elements and object members" in error.value.message
    else:
        assert len(parse_json_object(raw, max_depth=32, max_values=5_000)["prompt"]) == count - 1
