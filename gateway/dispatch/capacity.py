"""The room rule: may one more request of a given class go to a backend right now?

A backend has room for a request of cost ``tokens`` (prompt plus ``max_tokens``) when all hold:

* it is healthy and its circuit breaker lets requests through;
* the gateway has fewer than ``max_concurrent`` requests in flight there, and adding
  ``tokens`` keeps its in-flight tokens within ``max_tokens_in_flight`` (a request bigger
  than the whole budget still goes to an idle backend, or it could never be served);
* the request's class stays within its ``max_share`` of both budgets (batch leaves room for
  interactive arrivals: a batch request never takes the last free share), and within its
  ``max_prefilling`` requests still waiting for their first token, none of them starting
  while a request of a higher class is prefilling there (batch prefills are paced, and yield
  to interactive ones, so that they do not stretch the engine steps interactive requests
  wait on);
* it is not held (``held``): every figure its policy takes from the engine (``capacity: auto``)
  has been read, and its engine, when freshly scraped, has at most ``max_waiting`` requests
  waiting in its own queue (0 by default: vLLM's and SGLang's waiting requests, llama.cpp's
  deferred ones). An engine that queues requests of its own gets none from the gateway until a
  scrape finds it drained, whatever the room here, even with nothing of the gateway's in flight
  there: it is busy with other traffic, and a request sent now would wait inside it, out of
  reach of its class's order, its deadline and its tenant's fair share, where in the gateway's
  queue it keeps them (it waits there under the queue's usual bounds and timeout). The hold does
  not wait for the next scrape to end: each request of this process that ends there after the
  scrape freed a slot the engine gave to one of its waiting requests, so the engine's queue is
  taken as the scraped figure less those (``finished_since_scrape``); a queue of 3 lets the
  gateway send again once 3 of its requests there have ended. Only a fresh scrape holds
  (``scrape.fresh_s``): one that failed or stopped lets the backend go after at most three
  intervals, so a stale page never holds a backend for ever;
* its KV cache usage, when freshly scraped, is at most ``max_kv_usage``. This only tightens:
  with nothing in flight there a backend is given work whatever its KV usage, so a pessimistic
  signal cannot starve a model.

The budgets are this process's part of the backend's capacity (``state.quota``, ``quota.py``,
sized by ``gateway/fleet/quota.py``): the whole of it for a process alone, a share when several
processes or replicas serve the same backends, so that their sum stays within the capacity;
a part the ledger granted lets nothing start once its lease has run out (``Quota.until``), and
may be smaller than what the process has in flight (its tenants hold more than their fair
share of the fleet's capacity: it starts nothing until its requests fall below it).
A process that holds a share also yields to the others: none of its requests starts on a
backend while another process has a higher class waiting for it, and no paced prefill while
another process prefills a higher class there. A request larger than the token budget goes to
an idle backend only from a process that holds the whole budget.
"""

from __future__ import annotations

from enum import StrEnum

from gateway.dispatch.backends import BackendState
from gateway.policy.model import PriorityClass


class Held(StrEnum):
    """Why a backend takes no new request whatever its room (``held``); the values are the
    ``reason`` label of ``gateway_backend_held``."""

    ENGINE_LIMITS_UNREAD = "engine_limits_unread"
    """A figure of its ``capacity: auto`` is not read from the engine yet."""
    ENGINE_QUEUE = "engine_queue"
    """Its engine has more than ``max_waiting`` requests waiting in its own queue (fresh scrape)."""


def held(state: BackendState, now: float, fresh_s: float) -> Held | None:
    """Why ``state`` takes no new request at all now, or None (module docstring)."""
    capacity = state.backend.capacity
    if capacity.awaiting_engine:
        return Held.ENGINE_LIMITS_UNREAD
    if now - state.scraped_at <= fresh_s and state.waiting - state.finished_since_scrape > capacity.max_waiting:
        return Held.ENGINE_QUEUE
    return None


def has_room(state: BackendState, priority_class: PriorityClass, tokens: int, now: float, fresh_s: float) -> bool:
    if not state.healthy or (state.breaker is not None and not state.breaker.allow()):
        return False
    if held(state, now, fresh_s) is not None:
        return False
    capacity = state.backend.capacity
    quota = state.quota
    rank, share = priority_class.rank, priority_class.max_share
    if quota is None:  # this process alone: the whole capacity
        max_requests, max_tokens, whole = capacity.max_concurrent, capacity.max_tokens_in_flight, True
        max_prefilling = priority_class.max_prefilling
    else:
        if now >= quota.until:
            return False  # this process's lease on its part has run out (``gateway/fleet/coordinator.py``)
        max_requests, max_tokens, whole = quota.requests, quota.tokens, quota.whole
        max_prefilling = None if priority_class.max_prefilling is None else quota.prefills.get(rank, 0)
        if any(count for other, count in state.others_waiting.items() if other < rank):
            return False  # a higher class waits for this backend in another process: it goes first
    if state.in_flight >= max_requests:
        return False
    if state.in_flight == 0 and whole:
        return True
    if max_prefilling is not None and _prefill_blocked(state, rank, max_prefilling):
        return False
    if state.in_flight_tokens + tokens > max_tokens:
        return False
    if share < 1.0:
        class_requests = state.class_in_flight.get(rank, 0) + 1
        class_tokens = state.class_tokens.get(rank, 0) + tokens
        part = quota.shares.get(rank) if quota is not None else None
        if part is None:  # this process alone: the share of the whole capacity
            if class_requests > share * max_requests or class_tokens > share * max_tokens:
                return False
        elif class_requests > part.requests or class_tokens > part.tokens:
            return False  # this process's part of the class's fleet-wide share
    return not (now - state.scraped_at <= fresh_s and state.kv_usage > capacity.max_kv_usage)


def _prefill_blocked(state: BackendState, rank: int, max_prefilling: int) -> bool:
    prefilling = state.class_prefilling
    if prefilling.get(rank, 0) >= max_prefilling:
        return True
    if any(count for other, count in prefilling.items() if other < rank):
        return True
    return any(count for other, count in state.others_prefilling.items() if other < rank)
