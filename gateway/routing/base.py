"""What a router may offer beyond the ``Router`` protocol: capabilities the stages above it check.

The extension point itself, the ``Router`` protocol and the ``RoutingDecision`` it returns, is
dispatch's (``gateway/dispatch/router.py``): the dispatcher calls it, and the consumer owns the
protocol it calls (routing reads the backends' state from dispatch, so it sits above it). The
protocols here are asked for with ``isinstance`` by the stages above routing: a router that
learns from other processes' decisions (``PrefixLearner``, ``gateway/fleet/prefix_sync.py``),
and one that applies the bounded-load rule (``LoadBounded``, ``framework.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from gateway.dispatch.backends import BackendState


@runtime_checkable
class PrefixLearner(Protocol):
    """A router whose index other processes' decisions can feed (``gateway/fleet/prefix_sync.py``)."""

    def learn(self, state: BackendState, blocks: Sequence[int], at: float) -> None:
        """``state``'s backend was sent a prompt of these tenant-scoped ``blocks`` at time ``at``."""
        ...

    def forget_before(self, state: BackendState, at: float) -> int:
        """``state``'s engine evicted what was last sent to it at time ``at`` (another process saw it
        hold less than predicted: ``gateway/dispatch/cache_report.py``): forget all it was sent
        until then; how many blocks were forgotten."""
        ...


@runtime_checkable
class LoadBounded(Protocol):
    """A router that never chooses a candidate the bounded-load rule (``framework.py``) excludes."""

    @property
    def epsilon(self) -> float:
        """The rule's slack: at most ``(1 + epsilon)`` times the average load, rounded up."""
        ...
