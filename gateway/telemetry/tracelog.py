"""The request trace log: one JSONL line per finished request, for studying past traffic.

Why a log of its own when there are metrics: histograms answer "how slow is the P99 now",
but a platform team comparing two routing policies on last week's traffic needs every
request (its class, tenant, backend, timings and tokens), and the load generator's report
already reads exactly that. So each line is a ``loadtests.loadgen.records.RequestRecord``
(``request_id``, ``t_send``, ``class_name``, ``tenant``, ``model``, ``stream``, ``status``,
``error``, ``ttft_s``, ``itl_s``, ``e2e_s``, ``tokens_in``, ``tokens_out``,
``cached_tokens``, ``slo_met``) plus the gateway's own fields, which the reader keeps as
extras: ``t_arrival``, ``t_admit``, ``t_dispatch``, ``t_first_token``, ``t_end`` (unix
epoch seconds), ``queue_s``, ``backend``, ``outcome``, ``reason``, ``engine_request_ids`` (the
id each attempt's engine saw, to find the request in an engine's logs) and an ITL summary
(``itl_p50_s``, ``itl_p99_s``, ``itl_max_s``, ``itl_mean_s``, ``itl_count``) in place of
every gap: ``itl_s`` is left empty, which keeps a 4,000-token answer one short line. The fields
and their types are ``TraceLine``'s.

What a replay needs (``loadtests/whatif/``), when the request got as far as validation (else
null, or empty): ``api`` (the dialect's name, always), ``max_tokens`` (the output cap asked
for, after the model's default and clamp), ``prompt_tokens_est`` (the gateway's estimate of the
prompt, for requests the engine never answered, whose ``tokens_in`` is null),
``predicted_cached_tokens`` (what the router expected the engine to hold of the prompt, in the
engine's tokens, beside the engine's own ``cached_tokens``: ``gateway/dispatch/cache_report.py``;
null when the engine does not report what it reused), ``prefix_block_tokens`` and
``prefix_hashes`` (the prompt's tenant-scoped block-hash chain as
16-hex-digit strings, keyed with the cache-salt secret, ``gateway/routing/prefix_signature.py``: shared
prefixes share a head, two tenants' chains never meet, and without the secret no hash can be
checked against a guessed prompt) and ``session`` (the client's conversation id, ``x-session-id``
else the body's ``prompt_cache_key``, as a hash scoped by tenant; null when none was sent).
No prompt or completion text is ever written, only counts, timings and hashes; nor a raw
session id.

Off the hot path: ``TraceLog.write`` appends the record (a plain dict) to a bounded
``deque`` and returns; a writer thread serialises with orjson and appends to the file
every ``flush_interval_s`` or once ``batch`` records wait. When the buffer is full the
record is dropped and counted (``dropped``), so a slow disk costs lines, never latency.
The file is size-bounded like ``logging.handlers.RotatingFileHandler``: past ``max_bytes``
it becomes ``NAME.1`` (``NAME.1`` becomes ``NAME.2``, ...) and ``keep`` old files remain.

Usage::

    log = TraceLog(TraceLogConfig(path=Path("/var/log/gateway/trace.jsonl")))
    log.start()
    log.write(trace_line(request_id="r1", ..., epoch_offset=offset))
    log.close()   # drains what is buffered
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, TypedDict

import orjson
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

from gateway.telemetry.prefix_signature import PrefixSignature

log = logging.getLogger(__name__)


class TraceLine(TypedDict):
    """One line of the log, the contract every reader shares: the load generator's
    ``RequestRecord`` fields first (its reader keeps the rest as extras), then the gateway's own
    (the module docstring says what each holds). Defined once, here: the what-if reader
    (``loadtests/whatif/trace.py``) checks a line against these fields, and a test holds
    ``RequestRecord``'s to them."""

    request_id: str
    t_send: float
    class_name: str
    tenant: str
    model: str
    stream: bool
    status: int
    error: str | None
    ttft_s: float | None
    itl_s: list[float]
    e2e_s: float
    tokens_in: int | None
    tokens_out: int | None
    cached_tokens: int | None
    slo_met: bool
    t_arrival: float
    t_admit: float | None
    t_dispatch: float | None
    t_first_token: float | None
    t_end: float
    queue_s: float
    backend: str | None
    engine_request_ids: list[str]
    outcome: str
    reason: str | None
    itl_count: int
    itl_mean_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    itl_max_s: float | None
    api: str | None
    max_tokens: int | None
    session: str | None
    prefix_block_tokens: int | None
    prefix_hashes: list[str]
    prompt_tokens_est: int | None
    predicted_cached_tokens: int | None


TRACE_LINE_FIELDS: tuple[str, ...] = tuple(TraceLine.__annotations__)
"""Every field of a line, in the order written."""


class TraceLogConfig(BaseModel):
    """Where the log goes and how much it may hold: ``TraceLogConfig(path=Path("trace.jsonl"))``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Path
    max_bytes: PositiveInt = 100 * 1024 * 1024
    keep: Annotated[int, Field(ge=0)] = 5
    buffer_records: PositiveInt = 65_536
    batch: PositiveInt = 512
    flush_interval_s: PositiveFloat = 1.0


@dataclass(frozen=True, slots=True)
class ItlSummary:
    """Inter-token gaps of one stream in seconds: count, mean, P50, P99, max (nearest rank)."""

    count: int
    mean: float
    p50: float
    p99: float
    max: float

    @classmethod
    def of(cls, gaps: Sequence[float]) -> ItlSummary | None:
        if not gaps:
            return None
        ordered = sorted(gaps)
        n = len(ordered)
        return cls(n, math.fsum(ordered) / n, _rank(ordered, 0.50), _rank(ordered, 0.99), ordered[-1])


def _rank(ordered: Sequence[float], q: float) -> float:
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def trace_line(
    *,
    request_id: str,
    epoch_offset: float,
    t_arrival: float,
    t_end: float,
    t_admit: float | None,
    t_dispatch: float | None,
    t_first_token: float | None,
    class_name: str,
    tenant: str,
    model: str,
    stream: bool,
    status: int,
    outcome: str,
    backend: str,
    queue_s: float,
    itl: ItlSummary | None = None,
    tokens_in: int | None = None,
    tokens_out: int | None = None,
    cached_tokens: int | None = None,
    predicted_cached_tokens: int | None = None,
    slo_met: bool = False,
    engine_request_ids: Sequence[str] = (),
    api: str | None = None,
    max_tokens: int | None = None,
    signature: PrefixSignature | None = None,
    session: str | None = None,
) -> TraceLine:
    """One line of the log from plain values; times are the gateway clock's (monotonic) seconds.

    ``epoch_offset`` turns them into unix epoch seconds (``time.time() - clock.now()``,
    taken once at start-up). ``error`` and ``reason`` are the outcome code unless the
    request completed; ``status`` 0 means no response was sent (client disconnected early).
    ``itl`` is ``ItlSummary.of(timer.gaps)``, computed once and shared with the trace span.
    ``signature`` and ``session`` (already hashed) are None for a request that ended before it
    was validated.
    """

    def epoch(t: float | None) -> float | None:
        return None if t is None else t + epoch_offset

    completed = outcome == "completed"
    return {
        "request_id": request_id,
        "t_send": t_arrival + epoch_offset,
        "class_name": class_name,
        "tenant": tenant,
        "model": model,
        "stream": stream,
        "status": status,
        "error": None if completed else outcome,
        "ttft_s": None if t_first_token is None else t_first_token - t_arrival,
        "itl_s": [],
        "e2e_s": t_end - t_arrival,
        "tokens_in": tokens_in,
        "tokens_out": tokens_out,
        "cached_tokens": cached_tokens,
        "slo_met": slo_met,
        "t_arrival": t_arrival + epoch_offset,
        "t_admit": epoch(t_admit),
        "t_dispatch": epoch(t_dispatch),
        "t_first_token": epoch(t_first_token),
        "t_end": t_end + epoch_offset,
        "queue_s": queue_s,
        "backend": backend or None,
        "engine_request_ids": list(engine_request_ids),
        "outcome": outcome,
        "reason": None if completed else outcome,
        "itl_count": 0 if itl is None else itl.count,
        "itl_mean_s": None if itl is None else itl.mean,
        "itl_p50_s": None if itl is None else itl.p50,
        "itl_p99_s": None if itl is None else itl.p99,
        "itl_max_s": None if itl is None else itl.max,
        "api": api,
        "max_tokens": max_tokens,
        "session": session,
        "prefix_block_tokens": None if signature is None else signature.block_tokens,
        "prefix_hashes": [] if signature is None else list(signature.hashes),
        "prompt_tokens_est": None if signature is None else signature.prompt_tokens_est,
        "predicted_cached_tokens": predicted_cached_tokens,
    }


class TraceLog:
    """A bounded buffer of records and the thread that appends them to a rotating file."""

    @property
    def dropped(self) -> int:
        """Records refused (buffer full) or lost (write failed); ``gateway_trace_log_dropped_total``."""
        return self._refused + self._lost

    def __init__(self, config: TraceLogConfig) -> None:
        self.config = config
        self._refused = 0  # buffer full: counted on the event loop
        self._lost = 0  # write failed: counted on the writer thread (two counters, no race)
        self.written = 0
        self._buffer: deque[TraceLine] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._size = 0

    def start(self) -> None:
        self.config.path.parent.mkdir(parents=True, exist_ok=True)
        self._size = self.config.path.stat().st_size if self.config.path.exists() else 0
        self._thread = threading.Thread(target=self._run, name="trace-log-writer", daemon=True)
        self._thread.start()

    def write(self, record: TraceLine) -> bool:
        """Queue ``record``; False (and counted) when the buffer is full. Never blocks."""
        buffer = self._buffer
        if len(buffer) >= self.config.buffer_records:
            self._refused += 1
            return False
        buffer.append(record)
        if len(buffer) >= self.config.batch:
            self._wake.set()
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the writer after it has written everything buffered."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def _run(self) -> None:
        while True:
            self._wake.wait(self.config.flush_interval_s)
            self._wake.clear()
            stopping = self._stop
            self._drain()
            if stopping:
                return

    @staticmethod
    def serialise(record: TraceLine) -> bytes:
        """One line of the file, newline included."""
        return orjson.dumps(record) + b"\n"

    def _drain(self) -> None:
        limit, batch = self.config.max_bytes, self.config.batch
        lines: list[bytes] = []
        pending = 0
        while self._buffer:
            line = self.serialise(self._buffer.popleft())
            if self._size + pending + len(line) > limit and self._size + pending > 0:
                self._append(lines)
                lines, pending = [], 0
                self._rotate()
            lines.append(line)
            pending += len(line)
            if len(lines) >= batch:
                self._append(lines)
                lines, pending = [], 0
        self._append(lines)

    def _append(self, lines: list[bytes]) -> None:
        if not lines:
            return
        data = b"".join(lines)
        try:
            with self.config.path.open("ab") as fh:
                fh.write(data)
        except OSError as exc:  # a full or read-only disk costs lines, never the writer thread
            self._lost += len(lines)
            log.warning("trace log: cannot write %s: %s", self.config.path, exc)
            return
        self._size += len(data)
        self.written += len(lines)

    def _rotate(self) -> None:
        path, keep = self.config.path, self.config.keep
        try:
            if keep == 0:
                path.unlink(missing_ok=True)
            else:
                path.with_name(f"{path.name}.{keep}").unlink(missing_ok=True)
                for index in range(keep - 1, 0, -1):
                    older = path.with_name(f"{path.name}.{index}")
                    if older.exists():
                        older.rename(path.with_name(f"{path.name}.{index + 1}"))
                path.rename(path.with_name(f"{path.name}.1"))
        except OSError as exc:
            log.warning("trace log: cannot rotate %s: %s", path, exc)
        self._size = 0


def rotated_files(path: Path) -> list[Path]:
    """The log and its rotated files, oldest first (the order a report reads them in)."""
    olds = [p for p in path.parent.glob(f"{path.name}.*") if p.suffix[1:].isdigit()]
    olds.sort(key=lambda p: int(p.suffix[1:]), reverse=True)
    return [*olds, path] if path.exists() else olds
