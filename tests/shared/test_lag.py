"""``FreeTimeout``: a timeout counted in the event loop's free time (``gateway/shared/lag.py``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.shared.lag import FreeTimeout, LoopLag

BUDGET_S = 0.02


async def test_a_stall_that_hides_an_answer_does_not_expire_the_free_timeout() -> None:
    """The answer is there before the deadline, but the loop is held past it: a plain
    ``asyncio.timeout`` expires (the reply is read in the same iteration as its deadline),
    ``FreeTimeout`` does not."""
    loop = asyncio.get_running_loop()

    async def answered_during_a_stall() -> str:
        answer: asyncio.Future[str] = loop.create_future()
        loop.call_later(0.001, answer.set_result, "pong")
        loop.call_soon(time.sleep, 0.05)  # holds the loop past the 20 ms deadline
        return await answer

    with pytest.raises(TimeoutError):
        async with asyncio.timeout(BUDGET_S):
            await answered_during_a_stall()
    lag = LoopLag()
    async with FreeTimeout(lag, BUDGET_S) as deadline:
        assert await answered_during_a_stall() == "pong"
    assert deadline.free_s < BUDGET_S
    assert lag.stalled() >= 0.04


async def test_a_free_timeout_on_a_free_loop_expires_after_its_budget() -> None:
    """An idle loop's time is all free: the timeout is a plain one."""
    lag = LoopLag()
    started = time.perf_counter()
    with pytest.raises(TimeoutError):
        async with FreeTimeout(lag, BUDGET_S):
            await asyncio.sleep(1)
    took = time.perf_counter() - started
    assert BUDGET_S <= took < BUDGET_S + 0.03


async def test_a_busy_loop_charges_a_wait_a_little_per_iteration_not_its_length() -> None:
    """Iterations of 5 ms each (short callbacks, none a long stall): 100 ms of them cost a wait
    about the meter's tick and slack per iteration, well under the wall time."""
    loop = asyncio.get_running_loop()
    lag = LoopLag()
    done = loop.create_future()

    def busy(left: int) -> None:
        time.sleep(0.005)
        if left:
            loop.call_soon(busy, left - 1)
        else:
            done.set_result(None)

    loop.call_soon(busy, 20)
    async with FreeTimeout(lag, 1.0) as deadline:
        await done
    assert deadline.free_s < 0.06, f"{deadline.free_s * 1000:.0f} ms of 100 ms busy counted as free"
