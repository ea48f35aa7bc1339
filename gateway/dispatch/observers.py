"""What the dispatcher tells the collaborators above it: waits, demand, decisions, cache misses.

Three collaborators listen to the dispatcher, and each needs the dispatcher to be built: the
shadow runner (``gateway/shadow/runner.py``) places its copies through it, the fleet coordinator
(``gateway/fleet/coordinator.py``) reads its queues, the fleet's prefix view
(``gateway/fleet/prefix_sync.py``) is made after the fleet. So the dispatcher cannot be given them
when it is made; it is given an ``Observers`` instead, into which the composition root
(``gateway/service.py``) registers each of them once, as it builds them. The dispatcher's fields
are never reassigned, and what it says, when and why, is written here once, typed.

Each listener explicitly subclasses ``DispatchObserver`` and overrides the events it cares
about; the others keep the protocol's defaults, which do nothing. A dispatcher built alone (a
test, a bench) hears nothing (``QuietObserver``).

Below routing and the fleet in the stage order, as the dispatcher: it imports none of its listeners.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gateway.dispatch.backends import BackendState
from gateway.dispatch.cache_report import CacheReport
from gateway.dispatch.router import RoutingDecision
from gateway.types import InferenceRequest


class DispatchObserver(Protocol):
    """Hears what the dispatcher did or is about to do; every method is called on the dispatcher's
    path (the event loop's thread, inside ``acquire``, ``give_back`` or a hand-out), so it must be
    quick and must not raise."""

    __slots__ = ()

    def request_waits(self, states: Sequence[BackendState]) -> int:
        """A real request must wait for one of ``states`` (its lane), and is about to be judged (the
        queue bound, the wait estimate); never for ``Dispatcher.place_now``. Answers how many slots
        of ``states`` come back for it shortly: a request that waits only for those is neither
        refused by the queue bound nor by the estimate.

        Why: a real request never waits behind a shadow copy; the shadow runner cancels the copies
        holding slots there (``ShadowRunner.request_waits``), and their slots come back as their
        tasks end, on the next turns of the loop."""
        return 0

    def demand_changed(self) -> None:
        """A request was queued here (its demand is reported for every backend of its lane), or this
        process gave back room on a backend that another process has requests waiting for.

        Why: the fleet's ledger moves each backend's parts between processes by demand; the fleet
        coordinator syncs at once instead of at its next interval (``FleetCoordinator.demand_changed``),
        so room idle in one process reaches a request waiting in another within tens of milliseconds."""
        return None

    def routed(self, request: InferenceRequest, decision: RoutingDecision) -> None:
        """The dispatcher acted on ``decision`` for ``request``: the backend's room is reserved for it
        (the fast path, a hand-out, ``place_now``).

        Why: the fleet's prefix view publishes it (``PrefixSync.routed``), so that the other
        replicas' routers learn which backend now caches the request's prefix."""
        return None

    def cache_missed(self, request: InferenceRequest, decision: RoutingDecision, report: CacheReport) -> None:
        """The engine answered ``request`` holding less of its prompt than the router predicted
        (``report.missed``); the model's router has corrected itself first (``Router.on_answer``).

        Why: the fleet's prefix view carries the correction to the other replicas
        (``PrefixSync.cache_missed``), whose indexes believed the same."""
        return None


class QuietObserver(DispatchObserver):
    """Hears nothing: the observer of a dispatcher built alone (a test, a bench, a process without
    a fleet or shadows)."""

    __slots__ = ()


class Observers(DispatchObserver):
    """The listeners of one dispatcher, told in the order they were added.

    The dispatcher holds this one object from its construction, and the composition root adds each
    listener once as it builds it (``gateway/service.py``): the collaborators made after the
    dispatcher need no field of it reassigned."""

    __slots__ = ("_observers",)

    def __init__(self, *observers: DispatchObserver) -> None:
        self._observers: list[DispatchObserver] = list(observers)

    def add(self, observer: DispatchObserver) -> None:
        """Tell ``observer`` every event from now on (once each: the slots it frees count once)."""
        if any(known is observer for known in self._observers):
            raise ValueError(f"{observer!r} already observes this dispatcher")
        self._observers.append(observer)

    def request_waits(self, states: Sequence[BackendState]) -> int:
        return sum(observer.request_waits(states) for observer in self._observers)

    def demand_changed(self) -> None:
        for observer in self._observers:
            observer.demand_changed()

    def routed(self, request: InferenceRequest, decision: RoutingDecision) -> None:
        for observer in self._observers:
            observer.routed(request, decision)

    def cache_missed(self, request: InferenceRequest, decision: RoutingDecision, report: CacheReport) -> None:
        for observer in self._observers:
            observer.cache_missed(request, decision, report)
