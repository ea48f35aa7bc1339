"""Goodput: which finished requests count as work that met its objectives.

The rule, written once (the recorder, the cost meter and the trace log all use it):

* A request is *judged* when the system could have served it: it got a 200, or the gateway or
  a backend failed it (5xx, including the overload refusals 503), or it timed out (408).
  Requests the client caused to fail (4xx but 408: bad input, its own tenant limits) and
  requests whose client left are not judged: they say nothing of the service.
* A judged request *meets* its class's SLO when it completed and met every objective: E2E,
  TTFT (streams), and the ITL objective on its mean gap (MLPerf's TPOT); a request with a
  single output chunk has no gap and is judged on TTFT and E2E, a non-streamed one on E2E.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from gateway.policy.model import Slo
from gateway.telemetry.token_stats import TokenStats


class SloVerdict(NamedTuple):
    judged: bool
    met: bool


NOT_JUDGED = SloVerdict(judged=False, met=False)


class JudgedRequest(Protocol):
    """What goodput reads of a finished request (``gateway/pipeline/outcome.py``'s ``RequestOutcome``
    is one): declared here, since the pipeline that builds the outcome is above telemetry."""

    @property
    def status(self) -> int: ...
    @property
    def slo(self) -> Slo | None: ...
    @property
    def tokens(self) -> TokenStats | None: ...
    @property
    def completed(self) -> bool: ...
    @property
    def e2e_s(self) -> float: ...


def meets_slo(*, ok: bool, ttft_s: float | None, itl_mean_s: float | None, e2e_s: float | None, slo: Slo) -> bool:
    """True when a request succeeded and met every objective of its class (module docstring)."""
    if not ok or e2e_s is None or e2e_s * 1000 > slo.e2e_ms:
        return False
    if ttft_s is not None and ttft_s * 1000 > slo.ttft_ms:
        return False
    return itl_mean_s is None or itl_mean_s * 1000 <= slo.itl_ms


def judge_slo(outcome: JudgedRequest) -> SloVerdict:
    """Whether ``outcome`` is judged against its class's SLO, and whether it met it."""
    status, slo = outcome.status, outcome.slo
    if slo is None or not (status == 200 or status >= 500 or status == 408):
        return NOT_JUDGED
    tokens = outcome.tokens
    gaps = tokens.gaps if tokens else ()
    met = meets_slo(
        ok=outcome.completed,
        ttft_s=tokens.ttft if tokens else None,
        itl_mean_s=sum(gaps) / len(gaps) if gaps else None,
        e2e_s=outcome.e2e_s,
        slo=slo,
    )
    return SloVerdict(judged=True, met=met)
