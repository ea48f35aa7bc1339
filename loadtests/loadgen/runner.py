"""The open-loop runner: one scheduler loop launches one task per request at its scheduled time.

Open loop means the schedule alone decides when a request goes out: the loop sleeps until the
next absolute deadline (start + offset, never "previous send + gap", so lateness does not
accumulate), launches the request as its own task and moves on without waiting for any
response. If the loop falls behind, every overdue request goes out at once and its lateness is
recorded. Bodies are built just before their deadline, while the loop would otherwise sleep.

Bounded: sending stops at the duration or the request cap; in-flight requests then get
``drain_timeout_s`` to finish, after which they are cancelled and recorded as
``cancelled_at_end`` with status 0. Only loopback targets are accepted: a load generator aimed
at someone else's server is an accident or an attack, neither of which this tool is for.

The generator's own cost is measured with `time.thread_time` on the event-loop thread, which is
all of its work (planning, sending, parsing, recording) and none of a server's running in
another thread of the same process (as in the tests).
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar
from urllib.parse import urlsplit

import aiohttp

from loadtests.loadgen.client import Exchange, make_session, send_request
from loadtests.loadgen.prompts import PlannedRequest, RequestFactory
from loadtests.loadgen.records import RECORDS_FILE, RequestRecord
from loadtests.loadgen.schedule import build_schedule
from loadtests.loadgen.stats import meets_slo, scaled_slo
from loadtests.loadgen.summary import SUMMARY_FILE, RunInfo, build_summary, write_summary
from loadtests.loadgen.workload import Workload

CANCELLED_AT_END = "cancelled_at_end"
_START_DELAY_S = 0.05
_PROGRESS_PERIOD_S = 0.25
T = TypeVar("T")


class TargetRefused(ValueError):
    """The target is not on this machine's loopback interface."""


def check_target(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TargetRefused(f"--target {url!r}: expected http://HOST:PORT")
    host = parts.hostname
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise TargetRefused(
            f"--target {url!r}: refusing a non-loopback host {host!r}; the load generator only "
            "targets 127.0.0.0/8, ::1 or localhost"
        )


@dataclass(frozen=True, slots=True)
class RunConfig:
    """One run. ``rate`` is None only for a trace replayed at its recorded speed.

    Usage: ``RunConfig(target="http://127.0.0.1:8000", rate=20, duration_s=60, out_dir=Path("out"))``
    """

    target: str
    rate: float | None
    duration_s: float
    out_dir: Path
    max_requests: int | None = None
    seed: int = 0
    time_scale: float = 1.0
    drain_timeout_s: float = 60.0
    connection_limit: int = 10_000
    spread_to: tuple[str, ...] = ()
    """More targets: each request goes to one of ``target`` and these at random (seeded), as a
    Kubernetes Service without session affinity spreads requests over replicas."""


class ProgressSink(Protocol):
    """Receives the run's counters a few times a second (a progress bar, or nothing)."""

    def update(self, *, planned: int, sent: int, done: int, errors: int) -> None: ...


@dataclass(frozen=True, slots=True)
class RunResult:
    records: list[RequestRecord]
    summary: dict[str, Any]
    out_dir: Path


class _Run:
    """The state of one run: counters, in-flight tasks, the open records file."""

    def __init__(self, workload: Workload, config: RunConfig, records_file: IO[bytes]) -> None:
        for target in (config.target, *config.spread_to):
            check_target(target)
        self.workload = workload
        self.config = config
        self.factory = RequestFactory(
            workload, seed=config.seed, run_id=uuid.uuid4().hex[:8], time_scale=config.time_scale
        )
        self.urls = [target.rstrip("/") + self.factory.path for target in (config.target, *config.spread_to)]
        self.spread = random.Random(config.seed)
        self.slos = {name: scaled_slo(c.slo, config.time_scale) for name, c in workload.classes.items()}
        self.file = records_file
        self.records: list[RequestRecord] = []
        self.in_flight: dict[asyncio.Task[None], tuple[PlannedRequest, float]] = {}
        self.sent = 0
        self.errors = 0
        self.failure: BaseException | None = None
        self.cpu_s = 0.0
        self.epoch_offset = time.time() - time.perf_counter()

    async def execute(self, offsets: Sequence[float], progress: ProgressSink | None) -> None:
        ticker = asyncio.create_task(self._tick(len(offsets), progress)) if progress else None
        try:
            async with make_session(connection_limit=self.config.connection_limit) as session:
                # Measured after the session exists: its one-off set-up (an SSL context) is not per request.
                cpu_start = time.thread_time()
                await self._send_all(session, offsets)
                await self._drain()
                self.cpu_s = time.thread_time() - cpu_start
            if self.failure is not None:
                raise RuntimeError("a request task failed") from self.failure
        finally:
            if ticker is not None:
                ticker.cancel()
                await asyncio.gather(ticker, return_exceptions=True)
                self._report(len(offsets), progress)

    async def _send_all(self, session: aiohttp.ClientSession, offsets: Sequence[float]) -> None:
        start = time.perf_counter() + _START_DELAY_S
        for index, offset in enumerate(offsets):
            planned = self.factory.plan(index)
            due = start + offset
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            task = asyncio.create_task(self._one(session, planned, due))
            self.in_flight[task] = (planned, due)
            task.add_done_callback(self._forget)
            self.sent += 1

    async def _one(self, session: aiohttp.ClientSession, planned: PlannedRequest, due: float) -> None:
        url = self.urls[0] if len(self.urls) == 1 else self.spread.choice(self.urls)
        exchange = await send_request(session, url, planned.body, planned.headers, stream=self.workload.stream)
        self._finish(self._record(planned, exchange, due))

    def _forget(self, task: asyncio.Task[None]) -> None:
        self.in_flight.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            self.failure = task.exception()  # a bug in this module: re-raised at the end of the run

    async def _drain(self) -> None:
        if not self.in_flight:
            return
        _, pending = await asyncio.wait(list(self.in_flight), timeout=self.config.drain_timeout_s)
        leftovers = [self.in_flight[task] for task in pending if task in self.in_flight]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        now = time.perf_counter()
        for planned, due in leftovers:
            self._finish(self._record(planned, Exchange(0, CANCELLED_AT_END, due, now, ()), due))

    def _record(self, planned: PlannedRequest, exchange: Exchange, due: float) -> RequestRecord:
        ok = exchange.error is None and exchange.status == 200
        ttft, e2e, tokens_out = exchange.ttft_s, exchange.e2e_s, exchange.tokens_out
        tpot = (e2e - ttft) / (tokens_out - 1) if ttft is not None and tokens_out and tokens_out > 1 else None
        slo = self.slos[planned.class_name]
        return RequestRecord(
            request_id=planned.request_id,
            t_send=self.epoch_offset + exchange.t_start,
            class_name=planned.class_name,
            tenant=planned.tenant,
            model=self.workload.model,
            stream=self.workload.stream,
            status=exchange.status,
            error=exchange.error,
            ttft_s=ttft,
            itl_s=exchange.itl_s,
            e2e_s=e2e,
            tokens_in=exchange.tokens_in,
            tokens_out=tokens_out,
            cached_tokens=exchange.cached_tokens,
            slo_met=meets_slo(slo, ok=ok, ttft_s=ttft, tpot_s=tpot, e2e_s=e2e),
            lateness_s=max(0.0, exchange.t_start - due),
            extra=planned.trace_fields,
        )

    def _finish(self, record: RequestRecord) -> None:
        self.records.append(record)
        if not record.ok:
            self.errors += 1
        self.file.write(record.to_json() + b"\n")

    async def _tick(self, planned: int, progress: ProgressSink) -> None:
        while True:
            self._report(planned, progress)
            await asyncio.sleep(_PROGRESS_PERIOD_S)

    def _report(self, planned: int, progress: ProgressSink | None) -> None:
        if progress is not None:
            progress.update(planned=planned, sent=self.sent, done=len(self.records), errors=self.errors)


async def run_workload(
    workload: Workload,
    config: RunConfig,
    *,
    base_dir: Path,
    progress: ProgressSink | None = None,
) -> RunResult:
    """Run ``workload`` against the target and write ``records.jsonl`` and ``summary.json``.

    ``base_dir`` resolves paths in the workload (a trace file), normally the workload's folder.
    """
    check_target(config.target)
    offsets = build_schedule(
        workload.arrival,
        rate=config.rate,
        duration_s=config.duration_s,
        max_requests=config.max_requests,
        seed=config.seed,
        base_dir=base_dir,
        time_scale=config.time_scale,
    )
    config.out_dir.mkdir(parents=True, exist_ok=True)
    with (config.out_dir / RECORDS_FILE).open("wb") as fh:
        run = _Run(workload, config, fh)
        await run.execute(offsets, progress)
    info = RunInfo(
        workload=workload.name,
        target=config.target,
        rate=config.rate,
        duration_s=config.duration_s,
        time_scale=config.time_scale,
        seed=config.seed,
        planned=len(offsets),
    )
    summary = build_summary(run.records, info=info, slos=run.slos, cpu_s=run.cpu_s)
    write_summary(config.out_dir / SUMMARY_FILE, summary)
    return RunResult(run.records, summary, config.out_dir)


def run_sync(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine on uvloop when it is installed (it is, with uvicorn[standard])."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        return asyncio.run(main())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())
