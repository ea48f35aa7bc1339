"""The Messages and Responses estimates count each message's texts in one pass.

Every ``estimator.count`` call has a fixed cost (about 2 us with the piece count of
``gateway/request/text_shape.py``), so a body of thousands of one-letter blocks counted block by block
cost tens of milliseconds of CPU before it could be refused: a shape that costs more than its
size. Counted as one text per message (as ``tokens.parts_tokens`` does for chat), the cost
follows the bytes. A function call's output given as parts is counted, not skipped.
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.dialects.messages import MESSAGES
from gateway.dialects.responses import RESPONSES
from gateway.policy.model import ModelPolicy, RequestLimits
from gateway.request.tokens import CharRatioEstimator

BLOCKS = 200
LIMITS = RequestLimits(max_content_parts=BLOCKS, max_messages=8)
MODEL = ModelPolicy(name="m", max_prompt_tokens=1_000_000)


class CountingEstimator:
    """The gateway's estimator, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self._inner = CharRatioEstimator()

    def count(self, text: str) -> int:
        self.calls += 1
        return self._inner.count(text)


TINY_BLOCKS: list[Any] = [
    pytest.param(
        MESSAGES,
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * BLOCKS}],
        },
        id="messages: one message of 200 text blocks",
    ),
    pytest.param(
        MESSAGES,
        {
            "model": "m",
            "max_tokens": 4,
            "messages": [
                {"role": "user", "content": "call it"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": 1}}] * BLOCKS,
                },
            ],
        },
        id="messages: 200 tool uses",
    ),
    pytest.param(
        RESPONSES,
        {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}] * BLOCKS}]},
        id="responses: one item of 200 text parts",
    ),
]


@pytest.mark.parametrize(("dialect", "body"), TINY_BLOCKS)
def test_a_messages_blocks_are_counted_in_one_call(dialect: Any, body: dict[str, Any]) -> None:
    estimator = CountingEstimator()
    tokens = dialect.prompt_tokens(body, MODEL, LIMITS, estimator)
    assert tokens >= BLOCKS  # every block is still at least a token
    assert estimator.calls <= 2 * len(body.get("messages") or body.get("input") or [])


def test_a_function_calls_output_given_as_parts_is_counted() -> None:
    words = " ".join(["word"] * 400)
    body = {
        "model": "m",
        "input": [
            {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": words}]},
        ],
    }
    assert RESPONSES.prompt_tokens(body, MODEL, LIMITS, CharRatioEstimator()) >= 400
