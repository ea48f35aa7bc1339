"""Graceful drain: on SIGTERM stop taking work, let streams finish, then exit 0.

uvicorn's own shutdown closes the listening socket at once, so a load balancer that has not
yet seen the pod leave gets connection errors. A drain instead:

1. marks the gateway draining: ``/readyz`` fails at once (the balancer stops sending), and new
   inference requests get 503 ``draining`` with ``Retry-After`` (the client's SDK retries,
   and lands on another replica);
2. keeps serving what is in flight, streams included, until nothing is left or the policy's
   ``drain_timeout_s`` passes;
3. then hands over to uvicorn's shutdown, which closes the sockets and runs the lifespan
   shutdown (the upstream client is closed there, cutting whatever still runs).

A second SIGTERM or SIGINT skips the wait. The process exits 0 either way.

A worker of ``serve --workers N`` (``gateway/workers/``) waits once more between 2 and 3
(``after_drain``): until every worker of the set has drained, so that the set keeps answering
503 ``draining`` on the whole port until its last stream ends, as one gateway does.

Once drained, the gateway's background loops are stopped by ``stop_loops``
(``gateway/shared/loops.py``), which cancels a loop again when a cancellation was swallowed below
it: a shutdown must end, whatever a library does with a ``CancelledError``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

log = logging.getLogger(__name__)


class Drainable:
    """What a drain needs from the gateway: a switch, a count of work in flight, a wait until
    that count is zero, and the policy's drain timeout."""

    def __init__(
        self,
        start: Callable[[], None],
        in_flight: Callable[[], int],
        idle: Callable[[], Awaitable[object]],
        timeout_s: Callable[[], float],
    ) -> None:
        self.start = start
        self.in_flight = in_flight
        self.idle = idle
        self.timeout_s = timeout_s


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM drains (see the module docstring) before exiting."""

    def __init__(
        self,
        config: uvicorn.Config,
        drainable: Callable[[], Drainable | None],
        after_drain: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(config)
        self._drainable = drainable
        self._after_drain = after_drain
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        target = self._drainable()
        if self._drain_task is not None or target is None:
            super().handle_exit(sig, frame)  # second signal, or nothing started yet: stop now
            return
        # A signal handler runs between two bytecodes of the loop: schedule, don't act here.
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(self._begin_drain, target)

    def _begin_drain(self, target: Drainable) -> None:
        if self._drain_task is None:
            target.start()
            self._drain_task = asyncio.get_running_loop().create_task(self._drain(target))

    async def _drain(self, target: Drainable) -> None:
        timeout_s = target.timeout_s()
        log.warning("draining: %d requests in flight, up to %.0fs", target.in_flight(), timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                await target.idle()
        except TimeoutError:
            pass
        left = target.in_flight()
        if left:
            log.warning("drain timeout: %d requests still in flight are cut", left)
        else:
            log.warning("drained: no request in flight")
        if self._after_drain is not None:
            await self._after_drain()
        # Not super().handle_exit: uvicorn would re-raise the signal after shutdown and the
        # process would die of SIGTERM; a completed drain is a clean exit (status 0).
        self.should_exit = True
