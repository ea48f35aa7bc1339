"""The process's one handle on the shared store: one Redis client and pool, opened once, closed once.

Why one: the ledger, the prefix view, response affinity and the rollouts' store each used to
open a client from the policy's ``state`` by hand (three in ``service.py``, one in the rollout
store), with the same URL test written four times and the same tuple of failures five times;
adding Sentinel or a second kind of store meant editing every one. Now ``SharedStore.from_state``
reads ``state`` once, opens one client (``redis://``, ``rediss://``, ``unix://``,
``redis+sentinel://`` or ``redis+cluster://``: ``gateway/shared/connect.py``), and every feature gets that client;
redis-py's pool gives each concurrent call its own connection, so one feature's slow script does
not hold another's command. Features never close it: ``aclose`` here does, once, at shutdown.

Usage::

    shared = SharedStore.from_state(snapshot.policy.state)   # client None under state.backend: memory
    FleetLedger(shared.client, key_prefix=shared.key_prefix, ...)
    except FAILURES: ...                                      # what a call to it may end in
    await shared.aclose()
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.exceptions import RedisError

from gateway.policy.model import StatePolicy
from gateway.shared.connect import RedisClient, redis_client

FAILURES = (RedisError, OSError, TimeoutError)
"""What a call to the shared store may end in when the store, not the caller, failed: Redis's
own errors, the connection's, and a budget that ran out."""
CONNECT_S = 1.0
"""A new connection's handshake at most (TCP, ``AUTH``, redis-py's ``CLIENT SETINFO``)."""


def store_url(state: StatePolicy) -> str | None:
    """The Redis URL the policy's ``state`` puts in force, or None when state is in memory."""
    return state.resolved_url() if state.backend == "redis" else None


@dataclass
class SharedStore:
    """The shared store of one process (module docstring); ``client`` is None when state is in memory."""

    client: RedisClient | None
    key_prefix: str
    timeout_s: float
    """The policy's ``state.timeout_ms``: one call's budget, unless a feature needs a longer one."""
    closed: bool = False

    @classmethod
    def from_state(cls, state: StatePolicy) -> SharedStore:
        url = store_url(state)
        client = redis_client(url, socket_connect_timeout=CONNECT_S, health_check_interval=0) if url else None
        return cls(client, state.key_prefix, state.timeout_ms / 1000)

    @property
    def enabled(self) -> bool:
        return self.client is not None

    async def aclose(self) -> None:
        """Close the client once, after every feature that used it has stopped."""
        if self.client is not None and not self.closed:
            self.closed = True
            await self.client.aclose()
