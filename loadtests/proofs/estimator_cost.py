"""CPU of the chat prompt estimate (``gateway/dialects/chat.py``) per request body, against an older estimator.

Usage::

    python -m loadtests.proofs.estimator_cost [--before OLD_TREE/gateway/tokens.py] [--repeat 2000] [--pin CPU]

Bodies: a typical chat (a system prompt and four turns, ~2 KB), the same with four tools and a
tool call, 1 MiB chats of one English string, CJK text, 512 messages, source code, and two
shapes made to look cheap (single-letter words, punctuation), and a chat of 512 messages of 30
tiny text parts each (about the most strings the default container cap lets a body hold). Each
is estimated ``--repeat`` times (the large bodies: 20) and the best of five runs is reported,
in microseconds per body and per KB of text, with the estimate itself. ``--before`` loads the
``CharRatioEstimator`` of another tree's ``gateway/request/tokens.py`` and runs it under this tree's
``chat_prompt_tokens``, alternating with this tree's estimator body by body in the same
process: the ratio is the figure to read, not the absolute time (the machine is shared; its
load average is printed). ``--pin`` pins the process to one core (``loadtests/harness/processes.py``
``pin``), as the other benches do.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson

import gateway.pipeline.handler
from gateway.dialects.chat import chat_prompt_tokens
from gateway.policy.model import MediaTokens
from gateway.request.tokens import CharRatioEstimator, TokenEstimator
from loadtests.harness.processes import pin

MIB = 1024 * 1024
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, now or on a day.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "day": {"type": "string", "format": "date"}},
            "required": ["city"],
        },
    },
}


def _user(text: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


def _mib_of(text: str) -> str:
    return (text * (MIB // len(text) + 1))[:MIB]


def bodies() -> dict[str, dict[str, Any]]:
    system = {"role": "system", "content": "You are a concise assistant for an engineering team. " * 4}
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "A question or an answer of some length. " * 6}
        for i in range(4)
    ]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    tools = {
        "model": "m",
        "messages": [
            system,
            *turns,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 21}'},
        ],
        "tools": [TOOL] * 4,
    }
    per_message = MIB // 512
    return {
        "typical chat (~2 KB)": {"model": "m", "messages": [system, *turns]},
        "chat with 4 tools and a tool call": tools,
        "1 MiB English string": _user("word " * (MIB // 5)),
        "1 MiB CJK string": _user("漢字かな" * (MIB // 12)),
        "1 MiB in 512 messages": {"model": "m", "messages": [{"role": "user", "content": "x" * per_message}] * 512},
        "1 MiB of source code": _user(_mib_of(inspect.getsource(gateway.pipeline.handler))),
        "1 MiB of 'a a a'": _user("a " * (MIB // 2)),
        "1 MiB of '!,!,'": _user("!," * (MIB // 2)),
        "15,360 tiny text parts": {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": f"w{i} x{j}"} for j in range(30)]}
                for i in range(512)
            ],
        },
    }


def text_kb(body: dict[str, Any]) -> float:
    """KB of text the estimate reads: the body's JSON, a close enough measure of its strings."""
    return len(orjson.dumps(body)) / 1024


def best_us(estimate: Callable[[dict[str, Any]], int], body: dict[str, Any], repeat: int) -> tuple[float, int]:
    result = estimate(body)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeat):
            estimate(body)
        best = min(best, (time.perf_counter() - started) / repeat)
    return best * 1e6, result


def load_before(path: str) -> TokenEstimator:
    """The ``CharRatioEstimator`` of another tree's ``tokens.py`` (its own module, not this tree's)."""
    spec = importlib.util.spec_from_file_location("tokens_before", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    estimator: TokenEstimator = module.CharRatioEstimator()
    return estimator


def chat_estimate(estimator: TokenEstimator) -> Callable[[dict[str, Any]], int]:
    media = MediaTokens()
    return lambda body: chat_prompt_tokens(body, estimator, media)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--before", default=None, help="another tree's gateway/request/tokens.py")
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--pin", type=int, default=None, help="pin this process to one core")
    args = parser.parse_args(argv)
    if args.pin is not None and pin(args.pin):
        os.sched_setaffinity(0, {args.pin})
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    command = " ".join(argv or sys.argv[1:])
    print(f"# python -m loadtests.proofs.estimator_cost {command} ; load average at start: {load}")
    after = chat_estimate(CharRatioEstimator())
    before = chat_estimate(load_before(args.before)) if args.before else None
    for name, body in bodies().items():
        repeat = 20 if "MiB" in name or "parts" in name else args.repeat
        kb = text_kb(body)
        after_us, after_tokens = best_us(after, body, repeat)
        line = f"{name:34s} now {after_us:9.1f} us {after_us / kb:6.2f} us/KB ({after_tokens:>7} tokens)"
        if before is not None:
            before_us, before_tokens = best_us(before, body, repeat)
            line += f" | before {before_us:9.1f} us ({before_tokens:>7} tokens) | x{after_us / before_us:.2f}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
