"""The running gateway: the long-lived components, built once in the lifespan, and their loops.

``Gateway`` owns what outlives a policy (the backend pool and its health, the dispatcher's
queues, the upstream connection pool, the tenant limit store, metrics, cost, the trace log)
and the ``Runtime`` in force (``gateway/runtime.py``: what the policy decides). It does four
things: hand the request path its collaborators (``pipeline_deps``), run the background loops
(health checks, scrapes, cost intervals, the policy watch), install a reload in one step
(``install``, called by the policy source before it swaps), and drain.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from gateway.admission.tenant_limits import TenantLimiter
from gateway.clock import Clock, MonotonicClock
from gateway.dispatch.backends import BackendPool
from gateway.dispatch.breaker import CircuitBreaker
from gateway.dispatch.capacity_check import CapacityCheck, CapacityGauges
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.engine_limits import auto_capacity_problems
from gateway.dispatch.kv_feeds import KvFeeds
from gateway.dispatch.observers import Observers
from gateway.dispatch.scrape import SaturationScraper
from gateway.fleet.coordinator import FleetCoordinator, partition_quotas, replica_id
from gateway.fleet.ledger import FleetLedger
from gateway.fleet.prefix_sync import PrefixSync, prefix_view_key
from gateway.limitstore.factory import build_limit_store
from gateway.limitstore.memory import MemoryLimitStore
from gateway.limitstore.redis import RedisLimitStore
from gateway.pipeline.attempt import AttemptDeps
from gateway.pipeline.handler import InFlight, PipelineDeps
from gateway.pipeline.recorder import Recorder
from gateway.policy.checks import PolicyChecks
from gateway.policy.loader import PolicyError, PolicyLoader
from gateway.policy.snapshot import PolicySnapshot
from gateway.policy.watch import PolicySource, ReloadRefused
from gateway.request.estimators import Estimators, TokenizerUnavailable, build_estimators, tokenizer_problems
from gateway.responses.affinity import ResponseAffinity
from gateway.responses.ids import ResponseIds
from gateway.responses.sharing import lookup_budget_s
from gateway.rollout.controller import OPERATOR_ACTIONS, Rollouts
from gateway.rollout.store import open_rollout_store
from gateway.routing.engine_view import KvEngineView
from gateway.routing.isolation import check_isolation
from gateway.routing.registry import routing_problems
from gateway.routing.targets import TargetPicker
from gateway.runtime import ReloadPlan, Runtime, RuntimeBuilder
from gateway.server.exposition import expose
from gateway.server.lifecycle import Drainable
from gateway.settings import Settings
from gateway.shadow.runner import ShadowRunner
from gateway.shadow.scorers import scorer_problems
from gateway.shared.loops import stop_loops
from gateway.shared.store import SharedStore
from gateway.telemetry.cost_meter import CostMeter
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tracelog import TraceLog, TraceLogConfig
from gateway.upstream.client import MissingCredential, UpstreamClient

log = logging.getLogger(__name__)

POLICY_LOADER = PolicyLoader(
    PolicyChecks(routing=routing_problems, shadow_scorer=scorer_problems, isolation=check_isolation)
)
"""The policy loader with every check (``gateway/policy/checks.py``): each entry point that reads a
policy (serve, workers, ``policy validate`` and ``explain``, reloads, tests, benches) loads through it."""


def load_policy(path: str | Path) -> PolicySnapshot:
    """Read, validate, check and index a policy file (``POLICY_LOADER``); ``PolicyError`` lists every problem."""
    return _files_readable(POLICY_LOADER.load(path))


def parse_policy(text: bytes | str, source: str) -> PolicySnapshot:
    """Like ``load_policy`` for text already in memory; ``source`` names it in every message."""
    return _files_readable(POLICY_LOADER.parse(text, source))


def _files_readable(snapshot: PolicySnapshot) -> PolicySnapshot:
    """``snapshot``, or ``PolicyError`` when a model's tokenizer file cannot be opened (``policy validate``)
    or a backend's ``capacity: auto`` asks its engine for a figure its kind does not publish."""
    problems = [*tokenizer_problems(snapshot), *auto_capacity_problems(snapshot.policy)]
    if problems:
        raise PolicyError(snapshot.source, problems)
    return snapshot


class Gateway:
    """Everything the request path needs, built once at start-up and closed at shutdown."""

    def __init__(self, settings: Settings, snapshot: PolicySnapshot, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock: Clock = clock or MonotonicClock()
        self.metrics = Metrics(redis=snapshot.policy.state.backend == "redis")
        self.epoch_offset = time.time() - self.clock.now()
        self.kv_feeds = KvFeeds(self.metrics)  # the engines' KV events; run from ``start``
        self.kv_feeds.adopt(snapshot.policy.backends)
        self.engine_view = KvEngineView(self.kv_feeds.indexes, self.kv_feeds.live, self._hashing_mismatch)
        self.builder = RuntimeBuilder(
            self.clock,
            epoch_offset=self.epoch_offset,
            telemetry=settings.telemetry,
            on_spans_dropped=self.metrics.trace_spans_dropped.inc,
            engines=self.engine_view,
        )
        self.runtime: Runtime = self.builder.first(snapshot)
        try:
            self.estimators: Estimators = build_estimators(snapshot)  # each tokenizer file read once per policy
        except TokenizerUnavailable as exc:
            raise RuntimeError(str(exc)) from exc
        self.engine_view.adopt(snapshot.policy.backends, self.estimators.engine_tokenizers, self.runtime.salter)
        self.pool = BackendPool(snapshot, on_forget=self._forget_backend, breakers=self._breaker)
        self.upstream = UpstreamClient({}, max_connections=settings.max_upstream_connections)
        try:
            self.upstream.install(UpstreamClient.prepare({b.name: b for b in snapshot.policy.backends}))
        except MissingCredential as exc:
            raise RuntimeError(str(exc)) from exc
        self.metrics.upstream_connections_open.set_function(lambda: self.upstream.open_connections)
        self.shared = SharedStore.from_state(snapshot.policy.state)  # read once, as the secret is
        if self.shared.enabled:  # Redis's health as every user of the store found it
            self.metrics.redis_up.set_function(lambda: 1.0 if self.shared.up else 0.0)
        self.limit_store = self._limit_store(snapshot)
        self.limiter = TenantLimiter(self.limit_store, self.clock)
        self.dispatch_observers = Observers()  # the shadows, the fleet and its prefix view join as they are built
        self.dispatcher = Dispatcher(
            self.pool,
            lambda model: self.runtime.router(model),
            self.clock,
            snapshot,
            observer=self.dispatch_observers,
            fleet_rebalances=self.shared.client is not None,  # the fleet's ledger moves parts by demand (_fleet)
        )
        self.fleet = self._fleet(settings, snapshot)
        self.prefix_view = self._prefix_view(snapshot)
        self.source = PolicySource(settings.policy_path, POLICY_LOADER, initial=snapshot, install=self.install)
        self.costs = CostMeter(self.metrics, snapshot.policy.backends, self.clock, share=1 / settings.workers)
        trace_log = TraceLog(TraceLogConfig(path=Path(settings.trace_log_path))) if settings.trace_log_path else None
        self.recorder = Recorder(
            self.metrics, self.costs, trace_log, epoch_offset=self.epoch_offset, enabled=settings.telemetry
        )
        self.in_flight = InFlight()
        self.affinity = self._affinity(snapshot)
        self.shadows = ShadowRunner(self.clock, self.dispatcher, self.upstream, self.metrics, costs=self.costs)
        self.dispatch_observers.add(self.shadows)  # a real request never waits behind a shadow
        self.rollouts = self._rollouts(settings, snapshot)
        self.targets = TargetPicker(candidate_share=self.rollouts.candidate_percent)
        self.recorder.on_group_outcome = self.rollouts.observe
        self._tasks: set[asyncio.Task[None]] = set()
        self.capacity_check = CapacityCheck(  # the engines' own limits: said against the declared, taken for auto
            self.upstream.http,
            CapacityGauges(self.metrics.backend_capacity_disagreement, self.metrics.backend_engine_limit),
            clock=self.clock,
            on_change=self._capacity_changed,
        )
        self.capacity_check.apply(self.pool.all())  # an auto backend is shown not ready from the start
        self.metrics.policy_info.labels(snapshot.version, snapshot.digest).set(1)

    def _limit_store(self, snapshot: PolicySnapshot) -> MemoryLimitStore | RedisLimitStore:
        """The tenant limits' store from the policy's ``state``; Redis failures become metrics."""
        m = self.metrics
        return build_limit_store(
            snapshot.policy.state,
            self.clock,
            on_error=lambda operation: m.child(m.redis_errors, operation).inc(),
            on_fallback=lambda operation: m.child(m.redis_fallbacks, operation).inc(),
            processes=self._live_processes,  # on_store_loss share: limit / the fleet's live processes
            processes_when_unknown=snapshot.policy.fleet.processes_when_unknown,
            shared=self.shared,  # its client, budgets and health are the process's one store's
        )

    def _live_processes(self) -> int:
        """The gateway processes the fleet coordinator counted at its last ledger sync (0: none yet).
        Read by the limit store only when Redis is lost, long after ``__init__`` built both."""
        return self.fleet.live if self.fleet is not None else 0

    def _affinity(self, snapshot: PolicySnapshot) -> ResponseAffinity:
        """Which backend holds each stored response, so that a follow-up may come through any replica
        (``gateway/responses/affinity.py``): in the id itself when the replicas share the cache-salt
        secret (``gateway/responses/ids.py``), else in Redis too when the limits are there. The
        secret is read once, at start, as the limit store's address is."""
        ids = ResponseIds.from_env(snapshot.policy.cache_isolation.secret_env)
        return ResponseAffinity(
            self.clock,
            per_tenant=self.settings.responses_per_tenant,
            shared=self.shared.client,
            key_prefix=self.shared.key_prefix,
            timeout_s=lookup_budget_s(self.shared.timeout_s),
            ids=ids,
        )

    def _rollouts(self, settings: Settings, snapshot: PolicySnapshot) -> Rollouts:
        """The canaries (``gateway/rollout/``): their state in Redis with the tenant limits, else in files."""
        state = snapshot.policy.state
        store = open_rollout_store(
            state.backend,
            self.shared.client,
            state.key_prefix,
            Path(settings.rollout_dir),  # each call bounded by the store's BUDGET_S (off the request path)
        )
        rollouts = Rollouts(store, self.metrics, self.clock, holder=replica_id())
        rollouts.adopt(snapshot)
        return rollouts

    def _fleet(self, settings: Settings, snapshot: PolicySnapshot) -> FleetCoordinator | None:
        """How this process gets its part of every backend's capacity (``gateway/fleet/``)."""
        if self.shared.client is None:
            if settings.workers > 1:
                log.warning(
                    "no shared store: each of the %d workers takes 1/%d of every backend's capacity "
                    "(state.backend: redis shares it by demand)",
                    settings.workers,
                    settings.workers,
                )
            partition_quotas(self.pool, snapshot, settings.workers)
            self.metrics.fleet_processes.set(settings.workers)
            return None
        ledger = FleetLedger(
            self.shared.client,
            key_prefix=self.shared.key_prefix,
            replica=replica_id(),
            lease_ttl_s=snapshot.policy.fleet.entry_ttl_s,
            drain_s=snapshot.policy.fleet_drain_s,
            cell=snapshot.policy.fleet.cell,
        )
        coordinator = FleetCoordinator(ledger, self.pool, self.dispatcher, self.policy, self.clock, self.metrics)
        coordinator.adopt(snapshot)  # nothing is the whole capacity before the first sync
        self.dispatch_observers.add(coordinator)  # syncs at once when demand moves
        return coordinator

    def _prefix_view(self, snapshot: PolicySnapshot) -> PrefixSync | None:
        """The fleet's prefix view (``gateway/fleet/prefix_sync.py``), when capacity is shared."""
        if self.fleet is None or not snapshot.policy.fleet.prefix_view:
            return None
        salter = self.runtime.salter
        if not salter.shared:
            log.warning(
                "fleet prefix view off: the cache-salt secret is this process's own, so no other replica's "
                "engine cache entries are this one's (set %s to the same secret on every replica)",
                snapshot.policy.cache_isolation.secret_env,
            )
            return None
        assert self.shared.client is not None  # the fleet runs on it
        view = PrefixSync(
            self.shared.client,
            # Replicas share a view only when they share the secret: with another secret, the same
            # tenant's blocks are another cache entry in the engines (another ``cache_salt``).
            key=prefix_view_key(snapshot.policy, salter.salt("fleet-prefix-view")[:12]),
            origin=self.fleet.ledger.replica,
            routers=lambda: self.runtime.routers,
            secret=self.runtime.prefix_secret,
            pool=self.pool,
            policy=self.policy,
            clock=self.clock,
            metrics=self.metrics,
        )
        self.dispatch_observers.add(view)  # publishes each decision
        return view

    def pipeline_deps(self) -> PipelineDeps:
        """The request path's collaborators (``gateway/pipeline/handler.py``)."""
        return PipelineDeps(
            clock=self.clock,
            runtime=lambda: self.runtime,
            limiter=self.limiter,
            estimators=lambda: self.estimators,
            attempts=AttemptDeps(self.clock, self.dispatcher, self.upstream, self.pool, self.metrics, self.affinity),
            recorder=self.recorder,
            in_flight=self.in_flight,
            targets=self.targets,
            shadows=self.shadows,
        )

    def policy(self) -> PolicySnapshot:
        """The policy in force; a request reads the runtime once and keeps it to the end."""
        return self.runtime.snapshot

    def install(self, snapshot: PolicySnapshot) -> None:
        """Plan everything ``snapshot`` needs, then install it in one step; ``ReloadRefused`` if it cannot be."""
        try:
            estimators = build_estimators(snapshot)
        except TokenizerUnavailable as exc:
            raise ReloadRefused(str(exc)) from exc
        unpublished = auto_capacity_problems(snapshot.policy)
        if unpublished:
            raise ReloadRefused("; ".join(str(problem) for problem in unpublished))
        self._install(self.builder.plan(self.runtime, snapshot, self.pool))
        self.estimators = estimators
        self.engine_view.adopt(snapshot.policy.backends, estimators.engine_tokenizers, self.runtime.salter)

    def _install(self, plan: ReloadPlan) -> None:
        """Nothing here can fail: every part was built by ``plan``."""
        snapshot = plan.runtime.snapshot
        self.runtime = plan.runtime
        self.upstream.install(plan.upstream)
        self.pool.install(plan.pool)  # forgets removed backends in the new routers
        self.capacity_check.apply(self.pool.all(), reloaded=True)  # the engines' figures kept for auto, read again
        if self.fleet is not None:
            self.fleet.adopt(snapshot)
        else:
            partition_quotas(self.pool, snapshot, self.settings.workers)
        self.dispatcher.adopt(snapshot)
        self.rollouts.adopt(snapshot)
        self.costs.reprice(snapshot.policy.backends)
        self.kv_feeds.adopt(snapshot.policy.backends)  # changed feeds rebuilt, the others keep running
        self.metrics.policy_info.clear()
        self.metrics.policy_info.labels(snapshot.version, snapshot.digest).set(1)
        if plan.retired_tracing is not None:
            threading.Thread(target=plan.retired_tracing.shutdown, name="tracing-shutdown", daemon=True).start()
        self.dispatcher.hand_out_all()
        log.warning("policy %s (digest %s) is now in force", snapshot.version, snapshot.digest)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a test installing by hand): the next health round checks
            return
        self._spawn(self._check_capacity())  # every engine's limits read again (``CapacityCheck``)

    def policy_status(self) -> dict[str, object]:
        snapshot, source = self.policy(), self.source
        return {
            "version": snapshot.version,
            "digest": snapshot.digest,
            "source": snapshot.source,
            "reloads": {"ok": source.reloads_ok, "invalid": source.reloads_invalid, "refused": source.reloads_refused},
            "last_error": source.last_error,
            "warnings": list(snapshot.warnings),
        }

    def rollout_status(self) -> list[dict[str, Any]]:
        return self.rollouts.status()

    def backends_status(self) -> list[dict[str, Any]]:
        """Each backend of the policy in force as ``GET /admin/backends`` shows it."""
        capacity = self.capacity_check.status()  # declared vs the engine's own limits, once read
        return [
            {
                "name": b.name,
                "kind": b.kind.value,
                "url": b.url,
                "kv_events": self._feed_status(b.name),
                "capacity": capacity.get(b.name),
            }
            for b in self.policy().policy.backends
        ]

    def _feed_status(self, backend: str) -> dict[str, Any] | None:
        """The backend's KV-event feed, and whether prefix routing reads its engine's index now."""
        status = self.kv_feeds.status(backend)
        if status is not None:
            status["routing"] = "events" if self.engine_view.routes_on_events(backend) else "estimate"
        return status

    async def force_rollout(self, group: str, action: str, who: str, reason: str) -> dict[str, Any]:
        """An operator's verdict on a group's rollout (``POST /admin/rollout``); KeyError: no such rollout."""
        return await self.rollouts.force(group, OPERATOR_ACTIONS[action], who, reason)

    def reload(self, reason: str) -> bool:
        """Reload the policy file now; False (and ``last_error`` says why) when it was not applied."""
        return self.source.reload(reason).error is None

    @property
    def draining(self) -> bool:
        return self.in_flight.draining

    def begin_drain(self) -> None:
        """Stop taking work: readiness fails, new requests get 503 ``draining``."""
        self.dispatcher.draining = True
        self.in_flight.drain()

    def drainable(self) -> Drainable:
        return Drainable(
            start=self.begin_drain,
            in_flight=lambda: self.in_flight.count,
            idle=self.in_flight.idle,
            timeout_s=lambda: self.policy().policy.lifecycle.drain_timeout_s,
        )

    def _breaker(self, backend: str, snapshot: PolicySnapshot) -> CircuitBreaker:
        return CircuitBreaker(backend, snapshot.policy.breaker, self.clock)

    def _hashing_mismatch(self, backend: str, mismatched: bool) -> None:
        """The engine view judged ``backend``'s ``kv_events.hashing`` wrong (or a reload replaced it)."""
        gauge = self.metrics.kv_events_hashing_mismatch.labels(backend)
        gauge.set(1 if mismatched else 0)
        if mismatched:
            log.error(
                "kv events of %s: its index never matched a prompt the engine says it reused; kv_events.hashing "
                "(algorithm, seed = the engine's PYTHONHASHSEED, block_size) or the model's tokenizer or "
                "chat_template is not the engine's: routing on the estimate for it until a reload",
                backend,
            )

    def _forget_backend(self, backend: str) -> None:
        """A backend went down, restarted or left: every router drops what it learnt about it, and the
        gateway's copy of its engine's KV-event index is emptied (``KvFeeds.clear``)."""
        for router in self.runtime.routers.values():
            router.forget_backend(backend)
        self.kv_feeds.clear(backend)

    async def start(self) -> None:
        if self.recorder.trace_log is not None:
            self.recorder.trace_log.start()
        # Everything built so far lives as long as the process: move it out of the collector's
        # reach, so that the full collections the request path's allocations trigger do not
        # rescan it every time (CPython's advice for long-running servers, ``gc.freeze``).
        gc.freeze()
        policy = self.policy().policy
        if isinstance(self.limit_store, RedisLimitStore):
            await self.limit_store.check()  # a Redis down at start-up is not fatal: state.on_store_loss applies
            self._spawn(self.limit_store.run())
        if self.fleet is not None:
            await self.fleet.sync_once()  # its part of each backend before the first request
            self._spawn(self.fleet.run())
        if self.prefix_view is not None:
            await self.prefix_view.catch_up()  # the fleet's recent decisions before the first request
            self._spawn(self.prefix_view.run())
        self._spawn(self.costs.run(lambda: self.policy().policy.telemetry.cost_interval_s))
        await self.rollouts.start()  # a restarted gateway resumes each rollout where it was
        self._spawn(self.rollouts.run())
        if policy.lifecycle.watch_interval_s > 0:
            self._spawn(self.source.watch(policy.lifecycle.watch_interval_s))
        try:
            self.source.install_sighup(asyncio.get_running_loop())
        except (RuntimeError, ValueError):  # not the main thread (tests): no signal handlers there
            log.debug("SIGHUP reload not installed: not in the main thread")
        if self.settings.health_checks:
            await self.pool.check_all(self.upstream.http, policy.health_checks.timeout_s)
            self._spawn(self._health_loop())
        self._spawn(self._check_capacity())
        self.kv_feeds.start()
        if policy.scrape.interval_s > 0:
            scraper = SaturationScraper(self.pool, self.upstream.http, self.clock, self.dispatcher.hand_out_all)
            self._spawn(scraper.run(policy.scrape.interval_s, policy.scrape.timeout_s))

    async def _health_loop(self) -> None:
        """Check every backend on the interval of the policy in force, then hand out freed capacity."""
        while True:
            checks = self.policy().policy.health_checks
            await asyncio.sleep(checks.interval_s)
            await self.pool.check_all(self.upstream.http, checks.timeout_s)
            self.dispatcher.hand_out_all()
            await self._check_capacity()  # backends that came up since, once each

    async def _check_capacity(self) -> None:
        """Read the engines' limits that are due: compared with the declared ones, taken for ``auto``."""
        await self.capacity_check.check(self.pool.all())

    def _capacity_changed(self) -> None:
        """A backend's capacity came from its engine (``capacity: auto``): fixed parts resized (the
        ledger hears it at the next sync, woken now), and its room handed to waiting requests."""
        if self.fleet is None:
            partition_quotas(self.pool, self.policy(), self.settings.workers)
        else:
            self.fleet.wake()
        self.dispatcher.hand_out_all()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
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
        await self._stop_background()
        await self.shadows.aclose()
        await self.upstream.aclose()
        await self.limit_store.aclose()
        await self.rollouts.store.aclose()
        await self.affinity.aclose()
        if self.fleet is not None:
            await self.fleet.leave()  # the upstream is closed: nothing of this process runs any more
        await self.shared.aclose()  # last: the ledger, the view, the affinity and the rollouts used it
        if self.recorder.trace_log is not None:
            await asyncio.to_thread(self.recorder.trace_log.close)
        await asyncio.to_thread(self.runtime.tracing.shutdown)

    async def _stop_background(self) -> None:
        await self.kv_feeds.aclose()
        left = await stop_loops(self._tasks)
        if left:
            log.error("shutdown: background loop(s) still running, left behind: %s", [t.get_coro() for t in left])

    def export_metrics(self) -> bytes:
        return expose(self.metrics, self.policy(), self.pool, self.dispatcher, self.source, self.recorder.trace_log)


__all__ = ["Gateway", "ReloadRefused"]
