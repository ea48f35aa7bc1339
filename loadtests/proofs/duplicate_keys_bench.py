"""What refusing duplicate JSON keys costs on the request path, against the alternatives.

orjson keeps the last of two equal keys without a word, so the gateway checks separately
(``gateway/request/intake.py``). Measured per parse, best of several rounds, on a typical chat body
and on bodies of about 1 MiB of three shapes (one long text, token ids, many small objects):

* ``orjson``: ``orjson.loads`` and the old depth walk (what the gateway did before: no check);
* ``gateway``: ``parse_json_object`` (orjson, one walk counting members and colons, and
  ``bytes.count``; the exact slow path only when the counts disagree);
* ``json+hook``: the standard library's ``json.loads`` with an ``object_pairs_hook`` that
  refuses a repeated key (exact, used alone instead of orjson);
* ``orjson+hook``: orjson for the document, then the hooked ``json`` pass on every body.

Each body comes compact (what the OpenAI SDKs and ``JSON.stringify`` send: the gateway's
re-serialisation matches it byte for byte) and "spaced" (``json.dumps`` defaults, as
``requests`` sends: the gateway counts colons), plus one with a duplicate key at the end
(the exact path, which names the key).

Usage: ``python -m loadtests.proofs.duplicate_keys_bench [--rounds 7]``
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import orjson

from gateway.errors import InvalidRequest
from gateway.request.intake import parse_json_object

MAX_DEPTH = 32
MIB = 1 << 20


def typical_chat() -> bytes:
    return orjson.dumps(
        {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant. Answer briefly: one paragraph."},
                {"role": "user", "content": "What is the capital of France? Reply as 'City: name'."},
            ],
            "max_tokens": 128,
            "temperature": 0.7,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


def long_text() -> bytes:
    line = "Note: the meeting is at 10:30; see https://example.com/agenda for details.\n"
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": line * (MIB // len(line))}]})


def token_ids() -> bytes:
    return orjson.dumps({"model": "m", "prompt": [i % 50_000 for i in range(MIB // 6)], "max_tokens": 16})


def many_objects() -> bytes:
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a thing up: by id or name.",
            "parameters": {"type": "object", "properties": {"id": {"type": "string"}, "n": {"type": "integer"}}},
        },
    }
    messages = [{"role": "user", "content": f"turn {i}: hello"} for i in range(MIB // 400)]
    return orjson.dumps({"model": "m", "messages": messages, "tools": [tool] * (MIB // 400)})


def spaced(make: Callable[[], bytes]) -> Callable[[], bytes]:
    return lambda: json.dumps(orjson.loads(make())).encode()


def with_duplicate(make: Callable[[], bytes]) -> Callable[[], bytes]:
    return lambda: make()[:-1] + b',"model":"again"}'


def _refusing_hook(items: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in items:
        if key in seen:
            raise ValueError(key)
        seen[key] = value
    return seen


def _old_depth_walk(document: Any) -> bool:
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


PARSERS: dict[str, Callable[[bytes], object]] = {
    "orjson": lambda raw: _old_depth_walk(orjson.loads(raw)),
    "gateway": lambda raw: parse_json_object(raw, MAX_DEPTH),
    "json+hook": lambda raw: json.loads(raw, object_pairs_hook=_refusing_hook),
    "orjson+hook": lambda raw: (orjson.loads(raw), json.loads(raw, object_pairs_hook=_refusing_hook)),
}
SHAPES: dict[str, Callable[[], bytes]] = {
    "typical chat": typical_chat,
    "1 MiB text": long_text,
    "1 MiB token ids": token_ids,
    "1 MiB objects": many_objects,
}
BODIES: dict[str, Callable[[], bytes]] = {
    **SHAPES,
    **{f"{name}, spaced": spaced(make) for name, make in SHAPES.items()},
    **{f"{name}, duplicate": with_duplicate(make) for name, make in SHAPES.items()},
}


def _refusing(parse: Callable[[bytes], object]) -> Callable[[bytes], object]:
    """``parse``, with a refusal counted as a result (the duplicate rows refuse by design)."""

    def run(raw: bytes) -> object:
        try:
            return parse(raw)
        except (ValueError, InvalidRequest) as refused:
            return refused

    return run


def per_call_us(parse: Callable[[bytes], object], raw: bytes, rounds: int) -> float:
    """Microseconds a call, the best of ``rounds`` rounds of about 0.2 s each."""
    start = time.perf_counter()
    parse(raw)
    calls = max(1, int(0.2 / max(time.perf_counter() - start, 1e-7)))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            parse(raw)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"{'body':<30}{'bytes':>10}" + "".join(f"{name:>14}" for name in PARSERS) + "   (us per parse, best)")
    for body_name, make in BODIES.items():
        raw = make()
        row = [per_call_us(_refusing(parse), raw, args.rounds) for parse in PARSERS.values()]
        print(f"{body_name:<30}{len(raw):>10}" + "".join(f"{us:>14.1f}" for us in row))


if __name__ == "__main__":
    main()
