"""The process's one handle on the shared store: one Redis client and pool, one way to bound a call
to it, one error mapping, one health, one close.

Why one: the tenant limit store, the ledger, the prefix view, response affinity and the
rollouts' store each used to open a client from the policy's ``state`` by hand, with its own
options (the limit store without retries or socket timeouts, the others with redis-py's ten
hidden retries), its own timeouts (in the loop's free time for some, in wall time for others),
its own tuple of failures, and a health gauge that only the limit store fed. Now
``SharedStore.from_state`` reads ``state`` once and opens one client (``redis://``,
``rediss://``, ``unix://``, ``redis+sentinel://`` or ``redis+cluster://``:
``gateway/shared/connect.py``); every feature uses it, and redis-py's pool gives each concurrent
call its own connection, so one feature's slow script does not hold another's command. Features
never close it: ``aclose`` here does, once, at shutdown.

**The client's options fit every user** (``client_options``): no socket timeouts and no retries.
A timeout in the socket counts wall time, and would cut a reply that waited only because the
event loop was busy; a retry hides a failure behind more waiting (redis-py retries ten times by
default), where the limit store must fall back at once. Every call is bounded instead by its
caller's budget, in the loop's free time.

**One way to bound a call**: ``async with shared.budget(seconds):`` around the call, ``seconds``
the caller's (a request's budget left, ``fleet.timeout_ms`` for the ledger, ...) or, by default,
the policy's ``state.timeout_ms``. It counts only the time the event loop was free to read the
answer (``gateway/shared/lag.py``: one ``LoopLag`` for the process), and a budget that runs out
raises ``TimeoutError`` saying how long it waited, in free time and in all.

**One health**, judged from every call bounded so (``up``, exported as ``gateway_redis_up``):
Redis is up while calls are answered within ``state.timeout_ms`` of free time, down from the
first call that fails (``FAILURES``) or is answered later than that, until a call is answered
within it again. A budget shorter than ``state.timeout_ms`` that runs out (a request's last
milliseconds) tells nothing of Redis and changes nothing; neither does a call cancelled by its
caller. So the gauge means what it did when only the limit store fed it: Redis unreachable, or
slower than ``state.timeout_ms``; a feature with a longer budget (the ledger's sync, the
rollouts') still gets its answer from a slow Redis, and the gauge still says it is slow.

Usage::

    shared = SharedStore.from_state(snapshot.policy.state)   # client None under state.backend: memory
    FleetLedger(shared.client, key_prefix=shared.key_prefix, ...)
    store = SharedStore.of(client)                            # a feature finds the store of its client
    async with store.budget(0.2):                             # one call, bounded in free time
        await client.ping()
    except FAILURES: ...                                      # what a call to it may end in
    await shared.aclose()

A feature is handed the client (its constructor is the one tests and benches call with a client
of their own) and finds its store with ``SharedStore.of``: the store that opened the client, the
process's one; or, for a client opened elsewhere, a store around it that opens and closes nothing.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.policy.model import StatePolicy
from gateway.shared.connect import RedisClient, redis_client
from gateway.shared.lag import FreeTimeout, LoopLag, timed_out

FAILURES = (RedisError, OSError, TimeoutError)
"""What a call to the shared store may end in when the store, not the caller, failed: Redis's
own errors, the connection's, and a budget that ran out."""
DEFAULT_TIMEOUT_S = StatePolicy.model_fields["timeout_ms"].default / 1000
"""The policy's default ``state.timeout_ms``: the budget of a store around a client opened elsewhere."""

_STORES: weakref.WeakValueDictionary[int, SharedStore] = weakref.WeakValueDictionary()
"""Each live store by ``id`` of its client (a store holds its client, so the id names no other)."""


def client_options() -> dict[str, Any]:
    """The options of the store's client, the same for every user (module docstring)."""
    return {
        "socket_timeout": None,  # every call is bounded by its caller, in the loop's free time
        "socket_connect_timeout": None,  # the connection's handshake too: it is part of the call
        "retry": Retry(NoBackoff(), 0),  # a failure surfaces at once: the limit store falls back on it
        "health_check_interval": 0,
    }


def store_url(state: StatePolicy) -> str | None:
    """The Redis URL the policy's ``state`` puts in force, or None when state is in memory."""
    return state.resolved_url() if state.backend == "redis" else None


@dataclass(eq=False)
class SharedStore:
    """The shared store of one process (module docstring); ``client`` is None when state is in memory.

    ``SharedStore(client)`` is a store around a client opened elsewhere: it bounds and judges
    calls, and its ``aclose`` closes the client only with ``owns_client``."""

    client: RedisClient | None
    key_prefix: str = "gw:"
    timeout_s: float = DEFAULT_TIMEOUT_S
    """The policy's ``state.timeout_ms``: a call's budget unless its caller names one, and how
    slow an answer may be before Redis counts as slow (module docstring)."""
    owns_client: bool = False
    lag: LoopLag = field(default_factory=LoopLag)
    """The event loop's stalls, measured while any call of the process is in flight."""
    up: bool = True
    """Redis's health as the calls found it (module docstring); optimistic until a call tells."""
    closed: bool = False

    def __post_init__(self) -> None:
        if self.client is not None:
            _STORES[id(self.client)] = self

    @classmethod
    def from_state(cls, state: StatePolicy) -> SharedStore:
        """The process's store: open on the Redis ``state`` names, or without a client (memory)."""
        url = store_url(state)
        if url is None:
            return cls(None, state.key_prefix, state.timeout_ms / 1000)
        return cls.open(url, key_prefix=state.key_prefix, timeout_s=state.timeout_ms / 1000)

    @classmethod
    def open(cls, url: str, *, key_prefix: str = "gw:", timeout_s: float = DEFAULT_TIMEOUT_S) -> SharedStore:
        """A store with a client of its own on ``url``, which its ``aclose`` closes: the one place
        the gateway opens a connection to Redis."""
        return cls(redis_client(url, **client_options()), key_prefix, timeout_s, owns_client=True)

    @classmethod
    def of(cls, client: RedisClient) -> SharedStore:
        """The store ``client`` belongs to: the one that opened it (in a gateway, the process's
        store), else a new store around it, kept while anyone holds it (a test's or a bench's)."""
        store = _STORES.get(id(client))
        return store if store is not None and store.client is client else cls(client)

    @property
    def enabled(self) -> bool:
        return self.client is not None

    def budget(self, seconds: float | None = None) -> Budget:
        """``async with store.budget(seconds):`` one call to the store, cut after ``seconds`` of the
        loop's free time (``timeout_s`` by default), its outcome judged (module docstring)."""
        return Budget(self, self.timeout_s if seconds is None else seconds)

    def judge(self, free_s: float, error: BaseException | None) -> None:
        """A call's outcome: answered after ``free_s`` of free time, or failed with ``error``."""
        if error is None:
            self.up = free_s <= self.timeout_s
        elif isinstance(error, FAILURES) and not (isinstance(error, TimeoutError) and free_s < self.timeout_s):
            self.up = False

    async def aclose(self) -> None:
        """Close the client once, after every feature that used it has stopped (its own client only)."""
        if self.client is not None and self.owns_client and not self.closed:
            self.closed = True
            await self.client.aclose()


class Budget(FreeTimeout):
    """One call to a ``SharedStore``, bounded in the loop's free time (``SharedStore.budget``).

    As ``FreeTimeout``: ``free_s`` and ``wall_s`` after the block; a budget that ran out raises a
    ``TimeoutError`` that says how long it waited. Its outcome goes to ``store.judge``: answered,
    failed (``FAILURES``), or neither (another error of the caller's, a cancellation)."""

    def __init__(self, store: SharedStore, budget_s: float) -> None:
        super().__init__(store.lag, budget_s)
        self.store = store

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        try:
            await super().__aexit__(exc_type, exc, tb)
        except TimeoutError as expired:
            error = timed_out(expired, self)
            self.store.judge(self.free_s, error)
            if error is expired:
                raise
            raise error from expired
        if exc is None or isinstance(exc, FAILURES):
            self.store.judge(self.free_s, exc)
        return None
