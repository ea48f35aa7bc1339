"""The hand-off between an engine and the HTTP layer: one `TokenStream` per request.

The engine pushes token indices and a finish reason; the HTTP writer drains whatever has
accumulated since it last looked, so a slow writer sends several tokens in one write instead
of falling further behind. No asyncio.Queue: a list and one future keep the per-token cost low.
"""

from __future__ import annotations

import asyncio
import enum


class FinishReason(enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


class TokenStream:
    """Tokens produced for one request, in order; `drain()` waits for the next batch."""

    __slots__ = (
        "_pending",
        "_waiter",
        "arrival",
        "cached_tokens",
        "end_at",
        "finish_reason",
        "first_at",
        "num_tokens",
        "prompt_tokens",
    )

    def __init__(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        # Engine clock stamps (seconds), for llama.cpp's timings (usage_report.py): arrival, first
        # token, end; an engine sets them once each, no per-token cost. 0.0 when none was taken.
        self.arrival = 0.0
        self.first_at = 0.0
        self.end_at = 0.0
        self.num_tokens = 0
        self.finish_reason: FinishReason | None = None
        self._pending: list[int] = []
        self._waiter: asyncio.Future[None] | None = None

    def push(self, index: int) -> None:
        self._pending.append(index)
        self.num_tokens = index + 1
        self._wake()

    def finish(self, reason: FinishReason) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self._wake()

    async def drain(self) -> list[int]:
        """Token indices produced since the last call; [] only once the stream is finished."""
        while not self._pending and self.finish_reason is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        batch, self._pending = self._pending, []
        return batch

    async def wait_finished(self) -> None:
        while self.finish_reason is None:
            await self.drain()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
