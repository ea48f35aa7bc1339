"""Timeouts on Redis counted in the event loop's free time, so that a busy process is not a slow Redis.

Here, in the shared-state stage, because every user of the shared store bounds its calls this way
(``SharedStore.budget``: ``gateway/shared/store.py``); it was the tenant limit store's alone once.

**Why.** A reply that Redis sends in 0.2 ms sits in the socket until the event loop gets to
read it. When one callback holds the loop for 60 ms (a large body parsed, a burst of
requests, another task's CPU), a plain ``asyncio.timeout(0.02)`` around the call expires in
the same loop iteration in which the reply is read, cancels the call, and the store declares
Redis lost: every process on a busy 2-core machine flipped to its local limits every second
or two while Redis was healthy (issue 28, item 4).

**How: a stall meter, and a deadline in free time.** ``LoopLag`` keeps a timer that asks to
run every ``tick_s`` (1 ms) while a Redis call is in flight; how late each tick runs, beyond
``slack_s`` (the 1 ms an idle loop's timers overshoot by: epoll waits in whole milliseconds),
is time the loop could not run it, held by callbacks, which it adds up (``stalled()``,
including a tick overdue right now). ``FreeTimeout`` is ``asyncio.timeout`` whose budget
counts only the time the loop was free: at its deadline it looks at how much of the wait was
stalled and, if the free part is still under the budget, waits the rest; only when
``budget_s`` of free time has passed without an answer does it cancel the call
(``TimeoutError``).

Why that is sound: the loop reads every socket that is ready at each iteration, I/O callbacks
first, and a timer can run at most once per iteration. So while the loop is busy, each of its
iterations is counted as stalled but for about ``tick_s + slack_s``, however long it is; and a
reply that arrived is read in the next iteration and handed to its caller in the one after.
A healthy Redis's answer therefore costs a call a few milliseconds of free time, whatever
holds the loop, while a call whose answer does not come is charged its whole wait when the
loop is idle (the free time is the wall time), and a couple of milliseconds for every
iteration when it is busy: a Redis slower than the budget is cut, later only in proportion to
how much of the time the loop had nothing else to do.

The price: under a loop that is stalled nearly all the time, the free time passes slowly and a
silent Redis is given up later; but then every request waits on the loop anyway, and Redis
keeps the wait no longer than the budget of the loop's own free time.

Chosen over looking into the socket at the deadline for a reply (it would need the client's
private buffers, and still misjudge a call whose *send* the stall delayed, or a connection
being opened in several round trips) and over a fixed margin (any margin is beaten by a
longer stall).
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class LoopLag:
    """Seconds the event loop was stalled, measured by a ticking timer while anyone measures.

    ``start()``/``stop()`` count the users (calls in flight): the timer runs only while one
    is, so an idle gateway does not wake up every millisecond."""

    def __init__(self, tick_s: float = 0.001, slack_s: float = 0.001) -> None:
        self.tick_s = tick_s
        self.slack_s = slack_s
        self._stalled = 0.0
        self._users = 0
        self._due = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None

    def stalled(self) -> float:
        """All stalls measured so far, the one in progress included (a tick overdue now)."""
        if self._handle is None or self._loop is None:
            return self._stalled
        return self._stalled + max(0.0, self._loop.time() - self._due - self.slack_s)

    def start(self) -> None:
        self._users += 1
        loop = asyncio.get_running_loop()
        if self._handle is None or loop is not self._loop:  # not ticking, or ticking on a loop now gone
            self._loop = loop
            self._schedule(loop.time())

    def stop(self) -> None:
        self._users -= 1

    def _schedule(self, now: float) -> None:
        assert self._loop is not None
        self._due = now + self.tick_s
        self._handle = self._loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        self._stalled += max(0.0, now - self._due - self.slack_s)
        if self._users > 0:
            self._schedule(now)
        else:
            self._handle = None


class FreeTimeout:
    """``async with FreeTimeout(lag, 0.02): await call()``: ``TimeoutError`` once the call has had
    ``budget_s`` of the loop's free time (module docstring) without finishing.

    ``free_s`` after the block: the free time it took, what a request's budget loses; ``wall_s``:
    the time it took in all."""

    def __init__(self, lag: LoopLag, budget_s: float) -> None:
        self.lag = lag
        self.budget_s = budget_s
        self.free_s = 0.0
        self.wall_s = 0.0
        self._timeout = asyncio.timeout(None)
        self._started = 0.0
        self._stalled_before = 0.0
        self._check: asyncio.TimerHandle | None = None

    def _free(self, loop: asyncio.AbstractEventLoop) -> float:
        return max(0.0, (loop.time() - self._started) - (self.lag.stalled() - self._stalled_before))

    async def __aenter__(self) -> FreeTimeout:
        loop = asyncio.get_running_loop()
        self.lag.start()
        self._started, self._stalled_before = loop.time(), self.lag.stalled()
        await self._timeout.__aenter__()
        self._check = loop.call_at(self._started + self.budget_s, self._on_deadline, loop)
        return self

    def _on_deadline(self, loop: asyncio.AbstractEventLoop) -> None:
        free = self._free(loop)
        if free >= self.budget_s:
            self._check = None
            self._timeout.reschedule(loop.time())  # cancels the call after what is already ready
        else:
            self._check = loop.call_at(loop.time() + self.budget_s - free, self._on_deadline, loop)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        loop = asyncio.get_running_loop()
        self.free_s, self.wall_s = self._free(loop), loop.time() - self._started
        if self._check is not None:
            self._check.cancel()
        self.lag.stop()
        await self._timeout.__aexit__(exc_type, exc, tb)  # raises TimeoutError when it expired
        return None


def timed_out(exc: BaseException, deadline: FreeTimeout) -> BaseException:
    """A timeout that says how long it waited, in free time and in all: a log that tells Redis from the loop."""
    if isinstance(exc, TimeoutError) and deadline.wall_s > 0:
        return TimeoutError(
            f"no answer within {deadline.free_s * 1000:.1f} ms of the event loop's free time "
            f"({deadline.wall_s * 1000:.1f} ms in all)"
        )
    return exc
