"""Stopping background loops at shutdown: cancelled again when a cancellation was swallowed.

Why here, in the shared-state stage: the loops that swallow a cancellation are the ones that call
the shared store (a cancellation that lands while a Redis call is being cut by its own timeout
can be consumed below the loop), and every stage that runs such a loop sits above this one: the
fleet's ledger and prefix view, response sharing's retrier (``gateway/responses/sharing.py``),
the service's loops (``gateway/service.py``), a simulated process of ``loadtests/proofs/fleet_scale.py``.
The drain that comes before it is the server's (``gateway/server/lifecycle.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection

log = logging.getLogger(__name__)

STOP_ROUNDS = 10
STOP_ROUND_S = 0.5
"""A background loop gets ``STOP_ROUNDS`` cancellations ``STOP_ROUND_S`` apart to end at shutdown
(``stop_loops``): 5 s at most, inside uvicorn's lifespan shutdown."""


async def stop_loops(tasks: Collection[asyncio.Task[None]]) -> set[asyncio.Task[None]]:
    """Cancel ``tasks`` and wait until they end, cancelling again (``STOP_ROUNDS`` times
    ``STOP_ROUND_S`` at most) a task that swallowed its cancellation; the ones still running.

    Why again: a cancellation that lands while a Redis call is being cut by its own timeout can be
    consumed below the loop (seen: the prefix view's loop back asleep with its cancel request still
    counted, ``Task.cancelling() == 1``), and a shutdown that waited for it once kept the process
    alive for ever, a worker whose supervisor had died included."""
    pending = set(tasks)
    for round_ in range(STOP_ROUNDS):
        if not pending:
            break
        if round_:
            log.warning("shutdown: %d background loop(s) ignored cancellation; again", len(pending))
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=STOP_ROUND_S)
    return pending
