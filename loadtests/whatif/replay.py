"""Replay a trace through one policy: its own gateway and simulated engines, one ``SideRun``.

``replay_side`` stages the policy (``stage.py``), sends every request of the trace through the
gateway, reads what only the gateway and the engines know, stops the processes and returns the
side's ``SideRun``, everything in trace time.

**When a request is sent.** Open loop: request ``i`` is due ``offset_s / speed`` after the
start, whatever the answers before it, as the load generator's runner does (absolute deadlines,
so lateness does not accumulate). One exception, session pacing: a request with ``think_s`` set
is sent no earlier than ``think_s / speed`` after the same session's previous request (in trace
order) *ended in this replay*: a user does not send the next turn before reading the answer, so a
slower policy delays the next turns as it would in production instead of piling them up. A turn
whose session has no earlier request in the trace, or without ``think_s``, is open loop.
Requests still running ``drain_timeout_s`` (wall time) after the last send are cancelled and
recorded as ``cancelled_at_end``.

**What is sent** (``synth.py``): the prompt rebuilt from the signature, the recorded output
length, the tenant's key in the staged policy, ``x-priority`` with the recorded class when the
policy under test declares that class (else none, and the tenant's default applies), and
``x-session-id`` with the recorded conversation id.

**Records**, one per request of the trace, as the load generator's (``RequestRecord``):
``class_name`` is the class the gateway serves the request in, resolved as the gateway does
(``gateway.admission.tenant_limits.resolve_class``: the tenant's default, or a lower class asked for);
``ttft_s``, ``itl_s``, ``e2e_s`` and ``lateness_s`` are measured by the client and multiplied by
the speed; ``t_send`` is the replay's start (epoch) plus the trace time since then. ``extra``
holds ``trace_index``, ``offset_s`` (the recorded arrival) and ``sent_offset_s`` (when it went
out, trace time). ``slo_met`` is the gateway's own goodput rule (``gateway/telemetry/goodput.py``
``meets_slo``) with the class's SLO from the policy as written: completed, E2E within its
objective, TTFT within its objective for a stream, and the mean gap between output chunks within
the ITL objective (MLPerf's TPOT); a non-streamed answer is judged on E2E alone. Unlike the
gateway, which does not judge requests that failed for a client's reason (4xx but 408), every
record counts: a rejected request has ``slo_met`` false, as the load generator counts it.

**What the processes know**: after the last answer, ``gateway_rejections_total`` of the
gateway's ``/metrics``, summed by reason, and each engine's finished requests
(``vllm:request_success_total``). ``EngineLoad.busy_fraction`` and the mean running and waiting
requests come from sampling each engine's ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` gauges every ``SAMPLE_PERIOD_S`` of wall time from the first send
to the last answer (the simulator exports no busy-time counter): busy is the share of samples
with a request running. ``prefix_hit_rate`` is the records' ``cached_tokens`` over their
``tokens_in`` (the engines' usage), over the records that report both.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from gateway.admission.tenant_limits import resolve_class
from gateway.policy.snapshot import PolicySnapshot
from gateway.telemetry.goodput import meets_slo
from loadtests.loadgen.client import Exchange, make_session, send_request
from loadtests.loadgen.records import RECORDS_FILE, RequestRecord, write_records
from loadtests.loadgen.runner import CANCELLED_AT_END, run_sync
from loadtests.whatif.model import EngineLoad, ReplayRequest, SideRun, StageSettings, Trace
from loadtests.whatif.processes import labelled, metrics
from loadtests.whatif.stage import StageError, StagePlan, running, stage_policy
from loadtests.whatif.synth import CHAT_PATH, request_body, request_headers

DRAIN_TIMEOUT_S = 120.0
SAMPLE_PERIOD_S = 0.1
_START_DELAY_S = 0.05


async def replay_side(
    trace: Trace,
    policy: Path,
    settings: StageSettings,
    *,
    side: str,
    repeat: int,
    work_dir: Path,
    port_base: int,
    trace_log: Path | None = None,
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
) -> SideRun:
    """Replay ``trace`` through ``policy`` on a fresh stage (module docstring).

    ``work_dir`` receives the staged policy and the replay's records (``records.jsonl``, as the
    load generator writes them) under ``<side>-r<repeat>/``; ``port_base`` is the
    gateway's port, the engines take the next ones and the operator listener ``port_base + 1000``.
    ``trace_log``: the gateway writes its own trace log of the replay there.
    """
    run_dir = work_dir / f"{side}-r{repeat}"
    plan = stage_policy(policy, settings, work_dir=run_dir, port_base=port_base)
    check_trace(trace, plan.original)
    stack = ExitStack()
    await asyncio.to_thread(stack.enter_context, running(plan, trace_log=trace_log))
    try:
        run = await replay_on(trace, plan, side=side, repeat=repeat, drain_timeout_s=drain_timeout_s)
    finally:
        await asyncio.to_thread(stack.close)
    await asyncio.to_thread(write_records, run_dir / RECORDS_FILE, run.records)
    return run


async def replay_on(
    trace: Trace, plan: StagePlan, *, side: str, repeat: int, drain_timeout_s: float = DRAIN_TIMEOUT_S
) -> SideRun:
    """Replay ``trace`` on a stage already ``running``; its counters must start at zero (a fresh
    stage), since the rejections and finished requests are read from them."""
    replay = _Replay(trace, plan, side=side, repeat=repeat)
    records, loads = await replay.run(drain_timeout_s)
    rejections, finished = await asyncio.to_thread(_read_counters, plan)
    return SideRun(
        side=side,
        repeat=repeat,
        records=tuple(sorted(records, key=lambda r: int(r.extra["trace_index"]))),
        elapsed_s=elapsed_trace_s(records),
        engines=engine_loads(plan, loads, finished),
        rejections=rejections,
        prefix_hit_rate=prefix_hit_rate(records),
    )


def run_side(
    trace: Trace,
    policy: Path,
    settings: StageSettings,
    *,
    side: str,
    repeat: int,
    work_dir: Path,
    port_base: int,
    trace_log: Path | None = None,
) -> SideRun:
    """``replay_side`` from synchronous code (on uvloop)."""
    return run_sync(
        lambda: replay_side(
            trace,
            policy,
            settings,
            side=side,
            repeat=repeat,
            work_dir=work_dir,
            port_base=port_base,
            trace_log=trace_log,
        )
    )


def check_trace(trace: Trace, snapshot: PolicySnapshot) -> None:
    """Refuse a trace whose tenants or models the policy does not declare: the stage has no key
    for such a tenant and no engine for such a model, so its requests would only measure a 401/404."""
    tenants = {t.name for t in snapshot.policy.tenants}
    unknown_tenants = sorted({r.tenant for r in trace.requests} - tenants)
    unknown_models = sorted({r.model for r in trace.requests} - set(snapshot.models))
    problems = []
    if unknown_tenants:
        problems.append(f"tenants not in the policy: {', '.join(unknown_tenants)}")
    if unknown_models:
        problems.append(f"models not in the policy: {', '.join(unknown_models)}")
    if problems:
        raise StageError(f"{snapshot.source}: cannot replay the trace: {'; '.join(problems)}")


def class_to_send(request: ReplayRequest, snapshot: PolicySnapshot) -> tuple[str | None, str]:
    """(the ``x-priority`` to send or None, the class the gateway will serve the request in)."""
    asked = request.class_name if request.class_name in snapshot.policy.classes else None
    tenant = next(t for t in snapshot.policy.tenants if t.name == request.tenant)
    served, _ = resolve_class(tenant, None if asked is None else asked.encode(), snapshot)
    return asked, served


@dataclass(frozen=True, slots=True)
class _Planned:
    """One request ready to go: its body and headers, when it is due, its session's turns."""

    index: int
    request: ReplayRequest
    body: bytes
    headers: Mapping[str, str]
    class_name: str
    due: float
    previous_turn: asyncio.Future[float] | None
    this_turn: asyncio.Future[float] | None


class _Replay:
    """The state of one replay: the schedule's clock, the sessions' last turns, the records."""

    def __init__(self, trace: Trace, plan: StagePlan, *, side: str, repeat: int) -> None:
        self.trace = trace
        self.plan = plan
        self.speed = plan.speed
        self.url = plan.gateway_url + CHAT_PATH
        self.id_prefix = f"{side}-r{repeat}"
        self.records: list[RequestRecord] = []
        self.in_flight: dict[asyncio.Task[None], _Planned] = {}
        self.last_turn: dict[str, asyncio.Future[float]] = {}
        self.failure: BaseException | None = None
        self.t0 = 0.0
        self.epoch0 = 0.0

    async def run(self, drain_timeout_s: float) -> tuple[list[RequestRecord], Mapping[str, _Samples]]:
        sampler = _LoadSampler(self.plan)
        async with make_session() as session:
            sampling = asyncio.create_task(sampler.run(session))
            try:
                await self._send_all(session)
                await self._drain(drain_timeout_s)
            finally:
                sampling.cancel()
                await asyncio.gather(sampling, return_exceptions=True)
        if self.failure is not None:
            raise RuntimeError("a replayed request failed") from self.failure
        return self.records, sampler.samples

    async def _send_all(self, session: aiohttp.ClientSession) -> None:
        self.t0 = time.perf_counter() + _START_DELAY_S
        self.epoch0 = time.time() + _START_DELAY_S
        for index, request in enumerate(self.trace.requests):
            planned = self._plan(index, request)
            await asyncio.sleep(max(0.0, planned.due - time.perf_counter()))
            task = asyncio.create_task(self._one(session, planned))
            self.in_flight[task] = planned
            task.add_done_callback(self._forget)

    def _plan(self, index: int, request: ReplayRequest) -> _Planned:
        asked, served = class_to_send(request, self.plan.original)
        previous = this = None
        if request.session is not None:
            previous = self.last_turn.get(request.session)
            this = self.last_turn[request.session] = asyncio.get_running_loop().create_future()
        return _Planned(
            index=index,
            request=request,
            body=request_body(request, index),
            headers=request_headers(request, api_key=self.plan.keys[request.tenant], send_class=asked),
            class_name=served,
            due=self.t0 + request.offset_s / self.speed,
            previous_turn=previous,
            this_turn=this,
        )

    async def _one(self, session: aiohttp.ClientSession, planned: _Planned) -> None:
        try:
            not_before = await self._not_before(planned)
            await asyncio.sleep(max(0.0, not_before - time.perf_counter()))
            exchange = await send_request(
                session, self.url, planned.body, planned.headers, stream=planned.request.stream
            )
            self.records.append(self._record(planned, exchange, not_before))
        finally:
            if planned.this_turn is not None and not planned.this_turn.done():
                planned.this_turn.set_result(time.perf_counter())

    async def _not_before(self, planned: _Planned) -> float:
        """Its due time, or later: ``think_s`` after its session's previous turn ended (pacing)."""
        think_s = planned.request.think_s
        if think_s is None or planned.previous_turn is None:
            return planned.due
        ended = await asyncio.shield(planned.previous_turn)
        return max(planned.due, ended + think_s / self.speed)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self.in_flight.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            self.failure = task.exception()  # a bug in this module: re-raised at the end of the replay

    async def _drain(self, timeout_s: float) -> None:
        if not self.in_flight:
            return
        _, pending = await asyncio.wait(list(self.in_flight), timeout=timeout_s)
        leftovers = [self.in_flight[task] for task in pending if task in self.in_flight]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        now = time.perf_counter()
        for planned in leftovers:
            self.records.append(self._record(planned, Exchange(0, CANCELLED_AT_END, now, now, ()), now))

    def _record(self, planned: _Planned, exchange: Exchange, not_before: float) -> RequestRecord:
        k, request = self.speed, planned.request
        ttft = None if exchange.ttft_s is None else exchange.ttft_s * k
        itl = tuple(gap * k for gap in exchange.itl_s)
        e2e = exchange.e2e_s * k
        return RequestRecord(
            request_id=f"{self.id_prefix}-{planned.index}",
            t_send=self.epoch0 + (exchange.t_start - self.t0) * k,
            class_name=planned.class_name,
            tenant=request.tenant,
            model=request.model,
            stream=request.stream,
            status=exchange.status,
            error=exchange.error,
            ttft_s=ttft,
            itl_s=itl,
            e2e_s=e2e,
            tokens_in=exchange.tokens_in,
            tokens_out=exchange.tokens_out,
            cached_tokens=exchange.cached_tokens,
            slo_met=self._met(planned, exchange, ttft, itl, e2e),
            lateness_s=max(0.0, exchange.t_start - not_before) * k,
            extra={
                "trace_index": planned.index,
                "offset_s": request.offset_s,
                "sent_offset_s": (exchange.t_start - self.t0) * k,
            },
        )

    def _met(self, planned: _Planned, exchange: Exchange, ttft: float | None, itl: Sequence[float], e2e: float) -> bool:
        """The gateway's goodput rule (module docstring), in trace time."""
        slo = self.plan.original.priority_class(planned.class_name).slo
        ok = exchange.error is None and exchange.status == 200
        stream = planned.request.stream
        return meets_slo(
            ok=ok,
            ttft_s=ttft if stream else None,
            itl_mean_s=sum(itl) / len(itl) if stream and itl else None,
            e2e_s=e2e,
            slo=slo,
        )


@dataclass(slots=True)
class _Samples:
    """One engine's sampled gauges: how many samples, with a request running, and the sums."""

    count: int = 0
    busy: int = 0
    running: float = 0.0
    waiting: float = 0.0

    def add(self, running: float, waiting: float) -> None:
        self.count += 1
        self.busy += running > 0
        self.running += running
        self.waiting += waiting


_RUNNING = b"vllm:num_requests_running{"
_WAITING = b"vllm:num_requests_waiting{"


class _LoadSampler:
    """Reads every engine's running and waiting gauges every ``SAMPLE_PERIOD_S`` (module docstring)."""

    def __init__(self, plan: StagePlan) -> None:
        self.engines = plan.engines
        self.samples: dict[str, _Samples] = {engine.name: _Samples() for engine in plan.engines}

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            tick = time.perf_counter()
            await asyncio.gather(*(self._sample(session, e.name, e.url) for e in self.engines))
            await asyncio.sleep(max(0.0, tick + SAMPLE_PERIOD_S - time.perf_counter()))

    async def _sample(self, session: aiohttp.ClientSession, name: str, url: str) -> None:
        try:
            async with session.get(url + "/metrics") as response:
                text = await response.read()
        except (aiohttp.ClientError, OSError):
            return  # a missed sample; the others still count
        running = waiting = 0.0
        for line in text.splitlines():
            if line.startswith(_RUNNING):
                running = float(line.rsplit(b" ", 1)[1])
            elif line.startswith(_WAITING):
                waiting = float(line.rsplit(b" ", 1)[1])
        self.samples[name].add(running, waiting)


def _read_counters(plan: StagePlan) -> tuple[dict[str, int], dict[str, int]]:
    """(the gateway's rejections by reason, each engine's finished requests, aborts excluded)."""
    rejections: Counter[str] = Counter()
    for labels, value in labelled(metrics(plan.admin_url), "gateway_rejections_total").items():
        rejections[dict(labels)["reason"]] += int(value)
    finished = {}
    for engine in plan.engines:
        done = labelled(metrics(engine.url), "vllm:request_success_total")
        finished[engine.name] = int(sum(v for labels, v in done.items() if dict(labels)["finished_reason"] != "abort"))
    return {reason: n for reason, n in rejections.items() if n}, finished


def engine_loads(
    plan: StagePlan, samples: Mapping[str, _Samples], finished: Mapping[str, int]
) -> tuple[EngineLoad, ...]:
    """Each engine's ``EngineLoad``; its price is the original policy's (trace time)."""
    loads = []
    for engine in plan.engines:
        s = samples.get(engine.name) or _Samples()
        n = s.count or 1
        loads.append(
            EngineLoad(
                engine=engine.name,
                requests=finished.get(engine.name, 0),
                busy_fraction=s.busy / n,
                mean_running=s.running / n,
                mean_waiting=s.waiting / n,
                gpus=engine.gpus,
                price_per_gpu_hour=engine.price_per_gpu_hour,
            )
        )
    return tuple(loads)


def elapsed_trace_s(records: Sequence[RequestRecord]) -> float:
    """Trace time from the first send to the last answer (records' times are already trace time)."""
    if not records:
        return 0.0
    start = min(r.t_send for r in records)
    return max(r.t_send + (r.e2e_s or 0.0) for r in records) - start


def prefix_hit_rate(records: Sequence[RequestRecord]) -> float | None:
    """Cached prompt tokens over prompt tokens, over the records whose usage reports both."""
    cached = prompt = 0
    for record in records:
        if record.cached_tokens is not None and record.tokens_in:
            cached += record.cached_tokens
            prompt += record.tokens_in
    return cached / prompt if prompt else None
