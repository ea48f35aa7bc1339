"""The value types every part of the what-if tool shares: a trace, one replay's result.

Why a module of its own: the trace readers, the replay and the report are written and tested
apart, and meet only here. Times are seconds. A ``Trace`` is in the recorded (real) time; a
``SideRun`` too: a replay run ``speed`` times faster (``StageSettings.speed``) multiplies what
it measured by ``speed``, so that a report compares like with like.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from loadtests.loadgen.records import RequestRecord


@dataclass(frozen=True, slots=True)
class Recorded:
    """What the trace says happened to a request (absent from traces that do not say)."""

    status: int
    outcome: str | None
    """None when it completed, else the error code (``rate_limited``, ``queue_full``...)."""
    ttft_s: float | None
    e2e_s: float | None
    queue_s: float | None = None
    backend: str | None = None


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One recorded request, as much of it as a replay needs and never any text.

    ``prefix_hashes`` is the prompt's tenant-scoped block-hash chain (16 hex digits per block of
    ``block_tokens`` tokens): two requests share a cached prefix exactly as long as their chains
    share a head, and two tenants' chains never meet. ``prompt_tokens`` is at least
    ``len(prefix_hashes) * block_tokens``; the rest is unshared tail.
    """

    offset_s: float
    """Arrival time from the trace's first arrival."""
    tenant: str
    class_name: str | None
    """The class it was served in; None lets the policy under test resolve it (no header sent)."""
    model: str
    stream: bool
    prompt_tokens: int
    output_tokens: int
    block_tokens: int
    prefix_hashes: tuple[str, ...]
    session: str | None = None
    """An opaque conversation id (already hashed by whoever recorded it)."""
    think_s: float | None = None
    """Recorded gap from the end of the session's previous turn to this arrival; a replay sends
    this turn no earlier than that long after the previous turn ended *in the replay*."""
    recorded: Recorded | None = None


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests in arrival order, from one file of one of the accepted formats (``trace.py``)."""

    requests: tuple[ReplayRequest, ...]
    source: str
    """``loadgen``, ``gateway`` or ``minimal``: which format the file was in."""
    path: Path | None = None
    skipped: int = 0
    """Lines left out because nothing replayable was known of them: requests refused before
    their tenant, model or prompt size was known (a bad key, a rate limit checked before the
    body was read, an invalid body). A report should say how many."""

    @property
    def duration_s(self) -> float:
        return self.requests[-1].offset_s if self.requests else 0.0

    def scaled(self, traffic: float) -> Trace:
        """The same requests arriving ``traffic`` times as fast (``--traffic x2``): the mix,
        the prefixes and the sessions are unchanged, only the gaps shrink (think times too)."""
        if traffic <= 0:
            raise ValueError(f"traffic must be positive, not {traffic}")
        return replace(
            self,
            requests=tuple(
                replace(
                    r,
                    offset_s=r.offset_s / traffic,
                    think_s=None if r.think_s is None else r.think_s / traffic,
                )
                for r in self.requests
            ),
        )


@dataclass(frozen=True, slots=True)
class StageSettings:
    """The simulated fleet a side runs on: ``engines`` per served model (None: one per backend
    the policy names), of simulator profile ``profile``, all time ``speed`` times faster."""

    profile: str
    engines: int | None = None
    speed: float = 1.0


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One simulated engine over one replay, from its own metrics (trace time)."""

    engine: str
    requests: int
    busy_fraction: float
    """Share of the replay's duration it had at least one request running."""
    mean_running: float
    mean_waiting: float
    gpus: int = 1
    price_per_gpu_hour: float | None = None


@dataclass(frozen=True, slots=True)
class SideRun:
    """One replay of a trace through one policy: every record, in trace time (latencies
    multiplied by the speed-up), and what only the gateway and the engines know."""

    side: str
    """``current`` or ``candidate`` (or a plan's ``engines=N`` label)."""
    repeat: int
    records: tuple[RequestRecord, ...]
    elapsed_s: float
    """Trace time from the first send to the last answer."""
    engines: tuple[EngineLoad, ...]
    rejections: Mapping[str, int] = field(default_factory=dict)
    """Requests the gateway refused, by reason code (from ``gateway_rejections_total``)."""
    prefix_hit_rate: float | None = None
    """Cached prompt tokens over prompt tokens, from the engines' usage (None: none reported)."""

    @property
    def cost_per_hour(self) -> float:
        return sum((e.price_per_gpu_hour or 0.0) * e.gpus for e in self.engines)
