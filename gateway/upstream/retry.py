"""Bounded retries: what may be retried, how long to wait, and the budget that caps them.

The rule (issue 6): a failed attempt is retried only if nothing of it can have been processed
and nothing of the response has reached the client, at most ``max_retries`` times, after a
full-jitter backoff, never past the request's deadline, and only while the retry budget allows.

What says "nothing was processed" (``is_retryable``):

* the connection was refused, reset or closed before the response headers:
  ``map_upstream_errors`` turns each into ``UpstreamError`` with code ``upstream_connect_error``
  (caused by ``wire.ConnectionFailed``). A connect timeout (``UpstreamTimeout`` caused by
  ``wire.ConnectTimeout``) never sent the request: retryable.
* the backend answered 502 or 503 (``retryable_statuses``), or 429 *with* ``Retry-After``.

Never retried: any 4xx but such a 429; 500 and 504 (the backend may have done the work);
any failure after the response headers (the same ``upstream_connect_error`` code comes out of
a body read cut mid-stream, so the caller says which phase failed); any failure once a byte
reached the client. A read timeout before the headers (``UpstreamTimeout`` caused by
``wire.ReadTimeout``) is **not** retried: the backend accepted the request and may still be
generating it, so a retry would double the load on a backend that is already too slow.

Backoff is tenacity's ``wait_random_exponential`` (AWS "full jitter"): the delay before the
k-th retry is uniform in ``[0, min(backoff_cap_s, backoff_base_s * 2**(k-1))]``, and
``clamp_to_deadline`` shortens it to the time left, or says there is none (``None``).

The budget (``RetryBudget``) follows the Google SRE book ("Handling Overload") and Finagle's
and tower's retry budgets: the retries of the last ``budget_window_s`` seconds may be at most
``budget_ratio`` of that window's requests **plus a reserve** of ``budget_min_per_s x
budget_window_s`` retries, so that a gateway that has just started, or sees little traffic, can
still retry. The reserve is the window's, not each second's: a burst of failures at once (an
engine dropping every stream it carries) is retried whole when it fits in the reserve, while the
sustained rate it allows stays ``budget_min_per_s`` a second. (A floor of ``budget_min_per_s``
retries in any one second, as this budget once had, refused the fourth of four streams broken
at once on a gateway a second old: its ratio part counted only that second's requests.) Under a
real overload the ratio part dominates, and retries never add more than that share of the
traffic plus the reserve. A refused retry is counted.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from tenacity import AsyncRetrying, RetryCallState, wait_random_exponential

from gateway.clock import Clock
from gateway.errors import UpstreamError, UpstreamTimeout
from gateway.policy.model import RETRYABLE_STATUSES, RetryPolicy
from gateway.telemetry.window import SlidingCounter
from gateway.upstream.wire import ConnectTimeout


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed attempt as the caller saw it.

    ``error`` is what ``UpstreamClient`` raised (``headers_received`` says whether the status
    line had arrived); ``status`` and ``retry_after_s`` describe a non-2xx answer;
    ``client_bytes_sent`` says whether any byte of the response reached the client.
    """

    error: BaseException | None = None
    status: int | None = None
    retry_after_s: float | None = None
    headers_received: bool = False
    client_bytes_sent: bool = False

    @classmethod
    def from_status(cls, status: int, headers: Mapping[str, str], *, client_bytes_sent: bool = False) -> Failure:
        """A non-2xx answer; ``headers`` looked up in lower case (``UpstreamResponse.headers`` are)."""
        retry_after = parse_retry_after(headers)
        return cls(status=status, retry_after_s=retry_after, headers_received=True, client_bytes_sent=client_bytes_sent)


def parse_retry_after(headers: Mapping[str, str], *, wall_now: float | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms``, else ``Retry-After`` (seconds or HTTP date)."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None:
        try:
            return max(0.0, float(raw_ms) / 1000)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if wall_now is None else wall_now))


def is_retryable(failure: Failure, *, statuses: Collection[int] = RETRYABLE_STATUSES) -> bool:
    """Whether ``failure`` says nothing was processed and nothing reached the client."""
    if failure.client_bytes_sent:
        return False
    if failure.status is not None:
        if failure.status == 429:
            return 429 in statuses and failure.retry_after_s is not None
        return failure.status >= 500 and failure.status in statuses
    if failure.error is None or failure.headers_received:
        return False
    return _nothing_sent_or_refused(failure.error)


def _nothing_sent_or_refused(error: BaseException) -> bool:
    cause = error.__cause__
    if isinstance(error, UpstreamTimeout):
        return isinstance(cause, ConnectTimeout)
    if isinstance(error, UpstreamError):
        return error.code == "upstream_connect_error" or isinstance(
            cause, ConnectionRefusedError | ConnectionResetError
        )
    return False


def backoff_delay(retry: int, *, base_s: float, cap_s: float) -> float:
    """The full-jitter delay before the ``retry``-th retry (1-based), from tenacity."""
    if retry < 1:
        raise ValueError("retry counts from 1")
    state = RetryCallState(AsyncRetrying(), None, (), {})
    state.attempt_number = retry
    return float(wait_random_exponential(multiplier=base_s, max=cap_s)(state))


def backoff_delays(policy: RetryPolicy) -> list[float]:
    """One delay for each of the policy's ``max_retries`` retries, in order."""
    return [
        backoff_delay(k, base_s=policy.backoff_base_s, cap_s=policy.backoff_cap_s)
        for k in range(1, policy.max_retries + 1)
    ]


def clamp_to_deadline(delay_s: float, *, now: float, deadline: float | None, reserve_s: float = 0.0) -> float | None:
    """``delay_s`` shortened so that the retry starts ``reserve_s`` before the deadline.

    ``None`` when that moment has passed: do not retry. ``now`` and ``deadline`` are on the
    same monotonic scale; ``deadline=None`` means the request has none.
    """
    if deadline is None:
        return delay_s
    left = deadline - now - reserve_s
    if left <= 0:
        return None
    return min(delay_s, left)


def retry_delay(
    policy: RetryPolicy, retry: int, failure: Failure, *, now: float, deadline: float | None, same_backend: bool
) -> float | None:
    """The wait before the ``retry``-th retry, or ``None`` if it would end past the deadline.

    A retry on the same backend that answered 429 waits at least its ``Retry-After``; that wait
    is never shortened, so a Retry-After beyond the deadline means no retry.
    """
    delay = backoff_delay(retry, base_s=policy.backoff_base_s, cap_s=policy.backoff_cap_s)
    floor = failure.retry_after_s if same_backend and failure.retry_after_s is not None else 0.0
    if deadline is not None and now + floor >= deadline:
        return None
    return clamp_to_deadline(max(delay, floor), now=now, deadline=deadline)


class RetryBudget:
    """Caps retries at a share of recent requests, with a floor per second (module docstring).

    Call ``record_request()`` once per client request (not per attempt) and ``try_spend()``
    before each retry. ``now`` defaults to the clock's reading. The counters ``requests``,
    ``spent`` and ``refused`` are totals since start, for telemetry.

    ``RetryBudget(clock, ratio=0.2, min_per_s=3, window_s=10)``: in any 10 s, at most 20% of
    that window's requests plus 30 retries.
    """

    __slots__ = (
        "_clock",
        "_requests",
        "_retries",
        "min_per_s",
        "ratio",
        "refused",
        "requests",
        "spent",
    )

    def __init__(self, clock: Clock, *, ratio: float = 0.2, min_per_s: float = 3.0, window_s: float = 10.0) -> None:
        if not 0 <= ratio <= 1 or min_per_s < 0:
            raise ValueError("ratio must be in [0, 1] and min_per_s non-negative")
        self._clock = clock
        self.ratio = ratio
        self.min_per_s = min_per_s
        self._requests = SlidingCounter(window_s)
        self._retries = SlidingCounter(window_s)
        self.requests = 0
        self.spent = 0
        self.refused = 0

    @classmethod
    def from_policy(cls, policy: RetryPolicy, clock: Clock) -> RetryBudget:
        return cls(clock, ratio=policy.budget_ratio, min_per_s=policy.budget_min_per_s, window_s=policy.budget_window_s)

    def record_request(self, now: float | None = None) -> None:
        self._requests.add(self._clock.now() if now is None else now)
        self.requests += 1

    @property
    def reserve(self) -> float:
        """The retries every window allows whatever its traffic: ``min_per_s x window_s``."""
        return self.min_per_s * self._retries.window_s

    def try_spend(self, now: float | None = None) -> bool:
        """Take one retry from the budget; ``False`` (and counted) when it is spent."""
        t = self._clock.now() if now is None else now
        if self._retries.total(t) >= self.ratio * self._requests.total(t) + self.reserve:
            self.refused += 1
            return False
        self._retries.add(t)
        self.spent += 1
        return True

    def __repr__(self) -> str:
        return (
            f"RetryBudget(ratio={self.ratio}, min_per_s={self.min_per_s}, "
            f"window_s={self._requests.window_s}, spent={self.spent}, refused={self.refused})"
        )
