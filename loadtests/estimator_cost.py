"""CPU of the chat prompt estimate (``gateway/dialects/chat.py``) per request body, optionally against an older one.

Usage::

    python -m loadtests.estimator_cost [--before OLD_TREE/gateway/tokens.py] [--repeat 2000]

Bodies: a typical chat (a system prompt and four turns, ~2 KB), the same with four tools and a
tool call, a 1 MiB chat of one English string, a 1 MiB chat of CJK text, and a 1 MiB chat of
512 messages. Each is estimated ``--repeat`` times (1 MiB bodies: 50) and the best of five
runs is reported, in microseconds per body, with the estimate itself: a figure to compare
between trees in one run, not an absolute (the machine is shared). ``--before`` loads the
``tokens.py`` of an older tree (whose ``chat_prompt_tokens`` took the messages only); to compare
with a tree of the same shape, run this module in each tree.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from typing import Any

from gateway.dialects.chat import chat_prompt_tokens
from gateway.policy.model import MediaTokens
from gateway.tokens import CharRatioEstimator

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


def bodies() -> dict[str, dict[str, Any]]:
    system = {"role": "system", "content": "You are a concise assistant for an engineering team. " * 4}
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "A question or an answer of some length. " * 6}
        for i in range(4)
    ]
    typical = {"model": "m", "messages": [system, *turns]}
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
        "typical chat (~2 KB)": typical,
        "chat with 4 tools and a tool call": tools,
        "1 MiB English string": {"model": "m", "messages": [{"role": "user", "content": "word " * (MIB // 5)}]},
        "1 MiB CJK string": {"model": "m", "messages": [{"role": "user", "content": "漢字かな" * (MIB // 12)}]},
        "1 MiB in 512 messages": {"model": "m", "messages": [{"role": "user", "content": "x" * per_message}] * 512},
    }


def best_us(estimate: Callable[[dict[str, Any]], int], body: dict[str, Any], repeat: int) -> tuple[float, int]:
    result = estimate(body)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(repeat):
            estimate(body)
        best = min(best, (time.perf_counter() - started) / repeat)
    return best * 1e6, result


def load_before(path: str) -> Callable[[dict[str, Any]], int]:
    spec = importlib.util.spec_from_file_location("tokens_before", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    estimator = module.CharRatioEstimator()
    return lambda body: int(module.chat_prompt_tokens(body["messages"], estimator))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--before", default=None, help="an older tree's gateway/tokens.py")
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args(argv)
    estimator, media = CharRatioEstimator(), MediaTokens()
    after: Callable[[dict[str, Any]], int] = lambda body: chat_prompt_tokens(body, estimator, media)  # noqa: E731
    before = load_before(args.before) if args.before else None
    for name, body in bodies().items():
        repeat = 50 if "MiB" in name else args.repeat
        after_us, after_tokens = best_us(after, body, repeat)
        line = f"{name:36s} now {after_us:10.1f} us ({after_tokens:>7} tokens)"
        if before is not None:
            before_us, before_tokens = best_us(before, body, repeat)
            line += f" | before {before_us:10.1f} us ({before_tokens:>7} tokens) | x{after_us / before_us:.2f}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
