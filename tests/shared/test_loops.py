"""A gateway's shutdown ends its background loops even when one swallows its first cancellation.

Seen under ``serve --workers 2`` with Redis state: the prefix view's loop went back to sleep with
its cancel request consumed below it (in a Redis call cut by its own timeout), and the worker,
waiting for it, never exited. ``stop_loops`` cancels again, a bounded number of times.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from gateway.shared.loops import STOP_ROUND_S, STOP_ROUNDS, stop_loops


async def swallows_first_cancel(swallowed: asyncio.Event) -> None:
    """A loop whose first cancellation is consumed somewhere below it, as the library's was."""
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.Event().wait()
    swallowed.set()
    await asyncio.Event().wait()  # back to its sleep, as if nothing happened


async def honours_cancel() -> None:
    await asyncio.Event().wait()


async def test_a_loop_that_swallowed_its_cancellation_is_cancelled_again_and_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    swallowed = asyncio.Event()
    stubborn = asyncio.create_task(swallows_first_cancel(swallowed))
    polite = asyncio.create_task(honours_cancel())
    await asyncio.sleep(0)  # both started
    left = await stop_loops({stubborn, polite})
    assert left == set()
    assert swallowed.is_set()
    assert stubborn.cancelled()
    assert polite.cancelled()
    assert "1 background loop(s) ignored cancellation; again" in caplog.text


async def test_a_loop_that_never_ends_is_left_behind_after_a_bounded_wait() -> None:
    deaf = [True]

    async def immortal() -> None:
        while deaf[0]:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()

    task = asyncio.create_task(immortal())
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    left = await stop_loops({task})
    waited = loop.time() - started
    deaf[0] = False
    task.cancel()  # now it ends
    await asyncio.wait({task})
    assert left == {task}
    assert waited < STOP_ROUNDS * STOP_ROUND_S + 2.0  # bounded: the shutdown goes on without it
