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
* the backend's own saturation signals, when freshly scraped, are below the policy's
  thresholds: waiting requests at most ``max_waiting`` and KV cache usage at most
  ``max_kv_usage``. These only tighten; with nothing in flight there a backend is always
  given work, so stale or pessimistic signals cannot starve a model.
"""

from __future__ import annotations

from gateway.backends import BackendState
from gateway.policy.model import PriorityClass


def has_room(state: BackendState, priority_class: PriorityClass, tokens: int, now: float, fresh_s: float) -> bool:
    if not state.healthy or (state.breaker is not None and not state.breaker.allow()):
        return False
    capacity = state.backend.capacity
    if state.in_flight == 0:
        return True
    rank, share = priority_class.rank, priority_class.max_share
    if priority_class.max_prefilling is not None and _prefill_blocked(state, rank, priority_class.max_prefilling):
        return False
    if state.in_flight >= capacity.max_concurrent:
        return False
    if state.in_flight_tokens + tokens > capacity.max_tokens_in_flight:
        return False
    if share < 1.0:
        if state.class_in_flight.get(rank, 0) + 1 > share * capacity.max_concurrent:
            return False
        if state.class_tokens.get(rank, 0) + tokens > share * capacity.max_tokens_in_flight:
            return False
    if now - state.scraped_at <= fresh_s and (
        state.waiting > capacity.max_waiting or state.kv_usage > capacity.max_kv_usage
    ):
        return False
    return True


def _prefill_blocked(state: BackendState, rank: int, max_prefilling: int) -> bool:
    prefilling = state.class_prefilling
    if prefilling.get(rank, 0) >= max_prefilling:
        return True
    return any(count for other, count in prefilling.items() if other < rank)
