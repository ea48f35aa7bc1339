"""The ASGI application: the ``Gateway`` object, the routes, and the lifespan that builds both.

The three inference endpoints are dispatched by a dict lookup on the path straight to their
``InferenceHandler`` (pure ASGI: no routing or middleware layers on the hot path, which cost
about 0.1 ms a request). Everything else (health, readiness, metrics, the model list) goes
through a starlette ``Router``. Everything is built in the lifespan and passed explicitly;
there are no module globals.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, Router
from starlette.types import Message, Receive, Scope, Send

from gateway.admin import admin_routes
from gateway.admission import TenantLimiter
from gateway.auth import authenticate
from gateway.breaker import BreakerState, CircuitBreaker
from gateway.clock import Clock, MonotonicClock
from gateway.connections import is_operator_request
from gateway.cost_meter import CostMeter
from gateway.dispatch import Dispatcher
from gateway.endpoints import BackendPool
from gateway.errors import GatewayError, MethodNotAllowed, NotFound
from gateway.intake import read_headers
from gateway.labels import TenantLabels
from gateway.lifecycle import Drainable
from gateway.policy.loader import PolicySnapshot, load_policy
from gateway.policy.model import TracingConfig
from gateway.policy.watch import PolicySource
from gateway.proxy import Exchange, InferenceHandler
from gateway.retry import RetryBudget
from gateway.routing.base import Router as BackendRouter
from gateway.routing.isolation import CacheSalter
from gateway.routing.registry import build_routers
from gateway.scrape import SaturationScraper
from gateway.settings import Settings
from gateway.state.factory import build_limit_store
from gateway.state.memory import MemoryLimitStore
from gateway.state.redis import RedisLimitStore
from gateway.streaming import TokenTimer
from gateway.telemetry import ConnectionCounts, Metrics
from gateway.tokens import CharRatioEstimator
from gateway.tracelog import ItlSummary, TraceLog, TraceLogConfig, meets_slo, trace_record
from gateway.tracing import INERT_REQUEST, Tracing, finish_span
from gateway.types import Api
from gateway.upstream import UpstreamClient

log = logging.getLogger(__name__)

BREAKER_LEVELS = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class Gateway:
    """Everything the request path needs, built once at start-up and closed at shutdown."""

    def __init__(self, settings: Settings, snapshot: PolicySnapshot, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock: Clock = clock or MonotonicClock()
        self.metrics = Metrics(redis=snapshot.policy.state.backend == "redis")
        self.estimator = CharRatioEstimator()
        self.routers: dict[str, BackendRouter] = build_routers(snapshot, self.clock)
        self.pool = BackendPool(snapshot, on_forget=self.forget_backend, breakers=self._breaker)
        self.retry_budget = RetryBudget.from_policy(snapshot.policy.retry, self.clock)
        self.limit_store = self._limit_store(snapshot)
        self.limiter = TenantLimiter(self.limit_store)
        self.dispatcher = Dispatcher(self.pool, self.routers.__getitem__, self.clock, snapshot)
        self.salter = CacheSalter.from_env(snapshot.policy.cache_isolation.secret_env)
        backends = {b.name: b for b in snapshot.policy.backends}
        self.upstream = UpstreamClient(backends, max_connections=settings.max_upstream_connections)
        self.source = PolicySource(settings.policy_path, initial=snapshot)
        self.source.subscribe(self._apply)
        self._tasks: set[asyncio.Task[None]] = set()
        self.metrics.policy_info.labels(snapshot.version, snapshot.digest).set(1)
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self.epoch_offset = time.time() - self.clock.now()
        tracing = snapshot.policy.telemetry.tracing or TracingConfig.from_env()
        self.tracing = Tracing(
            tracing if settings.telemetry else TracingConfig(),
            epoch_offset=self.epoch_offset,
            on_dropped=self.metrics.trace_spans_dropped.inc,
        )
        self.tenant_labels = TenantLabels(top=snapshot.policy.telemetry.top_tenants, clock=self.clock)
        self.costs = CostMeter(self.metrics, snapshot.policy.backends, self.clock)
        self.trace_log = (
            TraceLog(TraceLogConfig(path=Path(settings.trace_log_path))) if settings.trace_log_path else None
        )

    def _limit_store(self, snapshot: PolicySnapshot) -> MemoryLimitStore | RedisLimitStore:
        """The tenant limits' store from the policy's ``state``; Redis failures become metrics."""
        m = self.metrics
        store = build_limit_store(
            snapshot.policy.state,
            self.clock,
            on_error=lambda operation: m.child(m.redis_errors, operation).inc(),
            on_fallback=lambda operation: m.child(m.redis_fallbacks, operation).inc(),
        )
        if isinstance(store, RedisLimitStore):
            m.redis_up.set_function(lambda: 1.0 if store.up else 0.0)
        return store

    def policy(self) -> PolicySnapshot:
        """The policy in force; a request reads it once and keeps it to the end."""
        return self.source.current()

    def _apply(self, snapshot: PolicySnapshot) -> None:
        """A reloaded policy: every component follows it; requests in flight keep their own.

        Backends the new policy removes are drained, not cut: their requests in flight hold
        their ``BackendState`` and finish on it; only new requests see the new pool.
        """
        old_routing = {m.name: m.routing for m in self.policy().policy.models}
        if snapshot.policy.state != self.policy().policy.state:
            log.warning("policy section 'state' changed: the limit store keeps its settings until a restart")
        self.pool.apply(snapshot)
        fresh = build_routers(snapshot, self.clock)
        for model, router in fresh.items():
            unchanged = old_routing.get(model) == snapshot.models[model].routing and model in self.routers
            self.routers[model] = self.routers[model] if unchanged else router
        for model in set(self.routers) - set(fresh):
            del self.routers[model]
        self.dispatcher.apply(snapshot)
        self.upstream.configure({b.name: b for b in snapshot.policy.backends})
        self.costs.reprice(snapshot.policy.backends)
        self.metrics.policy_info.clear()
        self.metrics.policy_info.labels(snapshot.version, snapshot.digest).set(1)
        self._retrace(snapshot)
        self.dispatcher.pump_all()
        log.warning("policy %s (digest %s) is now in force", snapshot.version, snapshot.digest)

    def _retrace(self, snapshot: PolicySnapshot) -> None:
        """A policy that changes ``telemetry.tracing`` replaces the tracer (the old one flushes)."""
        config = snapshot.policy.telemetry.tracing or TracingConfig.from_env()
        if not self.settings.telemetry or config == self.tracing.config:
            return
        old, self.tracing = (
            self.tracing,
            Tracing(config, epoch_offset=self.epoch_offset, on_dropped=self.metrics.trace_spans_dropped.inc),
        )
        threading.Thread(target=old.shutdown, name="tracing-shutdown", daemon=True).start()

    def policy_status(self) -> dict[str, object]:
        snapshot, source = self.policy(), self.source
        return {
            "version": snapshot.version,
            "digest": snapshot.digest,
            "source": snapshot.source,
            "reloads": {"ok": source.reloads_ok, "invalid": source.reloads_invalid},
            "last_error": source.last_error,
        }

    def enter(self) -> None:
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        if self.draining and self.active == 0:
            self._idle.set()

    def begin_drain(self) -> None:
        """Stop taking work: readiness fails, new requests get 503 ``draining``."""
        self.draining = True
        self.dispatcher.draining = True
        if self.active == 0:
            self._idle.set()

    def drainable(self) -> Drainable:
        return Drainable(
            start=self.begin_drain,
            in_flight=lambda: self.active,
            idle=self._idle.wait,
            timeout_s=lambda: self.policy().policy.lifecycle.drain_timeout_s,
        )

    def _breaker(self, backend: str, snapshot: PolicySnapshot) -> CircuitBreaker:
        return CircuitBreaker(backend, snapshot.policy.breaker, self.clock)

    def forget_backend(self, backend: str) -> None:
        """A backend went down or left: every router drops what it learnt about it."""
        for router in self.routers.values():
            router.forget_backend(backend)

    async def start(self) -> None:
        if self.trace_log is not None:
            self.trace_log.start()
        # Everything built so far lives as long as the process: move it out of the collector's
        # reach, so that the full collections the request path's allocations trigger do not
        # rescan it every time (CPython's advice for long-running servers, ``gc.freeze``).
        gc.freeze()
        policy = self.policy().policy
        if isinstance(self.limit_store, RedisLimitStore):
            await self.limit_store.check()  # fail open: a Redis down at start-up is not fatal
            self._spawn(self.limit_store.run())
        self._spawn(self.costs.run(lambda: self.policy().policy.telemetry.cost_interval_s))
        if policy.lifecycle.watch_interval_s > 0:
            self._spawn(self.source.watch(policy.lifecycle.watch_interval_s))
        try:
            self.source.install_sighup(asyncio.get_running_loop())
        except (RuntimeError, ValueError):  # not the main thread (tests): no signal handlers there
            log.debug("SIGHUP reload not installed: not in the main thread")
        checks = policy.health_checks
        if self.settings.health_checks:
            await self.pool.check_all(self.upstream.http, checks.timeout_s)
            self._spawn(self._health_loop(checks.interval_s, checks.timeout_s))
        if policy.scrape.interval_s > 0:
            scraper = SaturationScraper(self.pool, self.upstream.http, self.clock, self.dispatcher.pump_all)
            self._spawn(scraper.run(policy.scrape.interval_s, policy.scrape.timeout_s))

    async def _health_loop(self, interval_s: float, timeout_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.pool.check_all(self.upstream.http, timeout_s)
            self.dispatcher.pump_all()

    def _spawn(self, coro: Any) -> None:
        """Run a background loop (health checks, scrapes, ...) owned by the gateway."""
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[None]) -> None:
        """A background loop that dies must say so: it would otherwise stop without a trace."""
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s stopped", task.get_coro(), exc_info=task.exception())

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.upstream.aclose()
        await self.limit_store.aclose()
        if self.trace_log is not None:
            await asyncio.to_thread(self.trace_log.close)
        await asyncio.to_thread(self.tracing.shutdown)

    def record(self, exchange: Exchange) -> None:
        """Count a finished request and observe its latencies (called once per request).

        Samples go through ``Metrics.pending`` (applied in bulk before each scrape)."""
        if not self.settings.telemetry:
            return
        m = self.metrics
        p = m.pending
        model, klass = exchange.model, exchange.klass
        model_class = (model, klass)
        p.inc(m.requests, (model, exchange.api.name.lower(), klass, str(exchange.status), exchange.outcome))
        tenant = self.tenant_labels.label(exchange.tenant)  # counts traffic; the busiest keep their name
        if exchange.status in (429, 503):
            p.inc(m.rejections, (exchange.outcome, klass, tenant))
        if exchange.backend:
            p.observe(m.queue_wait, model_class, exchange.queued_s)
        decision = exchange.decision
        if decision is not None:
            strategy = decision.strategy
            p.inc(m.routing_decisions, (model, strategy, decision.reason))
            p.observe(m.routing_pick, (model, strategy), decision.pick_s)
            if decision.detail is not None:
                p.observe(m.matched_blocks, (model, strategy), decision.matched_blocks)
        timer = exchange.timer
        now = self.clock.now()
        e2e = now - exchange.arrival
        met = self._judge(exchange, timer, e2e)
        self.costs.record(exchange, tenant, met)
        if self.trace_log is not None:
            self._trace(exchange, timer, now, met)
        if exchange.span is not INERT_REQUEST:
            finish_span(exchange.span, exchange, timer, now)
        if timer is None:
            return
        p.observe(m.e2e, model_class, e2e)
        ttft = timer.ttft
        if ttft is not None:
            p.observe(m.ttft, model_class, ttft)
            if timer.gaps:
                p.observe_all(m.itl, model_class, timer.gaps)
        usage = timer.usage
        if usage:
            p.inc(m.tokens, (model, "input"), usage.get("prompt_tokens") or 0)
            p.inc(m.tokens, (model, "output"), usage.get("completion_tokens") or 0)

    def _trace(self, exchange: Exchange, timer: TokenTimer | None, now: float, met: bool) -> None:
        """One line of the request trace log (no prompt or completion text, ever)."""
        assert self.trace_log is not None
        usage = (timer.usage if timer else None) or {}
        details = usage.get("prompt_tokens_details") or {}
        self.trace_log.write(
            trace_record(
                request_id=exchange.request_id,
                epoch_offset=self.epoch_offset,
                t_arrival=exchange.arrival,
                t_end=now,
                t_admit=exchange.t_admit,
                t_dispatch=exchange.t_dispatch,
                t_first_token=timer.first_output if timer else None,
                class_name=exchange.klass,
                tenant=exchange.tenant,
                model=exchange.model,
                stream=exchange.stream,
                status=exchange.status,
                outcome=exchange.outcome,
                backend=exchange.backend,
                queue_s=exchange.queued_s,
                itl=ItlSummary.of(timer.gaps) if timer and timer.gaps else None,
                tokens_in=usage.get("prompt_tokens"),
                tokens_out=usage.get("completion_tokens"),
                cached_tokens=details.get("cached_tokens") if isinstance(details, dict) else None,
                slo_met=met,
            )
        )

    def _judge(self, exchange: Exchange, timer: TokenTimer | None, e2e: float) -> bool:
        """Goodput: was the request judged against its class's SLO, and did it meet it?

        Requests the client caused to fail (4xx but 408, its own tenant limits, a disconnect)
        are not judged; overload refusals and backend failures are, as misses."""
        status, klass = exchange.status, exchange.klass
        slo_class = self.policy().policy.classes.get(klass)
        if slo_class is None or not (status == 200 or status >= 500 or status == 408):
            return False
        m = self.metrics
        m.pending.inc(m.slo_requests, (exchange.model, klass))
        itl = timer.gaps if timer else ()
        met = meets_slo(
            ok=exchange.outcome == "completed",
            ttft_s=timer.ttft if timer else None,
            itl_mean_s=sum(itl) / len(itl) if itl else None,
            e2e_s=e2e,
            slo=slo_class.slo,
        )
        if met:
            m.pending.inc(m.goodput_requests, (exchange.model, klass))
            usage = timer.usage if timer else None
            m.pending.inc(m.goodput_tokens, (exchange.model, klass), (usage or {}).get("completion_tokens") or 0)
        return met

    def export_metrics(self) -> bytes:
        m = self.metrics
        classes = self.policy().policy.classes
        rank_names = {c.rank: name for name, c in classes.items()}
        for name, klass in classes.items():
            m.slo_objective.labels(name).set(klass.slo.objective)
        for state in self.pool.all():
            m.in_flight.labels(state.name).set(state.in_flight)
            m.in_flight_tokens.labels(state.name).set(state.in_flight_tokens)
            m.backend_healthy.labels(state.name).set(1 if state.healthy else 0)
            m.backend_kv_usage.labels(state.name).set(state.kv_usage)
            m.backend_waiting.labels(state.name).set(state.waiting)
            if state.breaker is not None:
                m.breaker_state.labels(state.name).set(BREAKER_LEVELS[state.breaker.state])
            for rank, name in rank_names.items():
                m.class_in_flight.labels(state.name, name).set(state.class_in_flight.get(rank, 0))
        for model, queues in self.dispatcher.queues().items():
            m.model_healthy_backends.labels(model).set(sum(1 for s in self.pool.for_model(model) if s.healthy))
            for queue in queues.classes:
                m.queue_depth.labels(model, queue.name).set(queue.depth)
                m.queue_capacity.labels(model, queue.name).set(queue.policy.queue.max_depth)
        source = self.source
        for result, count in (("ok", source.reloads_ok), ("invalid", source.reloads_invalid)):
            m.policy_reloads.labels(result).set(count)
        if self.trace_log is not None:
            m.advance(m.trace_log_dropped, self.trace_log.dropped)
        return m.exposition()


def error_response(error: GatewayError) -> Response:
    return Response(error.body(), status_code=error.status, headers=error.headers, media_type="application/json")


def with_request_id(scope: Scope, send: Send) -> Send:
    """``send`` that adds ``x-request-id`` (the client's valid one, else a new one) to the response."""
    request_id = read_headers(scope["headers"]).request_id
    assert request_id is not None
    header = (b"x-request-id", request_id.encode())

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), header]
        await send(message)

    return send_with_id


class GatewayApp:
    """The ASGI entry point. ``GatewayApp(settings)`` loads the policy in its lifespan.

    Requests from the operator listener (``gateway/connections.py``) see only the operator
    routes (probes, ``/metrics``, ``/admin/*``); the API listener never serves those two, since
    they show tenants' costs and model names to whoever can connect."""

    def __init__(
        self, settings: Settings, snapshot: PolicySnapshot | None = None, connections: ConnectionCounts | None = None
    ) -> None:
        self.settings = settings
        self._snapshot = snapshot
        self.connections = connections
        self.gateway: Gateway | None = None
        self._hot: dict[str, InferenceHandler] = {}
        admin = admin_routes(lambda: self.gateway, error_response)
        self._ops = Router(
            routes=[
                Route("/healthz", self._healthz),
                Route("/readyz", self._readyz),
                Route("/v1/models", self._models),
            ],
            default=self._not_found,
        )
        self._operator = Router(
            routes=[
                Route("/healthz", self._healthz),
                Route("/readyz", self._readyz),
                Route("/metrics", self._metrics),
                Route("/admin/reload", admin["/admin/reload"], methods=["POST"]),
                Route("/admin/policy", admin["/admin/policy"]),
            ],
            default=self._not_found,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if is_operator_request(scope):
                await self._operator(scope, receive, with_request_id(scope, send))
                return
            handler = self._hot.get(scope["path"])
            if handler is not None and scope["method"] == "POST":
                await handler(scope, receive, send)  # sets x-request-id itself
                return
            send = with_request_id(scope, send)
            if handler is None:
                await self._ops(scope, receive, send)
            else:
                error = MethodNotAllowed(f"{scope['path']} accepts POST only.")
                await error_response(error)(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        try:
            snapshot = self._snapshot or load_policy(self.settings.policy_path)
            gateway = Gateway(self.settings, snapshot)
            await gateway.start()
        except Exception as exc:
            log.error("gateway failed to start: %s", exc)
            await send({"type": "lifespan.startup.failed", "message": str(exc)})
            return
        self.gateway = gateway
        self._hot = {api.value: InferenceHandler(gateway, api) for api in Api}
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        await gateway.aclose()
        await send({"type": "lifespan.shutdown.complete"})

    async def _healthz(self, request: Request) -> Response:
        return PlainTextResponse("ok")

    async def _readyz(self, request: Request) -> Response:
        gateway = self.gateway
        if gateway is None:
            return JSONResponse({"ready": False, "reason": "starting"}, status_code=503)
        if gateway.draining:
            return JSONResponse({"ready": False, "reason": "draining"}, status_code=503)
        unready = gateway.pool.unready_models()
        if unready:
            return JSONResponse({"ready": False, "models_without_healthy_backend": unready}, status_code=503)
        return JSONResponse({"ready": True, "policy_version": gateway.policy().version})

    async def _metrics(self, request: Request) -> Response:
        if self.gateway is None:
            return PlainTextResponse("starting", status_code=503)
        if self.connections is not None:
            self.gateway.metrics.export_connections(self.connections)
        body = self.gateway.export_metrics()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _models(self, request: Request) -> Response:
        if self.gateway is None:
            return PlainTextResponse("starting", status_code=503)
        snapshot = self.gateway.policy()
        try:
            tenant = authenticate(request.headers.get("authorization", "").encode() or None, snapshot)
        except GatewayError as error:
            return error_response(error)
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "inference-gateway"}
            for m in snapshot.models
            if snapshot.tenant_may_use(tenant, m)
        ]
        return JSONResponse({"object": "list", "data": data})

    async def _not_found(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = NotFound(f"No route for {scope.get('method', '')} {scope.get('path', '')}.")
        await error_response(error)(scope, receive, send)
