"""Prefix-aware routing proven on load: cache hits, TTFT and goodput per strategy; a hot prompt's spread.

Usage::

    python -m loadtests.proofs.routing_bench [--strategies round_robin,least_load,prefix_affinity,oracle]
                                      [--time-scale 4] [--phase-s 300] [--hot] [--fleet N]
                                      [--out loadtests/results/routing]
    python -m loadtests.proofs.routing_bench --fleet 3 --cache-scope slots [--repetitions 3]
                                      --out loadtests/results/routing-fleet-running
    python -m loadtests.proofs.routing_bench --truth [--repetitions 3] [--modes estimate,closed-loop,...]
                                      [--tenants 8 --conversations 8 ...] [--out loadtests/results/routing-truth]

Four simulated Llama-3.1-8B H100 engines (``inference-gateway sim --ports ...``, one process) sit
behind the gateway (another process), both restarted for every phase so that each strategy
starts from cold caches. Loads are open-loop (``loadtests/loadgen``) in simulated seconds: with
``--time-scale K`` every simulated duration, SLO and rate is scaled by K so that this 2-core
machine keeps up; the report states K and the engines' step lag (the share of engine steps
that ran more than 10 ms of wall time after their roofline deadline).

The engines' KV cache: 167k tokens each (``--gpu-memory-utilization 0.5``; the default 0.9
gives 411k). Prefix-aware routing pays off when the working set (every open conversation's
history, every tenant's system prompt) exceeds one engine's cache but fits in the fleet's: a
production fleet reaches that by serving thousands of conversations over hours, a phase here
lasts about a simulated minute. The cache is shrunk rather than the run lengthened, keeping
the ratio of working set to cache that matters (``routing.yaml`` sizes it: about twice one
engine's cache, half the fleet's). 0.5 is also what an H100 shared by two engines leaves (two
models, or a co-located embedding model). Step times do not depend on the cache size (the
cost model counts tokens computed and read), so only the cache's reach changes.

* capacity C: the completions per simulated second the whole system (gateway and four
  engines) delivers under a flood of the workload (``loadtests/workloads/routing.yaml``:
  eight tenants, long system prompts, multi-turn chats), open-loop at ``--flood-rate``, far
  above what it can serve, routed by ``prefix_affinity``: the fleet's capacity on this
  workload is what it does with its caches used, so "70% of capacity" is a fleet 70% busy
  when routed well. Other strategies' floods (``--capacity-strategies``) are reported too:
  the capacity each routing leaves the fleet. A flood makes engines take many seconds to a
  first token: they are overloaded, not broken, so the bench's policy turns the breaker off
  and gives upstream reads 600 simulated seconds, else the gateway's stall detection and
  breakers would eject busy engines and the flood would measure that instead. A flood reaches
  its window after thousands of requests, when every chat slot has cycled (the chats' steady
  state); every phase therefore starts with its chats under way (``chats_under_way``), so
  that a phase at 0.7 C sends the mix the flood measured.
* strategies: the workload at 0.7 C under each strategy. Figures are taken over the window
  after ``--warmup`` (a share of the phase in which chats open and caches fill): the prefix
  cache hit rate as the engines count it (deltas of ``vllm:prefix_cache_hits_total`` over
  ``vllm:prefix_cache_queries_total``), mean and P99 TTFT, goodput (requests meeting their
  class's SLO per simulated second), and the gateway's own routing cost per request.
* hot: one tenant's hot prompt (``routing-hot.yaml``) at twice one engine's capacity under
  ``prefix_affinity``: the requests each engine served, its hit rate and TTFT. One engine's
  capacity for it is a quarter of the fleet's under a flood of that workload (``least_load``:
  with a single prompt every engine caches it at once, so routing does not change capacity).
  Goal: no engine serves more than half of it (more would overload that engine). Its short
  requests on a cached prompt make the fleet stream several times more tokens per second than
  the chats do, so these two phases run at ``--hot-time-scale`` (default 12) to keep the
  machine (and the engines' step lag) within bounds.

The oracle is a router written here that knows every engine's cache: for each candidate it
asks the engine (``POST /debug/prefix_cache``, the simulator's debug endpoint) how many prompt
tokens its prefix cache holds for this very request under the salt the gateway will set, then
weighs that exactly as ``prefix_affinity`` weighs its estimate (same load scorers, weights and
bounded-load rule). It is the ceiling of what a better index could reach; the calls block the
gateway's loop for about a millisecond per candidate, which only the oracle pays. The gateway
runs it through ``python -m loadtests.proofs.routing_bench --serve-oracle``, which registers the
strategy and then runs ``inference-gateway serve``.

* fleet (``--fleet N``, issue 13): the same load under ``prefix_affinity`` on N gateway
  replicas (separate processes) sharing Redis, each request sent to one of them at random (a
  Kubernetes Service without session affinity; ``RunConfig.spread_to``), with the fleet's
  prefix view (``gateway/fleet/prefix_sync.py``) and without it, against one replica in the
  same run (the ``prefix_affinity`` phase when it ran, else one of its own). Goal: hit rate and
  goodput with the view at least 0.95 x one replica's.

* fleet on slot-scoped engines (``--fleet N --cache-scope slots``, issue 28): engines whose
  prefix cache holds only their slots' prompts, as a llama.cpp server with ``--parallel 4`` and
  ``--cache-ram 0`` (``loadtests/sim/kvcache.py``, ``CacheScope``): two engines of 4 slots,
  declared with ``max_concurrent: 4``. The workload is the issue's: 8 tenants x 2
  conversations x 3 turns (a long system prompt per tenant, then user turns and the replies
  sent back), conversations run 2 at once, each turn to a replica drawn at random. Three
  configurations, each from fresh engines and gateways (cold caches): one process, N replicas
  sharing Redis (ledger, prefix view, one cache-salt secret), N replicas sharing nothing; the
  repetitions interleave them (``--repetitions``, 3). The figure is what the engines counted:
  prompt tokens computed (``prefix_cache_queries - prefix_cache_hits``), per repetition and as
  a ratio to one process's; with the cached share and the first turns' TTFT percentiles. Goal:
  N replicas with the view compute at most 1.05 x what one process does. Every server (engines,
  gateways, their operator listeners) takes a free port in every mode.

* engine truth (``--truth``, issue 30): how well the gateway knows what the engines hold, on
  engines whose KV cache evicts (``TRUTH_GPU_MEMORY_UTILIZATION``: 20,896 tokens each), with a
  share of requests (``--direct-share``, 20%) sent straight to the engines behind the gateway's
  back (unique long prompts that fill their caches), and one engine (``--restart-engine``)
  restarted halfway: its process stopped and started again on its port, empty. The traffic
  (``truth_plans``): conversations of several tenants with long system prompts, each worker
  holding a few open and taking their turns in turn; halfway through, every worker waits until
  all are there (nothing in flight), the engine restarts, and all go on, so the restart comes at
  the same point in every mode. Modes (``TRUTH_MODES``), each from cold engines, the repetitions
  interleaved: ``estimate`` (the index alone, ``routing.index.closed_loop: false``),
  ``closed-loop`` (the index corrected by the answers' cached tokens), ``events`` (KV events: not
  built yet, reported as such, no figures), ``oracle`` (each engine asked), and
  ``estimate+detection`` (the estimate with the gateway's restart detection). The first four run
  with restart detection off (no scrapes, one health check at start-up, no request in flight
  across the restart: ``UNWATCHED``), so that what makes a mode stop believing in the restarted
  engine's old cache is its own mechanism; the last shows what the gateway's watch adds (which
  log line voided the engine's index, when). Figures, over the gateway's requests: the hit rate
  (cached over prompt tokens, as each answer said), prompt tokens computed, TTFT P50/P95, and the
  stale hit predictions on the restarted engine after the restart (``stale_predictions``, from
  the gateway's trace log): how many, and when the last came. Goals: events >= 0.98 x the
  oracle's hit rate; the closed loop recovers at least half of the estimate's hit-rate loss to
  the oracle; after the restart the estimate stops predicting hits on the restarted engine
  within its TTL (events: within one event batch).

Goals (issue 5): hit rate >= 0.9 x the oracle's and >= 2 x round-robin's; mean TTFT at least 2 x
better than round-robin's; P99 TTFT no worse than least_load's; goodput >= 1.5 x round-robin's.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import unittest.mock
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
import orjson
import redis

from gateway.dispatch.cache_report import MISS_SLACK_BLOCKS, CacheReport
from gateway.dispatch.router import RouteDetail, RoutingDecision
from gateway.policy.model import Tenant
from gateway.request.keys import hash_api_key
from gateway.routing.framework import Cycle, Profile, Weighted, load_bound, rendezvous
from gateway.routing.isolation import CacheSalter, tenant_scope
from gateway.routing.registry import RouterSpec, register_strategy
from gateway.routing.scorers.in_flight import InFlightScorer
from gateway.routing.scorers.kv_usage import KvUsageScorer
from gateway.routing.scorers.queue_depth import QueueDepthScorer
from gateway.types import InferenceRequest
from loadtests.harness.processes import (
    GATEWAY,
    Samples,
    free_port,
    metric_sum,
    metrics,
    policy_file,
    process,
    stop,
    stop_all,
    wait_ready,
    wait_until,
)
from loadtests.loadgen import runner
from loadtests.loadgen.prompts import RequestFactory
from loadtests.loadgen.records import RequestRecord
from loadtests.loadgen.runner import RunConfig, run_sync, run_workload
from loadtests.loadgen.stats import percentile
from loadtests.loadgen.workload import Workload, load_workload
from loadtests.sim.profiles import BLOCK_SIZE, get_profile

if TYPE_CHECKING:
    from gateway.dispatch.backends import BackendState

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROFILE = "llama-3.1-8b-h100"
ENGINES = 4
GPU_MEMORY_UTILIZATION = 0.5  # see the module docstring: a KV cache of 167k tokens per engine
KV_CACHE_TOKENS = get_profile(PROFILE, gpu_memory_utilization=GPU_MEMORY_UTILIZATION).num_kv_blocks * BLOCK_SIZE
SECRET_ENV = "GATEWAY_CACHE_SALT_SECRET"
BENCH_SECRET = "routing-bench-secret"
WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"
STRATEGIES = ("round_robin", "least_load", "prefix_affinity", "oracle")
PREFIX_WEIGHT, LOAD_WEIGHTS = 3.0, (1.0, 1.0, 0.5)  # the prefix_affinity defaults (registry.DEFAULT_WEIGHTS)


# -- the oracle --------------------------------------------------------------------------------


class OracleRouter:
    """``prefix_affinity`` with the engines' true cached prefix in place of the index estimate."""

    strategy = "oracle"

    def __init__(self, spec: RouterSpec, salter: CacheSalter) -> None:
        self._spec = spec
        self._salter = salter
        self._conns: dict[str, http.client.HTTPConnection] = {}
        in_flight, queue, kv = LOAD_WEIGHTS
        self._load = Profile(
            [Weighted(InFlightScorer(), in_flight), Weighted(QueueDepthScorer(), queue), Weighted(KvUsageScorer(), kv)]
        )

    def pick(self, request: InferenceRequest, tenant: Tenant, candidates: Sequence[BackendState]) -> RoutingDecision:
        start = time.perf_counter()
        payload = orjson.dumps({**request.body, "cache_salt": self._salter.salt(tenant_scope(tenant))})
        cached = [self._cached_tokens(state, payload) for state in candidates]
        prompt = max(1, max(p for _, p in cached))
        cycle = Cycle(
            self._spec.clock.now(),
            self._spec.fresh_s,
            None,
            [0] * len(candidates),
            request.prompt_tokens + request.max_tokens,
        )
        load = self._load.run(request, candidates, cycle).totals
        share = sum(LOAD_WEIGHTS)
        totals = [
            (PREFIX_WEIGHT * c / prompt + share * lo) / (PREFIX_WEIGHT + share)
            for (c, _), lo in zip(cached, load, strict=True)
        ]
        bound = load_bound(candidates, self._spec.routing.epsilon)
        root = self._spec.secret.root(tenant_scope(tenant), request.model)
        best = max(
            (i for i, s in enumerate(candidates) if s.in_flight + 1 <= bound),
            key=lambda i: (totals[i], rendezvous(root, candidates[i].name)),
        )
        top = max(c for c, _ in cached)
        reason = "no_prefix" if top == 0 else "prefix_match" if cached[best][0] == top else "load_over_prefix"
        # in the engine's blocks, so that the answer's cache report (and the trace log's
        # predicted_cached_tokens) holds what the oracle expected: the engine's own count
        matched = [c // BLOCK_SIZE for c, _ in cached]
        detail = RouteDetail(tuple(s.name for s in candidates), matched, -(-prompt // BLOCK_SIZE), {}, totals, bound)
        return RoutingDecision(
            candidates[best],
            self.strategy,
            reason,
            matched[best],
            pick_s=time.perf_counter() - start,
            detail=detail,
        )

    def _cached_tokens(self, state: BackendState, payload: bytes) -> tuple[int, int]:
        conn = self._conns.get(state.name)
        if conn is None:
            url = urlsplit(state.backend.url)
            conn = self._conns[state.name] = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
        try:
            conn.request("POST", "/debug/prefix_cache", payload, {"content-type": "application/json"})
            answer = orjson.loads(conn.getresponse().read())
        except (OSError, http.client.HTTPException):
            conn.close()
            del self._conns[state.name]
            return 0, 1
        return int(answer["cached_tokens"]), int(answer["prompt_tokens"])

    def on_dispatch(self, request: InferenceRequest, tenant: Tenant, decision: RoutingDecision) -> None:
        pass

    def forget_backend(self, backend: str) -> None:
        pass

    def on_answer(self, request: InferenceRequest, decision: RoutingDecision, report: CacheReport) -> None:
        pass  # predicts no cache: nothing to correct


def serve_oracle_gateway(policy: str, port: int, admin_port: int) -> int:
    """``inference-gateway serve`` with the oracle strategy registered (the bench's gateway process)."""
    from gateway.cli import main as gateway_main

    salter = CacheSalter.from_env(SECRET_ENV)
    register_strategy("oracle", lambda spec: OracleRouter(spec, salter))
    return gateway_main(["serve", "--policy", policy, "--port", str(port), "--admin-port", str(admin_port)])


# -- the system under test ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class System:
    """Where a phase's servers listen: every port a free one, chosen when the phase starts."""

    engines: tuple[int, ...]
    gateways: tuple[int, ...]
    admins: tuple[int, ...]
    """The gateways' operator listeners (``/metrics``), in the order of ``gateways``."""

    @classmethod
    def free(cls, engines: int, replicas: int) -> System:
        return cls(
            tuple(free_port() for _ in range(engines)),
            tuple(free_port() for _ in range(replicas)),
            tuple(free_port() for _ in range(replicas)),
        )

    def gateway_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.gateways]

    def admin_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.admins]


def fleet_sections(redis_url: str, key_prefix: str, view: bool) -> str:
    """The policy sections of replicas that share Redis: capacity always, the prefix view or not."""
    return f"""state: {{backend: redis, redis_url: "{redis_url}", key_prefix: "{key_prefix}"}}
fleet: {{prefix_view: {"true" if view else "false"}}}
"""


CAPACITY = f"{{max_concurrent: 96, max_tokens_in_flight: 100000000, kv_cache_tokens: {KV_CACHE_TOKENS}}}"
WATCH = "health_checks: {interval_s: 2, timeout_s: 2}\nscrape: {interval_s: 0.5, timeout_s: 1}"
"""How the gateway watches its engines: health checks, and scrapes of /metrics (load signals and
restart detection, ``gateway/dispatch/scrape.py``)."""


def gateway_policy(
    k: float,
    strategy: str,
    engine_ports: Sequence[int],
    shared: str = "",
    capacity: str = CAPACITY,
    *,
    index: str = "",
    watch: str = WATCH,
) -> str:
    """The bench's policy; ``index`` is the routing index section (default: a TTL of 600 simulated s)."""
    backends = "\n".join(
        f"""  - {{name: engine-{i}, url: "http://127.0.0.1:{port}", kind: sim, models: [{MODEL}],
      engine_priority: true, timeouts: {{first_byte_s: {600 * k}, between_chunks_s: {600 * k}}},
      capacity: {capacity}}}"""
        for i, port in enumerate(engine_ports)
    )
    tenants = "\n".join(
        f"""  - {{name: t{i}, key_hashes: ["{hash_api_key(f"routing-key-t{i}")}"], models: ["*"],
      default_class: interactive}}"""
        for i in range(1, 9)
    )
    return f"""
version: routing-bench-{strategy}
classes:
  interactive:
    rank: 0
    slo: {{ttft_ms: {500 * k}, itl_ms: {30 * k}, e2e_ms: {120_000 * k}}}
    queue: {{max_depth: 512, max_wait_s: {10 * k}}}
  batch:
    rank: 1
    slo: {{ttft_ms: {2000 * k}, itl_ms: {100 * k}, e2e_ms: {600_000 * k}}}
    max_share: 0.5
    queue: {{max_depth: 1024, max_wait_s: {60 * k}}}
models:
  - name: {MODEL}
    max_prompt_tokens: 65536
    max_output_tokens: 2048
    routing: {{strategy: {strategy}, index: {index or f"{{ttl_s: {600 * k}}}"}}}
backends:
{backends}
tenants:
{tenants}
breaker: {{consecutive_failures: null, failure_ratio: null}}
{watch}
{shared}"""


@dataclass(frozen=True, slots=True)
class Fleet:
    """The gateways of a phase: one, or ``replicas`` sharing Redis (with the prefix view or not)."""

    replicas: int = 1
    view: bool = True
    redis_url: str = "redis://127.0.0.1:6379/0"
    shared: bool = True
    """Replicas share Redis (the ledger, and the prefix view when ``view``); False: nothing at all."""


SIM_OPTIONS = ("--profile", PROFILE, "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION))


@contextmanager
def system(
    k: float,
    strategy: str,
    fleet: Fleet = Fleet(),
    *,
    engines: int = ENGINES,
    sim_options: Sequence[str] = SIM_OPTIONS,
    capacity: str = CAPACITY,
) -> Iterator[System]:
    """Fresh engines (cold caches) and the gateway(s) routing with ``strategy``, every one on a
    free port; replicas of a fleet share Redis under a key prefix of their own, deleted at the end."""
    ports = System.free(engines, fleet.replicas)
    sim = [*GATEWAY, "sim", *sim_options, "--ports", ",".join(map(str, ports.engines))]
    with ExitStack() as stack:
        stack.enter_context(process([*sim, "--time-scale", str(k)], f"http://127.0.0.1:{ports.engines[-1]}/health"))
        shared = ""
        if fleet.replicas > 1 and fleet.shared:
            key_prefix = f"routing-bench-{os.getpid()}-{time.time_ns()}:"
            stack.callback(drop_keys, fleet.redis_url, key_prefix)
            shared = fleet_sections(fleet.redis_url, key_prefix, fleet.view)
        path = stack.enter_context(policy_file(gateway_policy(k, strategy, ports.engines, shared, capacity)))
        for port, admin in zip(ports.gateways, ports.admins, strict=True):
            if strategy == "oracle":
                serve = [sys.executable, "-m", "loadtests.proofs.routing_bench", "--serve-oracle", str(path)]
            else:
                serve = [*GATEWAY, "serve", "--policy", str(path)]
            argv = [*serve, "--admin-port", str(admin), "--port", str(port)]
            stack.enter_context(process(argv, f"http://127.0.0.1:{port}/readyz"))
        yield ports


def drop_keys(redis_url: str, key_prefix: str) -> None:
    """Delete a phase's keys (its ledger and its prefix-view stream)."""
    client = redis.Redis.from_url(redis_url)
    try:
        names = list(client.scan_iter(match=f"{key_prefix}*"))
        if names:
            client.delete(*names)
    finally:
        client.close()


def engine_counters(ports: Sequence[int]) -> list[dict[str, float]]:
    out = []
    for port in ports:
        samples = metrics(f"http://127.0.0.1:{port}")
        out.append(
            {
                "queries": metric_sum(samples, "vllm:prefix_cache_queries_total"),
                "hits": metric_sum(samples, "vllm:prefix_cache_hits_total"),
                "finished": metric_sum(samples, "vllm:request_success_total"),
                "steps": metric_sum(samples, "sim:step_lag_seconds_count"),
                "steps_late": metric_sum(samples, "sim:step_lag_seconds_count")
                - metric_sum(samples, "sim:step_lag_seconds_bucket", le="0.01"),
            }
        )
    return out


def gateway_routing(admin_urls: Sequence[str]) -> dict[str, Any]:
    """Routing figures summed over the gateways whose operator listeners are at ``admin_urls``."""
    count = picked_s = 0.0
    reasons: dict[str, float] = {}
    view: dict[str, float] = {}
    for url in admin_urls:
        samples = metrics(url)
        count += metric_sum(samples, "gateway_routing_pick_seconds_count")
        picked_s += metric_sum(samples, "gateway_routing_pick_seconds_sum")
        for (name, labels), value in samples.items():
            if name == "gateway_routing_decisions_total":
                reasons[dict(labels)["reason"]] = reasons.get(dict(labels)["reason"], 0.0) + value
            elif name == "gateway_fleet_prefix_decisions_total":
                view[dict(labels)["result"]] = view.get(dict(labels)["result"], 0.0) + value
    return {
        "pick_us_mean": 1e6 * picked_s / count if count else None,
        "decisions_by_reason": reasons,
        "prefix_view": view,
    }


# -- phases ------------------------------------------------------------------------------------

CHATS_UNDER_WAY = 3000
"""Requests of the chat workload planned and dropped before a phase (``chats_under_way``)."""


@contextmanager
def chats_under_way(skip: int) -> Iterator[None]:
    """Start every phase with its chats already under way, at their steady state.

    The load generator opens chats as requests arrive, so a run's first thousands of requests
    are short early turns: a flood (thousands of requests) would measure C on long steady-state
    chats while a phase at 0.7 C (a thousand requests) sends mostly early turns, a lighter
    load. Here the generator's request factory first plans and drops ``skip`` requests (128
    chat slots of 10-30 turns have all cycled by then, in 0.2 s), so every phase sends the
    same steady-state mix from its first request; the engines' caches still start cold, and
    the warmup fills them. The factory is swapped in the runner module for the phase only.
    """

    class UnderWay(RequestFactory):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            for index in range(skip):
                self.plan(index)

    with unittest.mock.patch.object(runner, "RequestFactory", UnderWay):
        yield


def run_phase(
    name: str,
    strategy: str,
    workload: Workload,
    rate: float,
    args: argparse.Namespace,
    warmup: float,
    *,
    flood: bool = False,
    fleet: Fleet = Fleet(),
) -> dict[str, Any]:
    """One phase: fresh system, the load for ``--phase-s`` wall seconds, figures over the window.

    The engines' counters are read at the start, at the end of the warmup, at the end of the
    load and after the drain: cache figures and the engines' completions per second are taken
    over the window of load (warmup to end), client figures over the requests sent in it.
    A ``flood`` is cut 5 simulated seconds after the load: only its engines' completions count.
    """
    k, phase_s = args.time_scale, args.flood_s if flood else args.phase_s
    with system(k, strategy, fleet) as ports:
        start_epoch = time.time()
        marks: dict[str, list[dict[str, float]]] = {"start": engine_counters(ports.engines)}
        timers = [
            threading.Timer(at, lambda mark=mark: marks.__setitem__(mark, engine_counters(ports.engines)))
            for mark, at in (("warm", warmup * phase_s), ("end", phase_s))
        ]
        for timer in timers:
            timer.start()
        config = RunConfig(
            target=ports.gateway_urls()[0],
            spread_to=tuple(ports.gateway_urls()[1:]),
            rate=rate,
            duration_s=phase_s,
            out_dir=args.out / name,
            seed=args.seed,
            time_scale=k,
            drain_timeout_s=(5 if flood else 60) * k,
        )
        skip = CHATS_UNDER_WAY if workload.conversation is not None else 0
        with chats_under_way(skip):
            result = run_sync(lambda: run_workload(workload, config, base_dir=WORKLOADS))
        for timer in timers:
            timer.join()
        marks["drained"] = engine_counters(ports.engines)
        routing = gateway_routing(ports.admin_urls())
    window_start = start_epoch + warmup * phase_s
    window = [r for r in result.records if r.t_send >= window_start]
    window_s = (1 - warmup) * phase_s / k
    finished = sum(b["finished"] - a["finished"] for a, b in zip(marks["warm"], marks["end"], strict=True))
    report = {
        "phase": name,
        "strategy": strategy,
        "replicas": fleet.replicas,
        "prefix_view": fleet.view if fleet.replicas > 1 else None,
        "rate_per_s": rate,
        "time_scale": k,
        "window_simulated_s": window_s,
        **figures(window, window_s, k),
        "engine_completed_per_s": finished / window_s,
        **cache_figures(marks["warm"], marks["end"]),
        "hit_rate_whole_phase": hit_rate(marks["start"], marks["drained"]),
        "routing": routing,
        "engine_steps_later_than_10ms": [
            round((b["steps_late"] - a["steps_late"]) / max(1.0, b["steps"] - a["steps"]), 4)
            for a, b in zip(marks["start"], marks["drained"], strict=True)
        ],
    }
    print(json.dumps(report, indent=1), flush=True)
    return report


def hit_rate(before: list[dict[str, float]], after: list[dict[str, float]]) -> float | None:
    queries = sum(b["queries"] - a["queries"] for a, b in zip(before, after, strict=True))
    hits = sum(b["hits"] - a["hits"] for a, b in zip(before, after, strict=True))
    return hits / queries if queries else None


def cache_figures(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, Any]:
    finished = [b["finished"] - a["finished"] for a, b in zip(before, after, strict=True)]
    per_engine = [
        (b["hits"] - a["hits"]) / (b["queries"] - a["queries"]) if b["queries"] > a["queries"] else None
        for a, b in zip(before, after, strict=True)
    ]
    return {
        "hit_rate": hit_rate(before, after),
        "hit_rate_per_engine": per_engine,
        "requests_per_engine": finished,
        "request_share_per_engine": [round(f / max(1.0, sum(finished)), 3) for f in finished],
    }


def figures(records: list[RequestRecord], simulated_s: float, k: float) -> dict[str, Any]:
    """Client-side figures in simulated units (the records' wall times divided by K)."""
    ok = [r for r in records if r.ok]
    ttft = sorted(r.ttft_s / k * 1000 for r in ok if r.ttft_s is not None)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or f"http_{r.status}"] = errors.get(r.error or f"http_{r.status}", 0) + 1
    return {
        "sent": len(records),
        "ok": len(ok),
        "errors": errors,
        "ttft_mean_ms": sum(ttft) / len(ttft) if ttft else None,
        "ttft_p50_ms": percentile(ttft, 50) if ttft else None,
        "ttft_p99_ms": percentile(ttft, 99) if ttft else None,
        "goodput_per_s": sum(r.slo_met for r in records) / simulated_s,
        "slo_attainment": sum(r.slo_met for r in records) / len(records) if records else None,
        "completed_per_s": len(ok) / simulated_s,
    }


def goals(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rr, ll, pa, oracle = (results.get(s) for s in STRATEGIES)
    out: dict[str, Any] = {}
    if pa is None:
        return out

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    if oracle is not None:
        value = ratio(pa["hit_rate"], oracle["hit_rate"])
        out["hit_rate_vs_oracle"] = {"value": value, "goal": ">= 0.9", "met": value is not None and value >= 0.9}
    if rr is not None:
        value = ratio(pa["hit_rate"], rr["hit_rate"])
        out["hit_rate_vs_round_robin"] = {"value": value, "goal": ">= 2", "met": value is not None and value >= 2}
        value = ratio(rr["ttft_mean_ms"], pa["ttft_mean_ms"])
        out["mean_ttft_gain_vs_round_robin"] = {"value": value, "goal": ">= 2", "met": value is not None and value >= 2}
        value = ratio(pa["goodput_per_s"], rr["goodput_per_s"])
        out["goodput_vs_round_robin"] = {"value": value, "goal": ">= 1.5", "met": value is not None and value >= 1.5}
    if ll is not None:
        value = ratio(pa["ttft_p99_ms"], ll["ttft_p99_ms"])
        out["p99_ttft_vs_least_load"] = {"value": value, "goal": "<= 1", "met": value is not None and value <= 1}
    return out


def fleet_phases(
    workload: Workload, rate: float, args: argparse.Namespace, one: dict[str, Any] | None
) -> dict[str, dict[str, Any]]:
    """One replica (unless the strategies' ``prefix_affinity`` phase ran), then ``--fleet`` N
    replicas with the prefix view and without it; the same load, spread at random over them."""
    n = args.fleet
    phases = {"one-replica": one or run_phase("fleet-1", "prefix_affinity", workload, rate, args, args.warmup)}
    for view in (True, False):
        name = f"fleet-{n}-{'view' if view else 'no-view'}"
        fleet = Fleet(replicas=n, view=view, redis_url=args.redis_url)
        phases[name] = run_phase(name, "prefix_affinity", workload, rate, args, args.warmup, fleet=fleet)
    return phases


def fleet_goals(phases: dict[str, dict[str, Any]], n: int) -> dict[str, Any]:
    """Proof 3 of issue 13: N replicas with the view keep >= 0.95 x one replica's hit rate and goodput."""
    one, many = phases["one-replica"], phases[f"fleet-{n}-view"]
    out = {}
    for figure in ("hit_rate", "goodput_per_s"):
        value = many[figure] / one[figure] if many[figure] is not None and one[figure] else None
        out[f"fleet_{n}_{figure}_vs_one_replica"] = {
            "value": value,
            "goal": ">= 0.95",
            "met": value is not None and value >= 0.95,
        }
    return out


# -- fleet on engines whose cache is their slots (issue 28) -------------------------------------

CONVERSATIONS = [(tenant, conv) for tenant in range(1, 9) for conv in range(1, 3)]
"""8 tenants x 2 conversations; each conversation runs its turns one after another."""
TURNS, AT_ONCE = 3, 2
SYSTEM_WORDS, USER_WORDS, REPLY_TOKENS = 900, 60, 32
SLOT_ENGINES, SLOTS = 2, 4
SLOT_CAPACITY = "{max_concurrent: 4, max_tokens_in_flight: 100000, kv_cache_tokens: 16384}"
_VOCAB = tuple(f"w{i}" for i in range(5000))


def _words(seed: str, count: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_VOCAB) for _ in range(count))


@dataclass(slots=True)
class Turn:
    tenant: int
    conv: int
    turn: int
    replica: int
    ttft_s: float | None
    status: int
    engine: str = ""
    """The engine that answered (the simulator's id prefix, random per engine), for diagnosis."""
    cached: int = 0
    """Prompt tokens the engine found cached (``usage.prompt_tokens_details.cached_tokens``)."""
    start: float = 0.0


@dataclass(slots=True)
class Reply:
    status: int
    ttft_s: float | None = None
    text: str = ""
    engine: str = ""
    cached: int = 0
    prompt: int = 0
    """The prompt's tokens as the engine counted them (``usage.prompt_tokens``)."""


async def _chat(
    client: httpx.AsyncClient,
    url: str,
    key: str,
    messages: list[dict[str, str]],
    *,
    max_tokens: int = REPLY_TOKENS,
    headers: dict[str, str] | None = None,
) -> Reply:
    """One streamed chat turn: status, seconds to the first content, the reply's text, who served it."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    reply = Reply(200)
    async with client.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}", **(headers or {})}
    ) as response:
        if response.status_code != 200:
            await response.aread()
            return Reply(response.status_code)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            reply.engine = str(chunk.get("id", ""))[len("chatcmpl-") :][:12]
            usage = chunk.get("usage") or {}
            reply.cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or reply.cached)
            reply.prompt = int(usage.get("prompt_tokens") or reply.prompt)
            for choice in chunk.get("choices", ()):
                content = (choice.get("delta") or {}).get("content")
                if content:
                    first = time.perf_counter() - start if first is None else first
                    parts.append(content)
    reply.ttft_s, reply.text = first, "".join(parts)
    return reply


async def _conversations(urls: Sequence[str], rep: int, seed: int) -> list[Turn]:
    """The issue's workload: the conversations in a per-repetition order, ``AT_ONCE`` at a time,
    each turn sent to a replica drawn at random (the same draw for every configuration)."""
    order = list(CONVERSATIONS)
    random.Random(f"{seed}-order-{rep}").shuffle(order)
    queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    for item in order:
        queue.put_nowait(item)
    turns: list[Turn] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            tenant, conv = queue.get_nowait()
            messages = [{"role": "system", "content": _words(f"{seed}-system-{tenant}", SYSTEM_WORDS)}]
            for turn in range(1, TURNS + 1):
                messages.append({"role": "user", "content": _words(f"{seed}-{tenant}-{conv}-{turn}", USER_WORDS)})
                replica = random.Random(f"{seed}-{rep}-{tenant}-{conv}-{turn}").randrange(len(urls))
                start = time.perf_counter()
                reply = await _chat(client, urls[replica], f"routing-key-t{tenant}", messages)
                turns.append(
                    Turn(tenant, conv, turn, replica, reply.ttft_s, reply.status, reply.engine, reply.cached, start)
                )
                messages.append({"role": "assistant", "content": reply.text})

    limits = httpx.Limits(max_connections=AT_ONCE * 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(AT_ONCE)))
    return turns


def slot_run(name: str, rep: int, fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration, one repetition: fresh engines and gateways, the conversations, the counters."""
    k = args.time_scale
    sim_options = ("--profile", PROFILE, "--cache-scope", args.cache_scope, "--max-num-seqs", str(SLOTS))
    load_start = list(os.getloadavg())
    with system(
        k, "prefix_affinity", fleet, engines=SLOT_ENGINES, sim_options=sim_options, capacity=args.slot_capacity
    ) as ports:
        before = engine_counters(ports.engines)
        turns = asyncio.run(_conversations(ports.gateway_urls(), rep, args.seed))
        after = engine_counters(ports.engines)
        routing = gateway_routing(ports.admin_urls())
    queries = [b["queries"] - a["queries"] for a, b in zip(before, after, strict=True)]
    hits = [b["hits"] - a["hits"] for a, b in zip(before, after, strict=True)]
    first = sorted(t.ttft_s / k * 1000 for t in turns if t.turn == 1 and t.ttft_s is not None)
    every = sorted(t.ttft_s / k * 1000 for t in turns if t.ttft_s is not None)

    engines: dict[str, int] = {}

    def pcts(values: list[float]) -> dict[str, float | None]:
        return {f"p{q}": round(percentile(values, q), 1) if values else None for q in (50, 95, 99)}

    report = {
        "config": name,
        "repetition": rep,
        "replicas": fleet.replicas,
        "shared": fleet.shared if fleet.replicas > 1 else None,
        "prefix_view": fleet.view if fleet.replicas > 1 and fleet.shared else None,
        "requests": len(turns),
        "ok": sum(t.status == 200 for t in turns),
        "errors": sorted(t.status for t in turns if t.status != 200),
        "prompt_tokens": sum(queries),
        "prompt_tokens_computed": sum(queries) - sum(hits),
        "cached_share": round(sum(hits) / sum(queries), 4) if sum(queries) else None,
        "computed_per_engine": [q - h for q, h in zip(queries, hits, strict=True)],
        "requests_per_engine": [b["finished"] - a["finished"] for a, b in zip(before, after, strict=True)],
        "first_turn_ttft_ms": pcts(first),
        "ttft_ms": pcts(every),
        "routing": routing,
        "turns": [
            [t.tenant, t.conv, t.turn, t.replica, engines.setdefault(t.engine, len(engines)), t.cached]
            for t in sorted(turns, key=lambda t: t.start)
        ],
        "turns_fields": ["tenant", "conversation", "turn", "replica", "engine", "cached_tokens"],
        "load_average_start": load_start,
        "load_average_end": list(os.getloadavg()),
    }
    print(json.dumps(report), flush=True)
    return report


def slot_fleet(args: argparse.Namespace) -> dict[str, Any]:
    """``--fleet N --cache-scope slots``: one process, N replicas with the prefix view, N sharing
    nothing, on engines whose prefix cache is their slots; repetitions interleaved (each runs the
    three configurations in turn, every one from cold caches)."""
    n = args.fleet
    configs = {
        "one-process": Fleet(),
        f"{n}-replicas-view": Fleet(replicas=n, view=True, redis_url=args.redis_url),
        f"{n}-replicas-nothing-shared": Fleet(replicas=n, shared=False),
    }
    if args.configs:
        configs = {name: fleet for name, fleet in configs.items() if name in args.configs.split(",")}
    runs = [
        slot_run(name, rep, fleet, args) for rep in range(1, args.repetitions + 1) for name, fleet in configs.items()
    ]
    one = {r["repetition"]: r["prompt_tokens_computed"] for r in runs if r["config"] == "one-process"}
    for r in runs:
        r["computed_vs_one_process"] = (
            round(r["prompt_tokens_computed"] / one[r["repetition"]], 3) if one.get(r["repetition"]) else None
        )
    totals = {name: sum(r["prompt_tokens_computed"] for r in runs if r["config"] == name) for name in configs}
    totals.setdefault(f"{n}-replicas-view", 0)
    ratio = totals[f"{n}-replicas-view"] / totals["one-process"] if totals.get("one-process") else None
    worst = max([r["computed_vs_one_process"] or 0.0 for r in runs if r["config"] == f"{n}-replicas-view"] or [0.0])
    return {
        "workload": {
            "tenants": 8,
            "conversations_per_tenant": 2,
            "turns": TURNS,
            "at_once": AT_ONCE,
            "system_words": SYSTEM_WORDS,
            "user_words": USER_WORDS,
            "reply_tokens": REPLY_TOKENS,
            "engines": SLOT_ENGINES,
            "slots_per_engine": SLOTS,
            "cache_scope": args.cache_scope,
            "engine_capacity": SLOT_CAPACITY,
            "time_scale": args.time_scale,
        },
        "runs": runs,
        "computed_total": totals,
        "goal": {
            "value": ratio,
            "worst_repetition": worst,
            "goal": "<= 1.05 (prompt tokens computed, N replicas with the view / one process, same run)",
            "met": ratio is not None and ratio <= 1.05 and worst <= 1.05,
        },
    }


def slot_summary(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [
        f"{w['engines']} engines x {w['slots_per_engine']} slots, cache scope {w['cache_scope']}; 8 tenants x 2 "
        f"conversations x {w['turns']} turns, {w['at_once']} at once, turns spread at random over the replicas; "
        f"K = {w['time_scale']:g}",
        f"{'run':34} {'computed':>9} {'vs one':>7} {'cached':>7} {'1st TTFT p50/p95/p99 ms':>24} "
        f"{'ok':>3}  per engine   load avg",
    ]
    for r in report["runs"]:
        t = r["first_turn_ttft_ms"]
        ttft = "/".join("-" if t[q] is None else f"{t[q]:.0f}" for q in ("p50", "p95", "p99"))
        lines.append(
            f"{r['config'] + ' #' + str(r['repetition']):34} {r['prompt_tokens_computed']:9.0f} "
            f"{r['computed_vs_one_process'] or 0:7.3f} {r['cached_share'] or 0:7.1%} {ttft:>24} {r['ok']:3d}  "
            f"{r['computed_per_engine']}  {_loads(r['load_average_start'])}"
        )
    for name, total in report["computed_total"].items():
        lines.append(f"total {name:28} {total:9.0f}")
    g = report["goal"]
    value = "-" if g["value"] is None else f"{g['value']:.3f}"
    lines.append(
        f"ratio {value} (worst repetition {g['worst_repetition']:.3f}), goal {g['goal']}: "
        + ("met" if g["met"] else "MISSED")
    )
    return "\n".join(lines) + "\n"


def _loads(values: list[float] | None) -> str:
    return " ".join(f"{v:.2f}" for v in values) if values else "-"


def summary(report: dict[str, Any]) -> str:
    """The report as a text table: one row per phase, then the goals."""

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        f"C = {report['C']:.2f} simulated req/s (flood under {report.get('capacity_strategy', '-')}); "
        f"K = {report['time_scale']:g}; phase {report['phase_s']:g} wall s, warmup {report['warmup']:g}; "
        f"load average {_loads(report.get('load_average_start'))} at the start, "
        f"{_loads(report.get('load_average_end'))} at the end",
        f"{'phase':26} {'req/s':>6} {'hit':>6} {'TTFT mean':>10} {'TTFT p99':>9} {'goodput':>8} "
        f"{'eng/s':>7} {'pick us':>8} {'late steps':>10}  share per engine",
    ]
    phases = [*report.get("capacity_phases", {}).values(), *report["strategies"].values()]
    phases += [ph for ph in report.get("fleet", {}).values() if ph not in phases]
    if "hot_prompt" in report:
        phases += [report["hot_capacity_phase"], report["hot_prompt"]]
    for ph in phases:
        late = max(ph["engine_steps_later_than_10ms"])
        lines.append(
            f"{ph['phase']:26} {ph['rate_per_s']:6.1f} {fmt(ph['hit_rate'], '6.1%')}"
            f" {fmt(ph['ttft_mean_ms'], '8.1f')}ms {fmt(ph['ttft_p99_ms'], '7.0f')}ms"
            f" {ph['goodput_per_s']:8.2f} {ph['engine_completed_per_s']:7.2f}"
            f" {fmt(ph['routing']['pick_us_mean'], '8.1f')} {late:10.1%}  {ph['request_share_per_engine']}"
        )
    for name, goal in report["goals"].items():
        lines.append(
            f"{name:34} {fmt(goal['value'], '.3f'):>7} (goal {goal['goal']}): {'met' if goal['met'] else 'MISSED'}"
        )
    return "\n".join(lines) + "\n"


# -- engine truth: the estimate, the closed loop, KV events and the oracle (issue 30) -----------

TRUTH_GPU_MEMORY_UTILIZATION = 0.26
"""A KV cache of 20,896 tokens per engine (``llama-3.1-8b-h100``): a few conversations and a few
direct prompts fill it, so it evicts all through a run."""
TRUTH_TTL_S = 600.0
"""The routing index's TTL in simulated seconds: the policy's default."""
UNWATCHED = "health_checks: {interval_s: 86400, timeout_s: 2}\nscrape: {interval_s: 0, timeout_s: 1}"
"""Restart detection off: one health check at start-up, no scrapes (``WATCH`` is the default)."""
RESTART_SIGNALS = {"restarted: forgetting": "scrape (work counters went back)", "is now unhealthy": "down"}
"""The gateway's log lines that void what it learnt of a backend (``BackendPool.restarted``,
``mark_down``: a failed health check or a refused connection), and what each says."""
_SYLLABLES = tuple(a + b + c for a in "bcdfghjklmnprstvz" for b in "aeiou" for c in "bdgklmnprst")
"""Three-letter words: one token each to the simulator's tokenizer, and four characters with the
space, one token to the gateway's estimate (``prefix_keys.CHARS_PER_TOKEN``): the index is sized in
the engine's tokens, so that what it gets wrong is what it cannot see, not a tokenizer's ratio."""


@dataclass(frozen=True, slots=True)
class TruthMode:
    """One way of knowing what the engines hold; every mode runs the same traffic from cold engines."""

    name: str
    strategy: str = "prefix_affinity"
    closed_loop: bool = False
    """``routing.index.closed_loop``: forget what an engine's answer says it no longer holds."""
    restart_detection: bool = False
    """Health checks every 2 s and scrapes (``WATCH``); off: neither (``UNWATCHED``), so that what
    makes a mode stop believing in a restarted engine's cache is its own mechanism."""
    built: bool = True
    what: str = ""


TRUTH_MODES = (
    TruthMode("estimate", what="the index of what was sent where, LRU-bounded, TTL"),
    TruthMode("closed-loop", closed_loop=True, what="the estimate, corrected by the answers' cached_tokens"),
    TruthMode("events", built=False, what="the engines' KV events (not built yet)"),
    TruthMode("oracle", strategy="oracle", what="each engine asked what it holds, for every request"),
    TruthMode(
        "estimate+detection",
        restart_detection=True,
        what="the estimate with the gateway's restart detection (health checks, scrapes)",
    ),
)


@dataclass(frozen=True, slots=True)
class TruthLoad:
    """The traffic of every mode: conversations of a few tenants through the gateway, a share of
    requests sent straight to the engines, one engine restarted halfway through."""

    engines: int = 3
    tenants: int = 4
    conversations: int = 6
    """Per tenant."""
    turns: int = 6
    at_once: int = 8
    """Workers; each sends a request once its previous one is answered."""
    interleave: int = 2
    """Conversations a worker holds open, taking their turns in turn."""
    system_words: int = 1500
    user_words: int = 100
    reply_tokens: int = 48
    direct_share: float = 0.2
    """Of all requests, those sent to an engine directly (a unique prompt each), behind the gateway's back."""
    direct_words: int = 3000
    direct_reply_tokens: int = 8
    gpu_memory_utilization: float = TRUTH_GPU_MEMORY_UTILIZATION
    restart_engine: int = 0

    @property
    def kv_cache_tokens(self) -> int:
        return get_profile(PROFILE, gpu_memory_utilization=self.gpu_memory_utilization).num_kv_blocks * BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class Step:
    """One request of a worker's plan: a conversation's turn (through the gateway), or a direct
    request to engine ``engine`` (``engine >= 0``)."""

    tenant: int = 0
    conv: int = 0
    turn: int = 0
    engine: int = -1
    seed: str = ""


def truth_plans(load: TruthLoad, rep: int, seed: int) -> list[list[Step]]:
    """Each worker's requests, the same in every mode of a repetition: the conversations in an order
    of the repetition's, dealt to the workers in turn; a worker holds ``interleave`` of its
    conversations open at once and takes their turns in turn (a user's think time, during which
    the others' requests go by); after each turn, direct requests at the rate that makes them
    ``direct_share`` of all (to an engine drawn at random)."""
    rng = random.Random(f"{seed}-truth-{rep}")
    conversations = [(t, c) for t in range(1, load.tenants + 1) for c in range(1, load.conversations + 1)]
    rng.shuffle(conversations)
    odds = load.direct_share / (1 - load.direct_share)
    plans: list[list[Step]] = [[] for _ in range(load.at_once)]
    for w, plan in enumerate(plans):
        mine = conversations[w :: load.at_once]
        for group in range(0, len(mine), load.interleave):
            for turn in range(1, load.turns + 1):
                for tenant, conv in mine[group : group + load.interleave]:
                    plan.append(Step(tenant, conv, turn))
                    for _ in range(int(odds) + (rng.random() < odds % 1)):
                        direct = f"{seed}-{rep}-direct-{w}-{len(plan)}"
                        plan.append(Step(engine=rng.randrange(load.engines), seed=direct))
    return plans


def _syllables(seed: str, count: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_SYLLABLES) for _ in range(count))


@dataclass(slots=True)
class Sent:
    step: Step
    reply: Reply
    start: float
    """Epoch seconds."""
    after_restart: bool


async def truth_traffic(
    load: TruthLoad, plans: list[list[Step]], gateway: str, engines: Sequence[str], restart: Any, seed: int
) -> list[Sent]:
    """Run the plans, ``load.at_once`` workers; halfway through its plan each worker waits until
    all are halfway (nothing in flight), ``restart()`` runs, and all go on: the restart comes at
    the same point of the traffic in every mode."""
    sent: list[Sent] = []
    waiting = 0
    everyone = asyncio.Event()
    resume = asyncio.Event()
    restarted = False

    async def halfway() -> None:
        nonlocal waiting
        waiting += 1
        if waiting == len(plans):
            everyone.set()
        await resume.wait()

    async def worker(plan: list[Step], client: httpx.AsyncClient) -> None:
        histories: dict[tuple[int, int], list[dict[str, str]]] = {}
        for index in range(len(plan) + 1):
            if index == len(plan) // 2:
                await halfway()
            if index == len(plan):
                return
            step, start = plan[index], time.time()
            if step.engine >= 0:  # fresh connections: the engine may have restarted since the last one
                messages = [{"role": "user", "content": _syllables(step.seed, load.direct_words)}]
                reply = await _chat(
                    client,
                    engines[step.engine],
                    "direct",
                    messages,
                    max_tokens=load.direct_reply_tokens,
                    headers={"connection": "close"},
                )
            else:
                system = {"role": "system", "content": _syllables(f"{seed}-system-{step.tenant}", load.system_words)}
                messages = histories.setdefault((step.tenant, step.conv), [system])
                user = _syllables(f"{seed}-{step.tenant}-{step.conv}-{step.turn}", load.user_words)
                messages.append({"role": "user", "content": user})
                reply = await _chat(
                    client, gateway, f"routing-key-t{step.tenant}", messages, max_tokens=load.reply_tokens
                )
                messages.append({"role": "assistant", "content": reply.text})
            sent.append(Sent(step, reply, start, restarted))

    async def coordinator() -> None:
        nonlocal restarted
        await everyone.wait()
        await asyncio.to_thread(restart)
        restarted = True
        resume.set()

    limits = httpx.Limits(max_connections=load.at_once * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await asyncio.gather(coordinator(), *(worker(plan, client) for plan in plans))
    return sent


class SimFleet:
    """Simulated engines, one process each (so that one restarts alone), each logging to a file."""

    def __init__(self, ports: Sequence[int], options: Sequence[str], logs: Path) -> None:
        self.ports = list(ports)
        self._options = list(options)
        self._logs = logs
        self._procs: list[subprocess.Popen[bytes]] = []
        self._stack = ExitStack()

    def __enter__(self) -> SimFleet:
        try:
            started = [self._spawn(i, "") for i in range(len(self.ports))]
            self._procs = [proc for proc, _ in started]
            for i, (proc, log) in enumerate(started):
                wait_ready(proc, f"http://127.0.0.1:{self.ports[i]}/health", log, 60.0)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stop_all(self._procs)
        self._stack.close()

    def restart(self, i: int) -> float:
        """Stop engine ``i`` and start a fresh one (an empty cache) on its port; the epoch seconds
        at which the fresh one answers."""
        stop(self._procs[i])
        self._procs[i], log = self._spawn(i, "-restarted")
        wait_ready(self._procs[i], f"http://127.0.0.1:{self.ports[i]}/health", log, 60.0)
        return time.time()

    def _spawn(self, i: int, suffix: str) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
        log = self._stack.enter_context((self._logs / f"engine-{i}{suffix}.log").open("w+b"))
        argv = [*GATEWAY, "sim", *self._options, "--port", str(self.ports[i])]
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log), log


@contextmanager
def logged_gateway(argv: list[str], port: int, log: Path, env: dict[str, str]) -> Iterator[None]:
    """A gateway process whose log is kept in ``log`` (the run reads its warnings afterwards)."""
    with log.open("w+b") as out:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=out, env=env)
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}/readyz", out, 60.0)
            yield
        finally:
            stop(proc)


def truth_policy(k: float, mode: TruthMode, engine_ports: Sequence[int], kv_tokens: int) -> str:
    capacity = f"{{max_concurrent: 96, max_tokens_in_flight: 100000000, kv_cache_tokens: {kv_tokens}}}"
    index = f"{{ttl_s: {TRUTH_TTL_S * k}, closed_loop: {'true' if mode.closed_loop else 'false'}}}"
    watch = WATCH if mode.restart_detection else UNWATCHED
    return gateway_policy(k, mode.strategy, engine_ports, capacity=capacity, index=index, watch=watch)


def truth_run(mode: TruthMode, rep: int, load: TruthLoad, args: argparse.Namespace) -> dict[str, Any]:
    """One mode, one repetition: fresh engines and gateway, the traffic with its restart, the figures."""
    if not mode.built:
        return {"mode": mode.name, "repetition": rep, "built": False}
    k = args.time_scale
    sim_options = ("--profile", PROFILE, "--gpu-memory-utilization", str(load.gpu_memory_utilization))
    ports = System.free(load.engines, 1)
    plans = truth_plans(load, rep, args.seed)
    marks: dict[str, Any] = {}
    load_start = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="routing-truth-") as folder, ExitStack() as stack:
        logs = Path(folder)
        engines = stack.enter_context(SimFleet(ports.engines, [*sim_options, "--time-scale", str(k)], logs))
        path = stack.enter_context(policy_file(truth_policy(k, mode, ports.engines, load.kv_cache_tokens)))
        if mode.strategy == "oracle":
            serve = [sys.executable, "-m", "loadtests.proofs.routing_bench", "--serve-oracle", str(path)]
        else:
            serve = [*GATEWAY, "serve", "--policy", str(path)]
        argv = [*serve, "--port", str(ports.gateways[0]), "--admin-port", str(ports.admins[0])]
        env = {**os.environ, "GATEWAY_TRACE_LOG": str(logs / "trace.jsonl")}
        stack.enter_context(logged_gateway(argv, ports.gateways[0], logs / "gateway.log", env))
        marks["start"] = engine_counters(ports.engines)

        def restart() -> None:
            marks["before_restart"] = engine_counters(ports.engines)
            marks["stopped_at"] = time.time()
            marks["restart_at"] = engines.restart(load.restart_engine)

        started = time.time()
        urls = [f"http://127.0.0.1:{p}" for p in ports.engines]
        sent = asyncio.run(truth_traffic(load, plans, ports.gateway_urls()[0], urls, restart, args.seed))
        ended = time.time()
        marks["end"] = engine_counters(ports.engines)
        through = sum(s.step.engine < 0 for s in sent)
        trace = logs / "trace.jsonl"
        wait_until(lambda: _lines(trace) >= through, timeout=30.0, what="the gateway's trace log")
        lines = [orjson.loads(line) for line in trace.read_bytes().splitlines() if line.strip()]
        gateway_metrics = metrics(ports.admin_urls()[0])
        log_text = (logs / "gateway.log").read_text(errors="replace")
    backend = f"engine-{load.restart_engine}"
    report = {
        "mode": mode.name,
        "repetition": rep,
        "built": True,
        "wall_s": round(ended - started, 1),
        **truth_figures(sent, k),
        "engines": engine_truth(marks, load.restart_engine),
        "restart": {
            "engine": backend,
            "down_s": round(marks["restart_at"] - marks["stopped_at"], 2),
            "after_s": round((ended - marks["restart_at"]) / k, 1),
            **stale_predictions(lines, backend, marks["restart_at"], k),
            "signals": restart_signals(log_text, backend, marks["stopped_at"], k),
        },
        "prediction": prediction_figures(gateway_metrics),
        "load_average_start": load_start,
        "load_average_end": list(os.getloadavg()),
    }
    print(json.dumps({key: v for key, v in report.items() if key != "engines"}), flush=True)
    return report


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def truth_figures(sent: Sequence[Sent], k: float) -> dict[str, Any]:
    """The gateway's requests: the engines' hit rate (cached over prompt tokens, as each answer
    said), the prompt tokens they computed, TTFT in simulated ms; before and after the restart."""

    def of(replies: list[Reply]) -> dict[str, Any]:
        ok = [r for r in replies if r.status == 200]
        prompt, cached = sum(r.prompt for r in ok), sum(r.cached for r in ok)
        ttft = sorted(r.ttft_s / k * 1000 for r in ok if r.ttft_s is not None)
        return {
            "requests": len(replies),
            "ok": len(ok),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "computed_tokens": prompt - cached,
            "hit_rate": round(cached / prompt, 4) if prompt else None,
            "ttft_ms": {f"p{q}": round(percentile(ttft, q), 1) if ttft else None for q in (50, 95)},
        }

    through = [s for s in sent if s.step.engine < 0]
    direct = [s.reply for s in sent if s.step.engine >= 0]
    return {
        **of([s.reply for s in through]),
        "after_restart": of([s.reply for s in through if s.after_restart]),
        "direct": {
            "requests": len(direct),
            "ok": sum(r.status == 200 for r in direct),
            "share": round(len(direct) / len(sent), 3) if sent else None,
            "prompt_tokens": sum(r.prompt for r in direct),
        },
    }


def engine_truth(marks: dict[str, Any], restarted: int) -> dict[str, Any]:
    """What the engines counted over the run (gateway and direct requests): the restarted engine's
    counters are its first process's until the restart plus its second's."""
    start, before, end = marks["start"], marks["before_restart"], marks["end"]

    def delta(i: int, key: str) -> float:
        if i == restarted:
            return float(before[i][key] - start[i][key] + end[i][key])
        return float(end[i][key] - start[i][key])

    queries = [delta(i, "queries") for i in range(len(start))]
    hits = [delta(i, "hits") for i in range(len(start))]
    steps = sum(delta(i, "steps") for i in range(len(start)))
    return {
        "prompt_tokens": sum(queries),
        "computed_tokens": sum(queries) - sum(hits),
        "computed_per_engine": [q - h for q, h in zip(queries, hits, strict=True)],
        "requests_per_engine": [delta(i, "finished") for i in range(len(start))],
        "steps_later_than_10ms": round(sum(delta(i, "steps_late") for i in range(len(start))) / steps, 4)
        if steps
        else None,
    }


def stale_predictions(lines: Sequence[dict[str, Any]], backend: str, restart_at: float, k: float) -> dict[str, Any]:
    """Requests the gateway sent to the restarted engine after its restart expecting it to hold
    more of the prompt than it was sent since (in the trace log's block chains, two blocks of
    slack as ``cache_report.MISS_SLACK_BLOCKS``): predictions from before the restart, which an
    empty cache cannot honour. When the last came (simulated s after the restart) is how long the
    mode took to stop believing in the old cache."""
    after = sorted((ln for ln in lines if (ln.get("t_dispatch") or 0) >= restart_at), key=lambda ln: ln["t_dispatch"])
    held: set[str] = set()
    routed = 0
    stale: list[tuple[float, int, int]] = []
    for line in after:
        if line.get("backend") != backend:
            continue
        routed += 1
        hashes, prompt = line.get("prefix_hashes") or [], line.get("tokens_in") or 0
        predicted = line.get("predicted_cached_tokens") or 0
        if hashes and prompt:
            sent_since = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
            if predicted > (sent_since + MISS_SLACK_BLOCKS) * prompt / len(hashes):
                stale.append(((line["t_dispatch"] - restart_at) / k, predicted, line.get("cached_tokens") or 0))
        held.update(hashes)
    last = stale[-1][0] if stale else None
    return {
        "routed_after": routed,
        "stale_hit_predictions": len(stale),
        "stale_predicted_tokens": sum(p for _, p, _ in stale),
        "stale_cached_tokens": sum(c for _, _, c in stale),
        "first_stale_s": round(stale[0][0], 2) if stale else None,
        "last_stale_s": round(last, 2) if last is not None else None,
        "routed_after_last_stale": sum(
            1
            for ln in after
            if ln.get("backend") == backend and last is not None and ln["t_dispatch"] > restart_at + last * k
        ),
    }


def restart_signals(log: str, backend: str, since: float, k: float) -> list[dict[str, Any]]:
    """The gateway's log lines, from the engine's stop on, that voided what it learnt of the
    restarted engine (``RESTART_SIGNALS``), with when (simulated s after the stop)."""
    found = []
    for line in log.splitlines():
        for needle, signal in RESTART_SIGNALS.items():
            if f"backend {backend} " in line and needle in line:
                at = _log_time(line)
                if at is not None and at >= since - 1:
                    found.append({"signal": signal, "after_stop_s": round((at - since) / k, 2)})
    return found


def _log_time(line: str) -> float | None:
    """The epoch seconds of a log line that starts with ``logging``'s asctime (local time)."""
    try:
        stamp, millis = line[:23].split(",")
        return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
    except ValueError:
        return None


def prediction_figures(samples: Samples) -> dict[str, Any]:
    """The gateway's own cache-truth counters: what it predicted, how much of it the engines held, misses."""
    predicted = metric_sum(samples, "gateway_predicted_cached_tokens_total")
    confirmed = metric_sum(samples, "gateway_predicted_cached_tokens_confirmed_total")
    return {
        "predicted_tokens": predicted,
        "confirmed_tokens": confirmed,
        "precision": round(confirmed / predicted, 4) if predicted else None,
        "misses": metric_sum(samples, "gateway_prefix_cache_misses_total"),
    }


def truth(args: argparse.Namespace, load: TruthLoad) -> dict[str, Any]:
    """``--truth``: every mode, ``--repetitions`` times interleaved (each repetition runs the modes
    in turn, every one from cold engines), and the goals over the repetitions' totals."""
    modes = [m for m in TRUTH_MODES if not args.modes or m.name in args.modes.split(",")]
    load_start = list(os.getloadavg())
    print(f"load average at the start: {_loads(load_start)}", flush=True)
    runs = [truth_run(mode, rep, load, args) for rep in range(1, args.repetitions + 1) for mode in modes]
    totals = {m.name: truth_totals([r for r in runs if r["mode"] == m.name]) for m in modes}
    return {
        "command": "python -m loadtests.proofs.routing_bench --truth " + " ".join(args.argv),
        "load": {
            **{f: getattr(load, f) for f in TruthLoad.__dataclass_fields__},
            "kv_cache_tokens": load.kv_cache_tokens,
            "time_scale": args.time_scale,
            "index_ttl_s": TRUTH_TTL_S,
            "profile": PROFILE,
        },
        "modes": {m.name: {"what": m.what, "built": m.built, "restart_detection": m.restart_detection} for m in modes},
        "runs": runs,
        "totals": totals,
        "goals": truth_goals(totals),
        "load_average_start": load_start,
        "load_average_end": list(os.getloadavg()),
    }


def truth_totals(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A mode over its repetitions: token sums (the hit rate of the sums), the medians of the
    repetitions' TTFT percentiles, each repetition's restart figures."""
    done = [r for r in runs if r.get("built")]
    if not done:
        return {"built": False}

    def rate(figures: list[dict[str, Any]]) -> float | None:
        prompt = sum(f["prompt_tokens"] for f in figures)
        return round(sum(f["cached_tokens"] for f in figures) / prompt, 4) if prompt else None

    def median(values: list[float | None]) -> float | None:
        known = sorted(v for v in values if v is not None)
        return percentile(known, 50) if known else None

    restarts = [r["restart"] for r in done]
    return {
        "built": True,
        "repetitions": len(done),
        "requests": sum(r["requests"] for r in done),
        "ok": sum(r["ok"] for r in done),
        "prompt_tokens": sum(r["prompt_tokens"] for r in done),
        "computed_tokens": sum(r["computed_tokens"] for r in done),
        "hit_rate": rate(done),
        "hit_rate_after_restart": rate([r["after_restart"] for r in done]),
        "hit_rate_per_repetition": [r["hit_rate"] for r in done],
        "ttft_p50_ms": median([r["ttft_ms"]["p50"] for r in done]),
        "ttft_p95_ms": median([r["ttft_ms"]["p95"] for r in done]),
        "stale_hit_predictions": [x["stale_hit_predictions"] for x in restarts],
        "last_stale_s": [x["last_stale_s"] for x in restarts],
        "routed_after_last_stale": [x["routed_after_last_stale"] for x in restarts],
        "after_restart_s": [x["after_s"] for x in restarts],
        "restart_signals": sorted({s["signal"] for x in restarts for s in x["signals"]}),
    }


def truth_goals(totals: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 30's goals, from the modes' totals; a goal of a mode not built says so, with no figure."""
    out: dict[str, Any] = {}
    est, loop, events, oracle = (totals.get(m, {}) for m in ("estimate", "closed-loop", "events", "oracle"))
    if events and not events.get("built"):
        out["events_hit_rate_vs_oracle"] = {"goal": ">= 0.98", "note": "events: not built"}
        out["events_stop_after_restart"] = {"goal": "within one event batch", "note": "events: not built"}
    elif events and oracle.get("built"):
        value = events["hit_rate"] / oracle["hit_rate"] if oracle["hit_rate"] else None
        out["events_hit_rate_vs_oracle"] = {
            "value": value,
            "goal": ">= 0.98",
            "met": value is not None and value >= 0.98,
        }
    if est.get("built") and loop.get("built") and oracle.get("built"):
        gap = oracle["hit_rate"] - est["hit_rate"]
        value = (loop["hit_rate"] - est["hit_rate"]) / gap if gap > 0 else None
        saved = est["computed_tokens"] - oracle["computed_tokens"]
        out["closed_loop_gap_recovered"] = {
            "value": value,
            "estimate_to_oracle_gap": round(gap, 4),
            "prefill_gap_recovered": (est["computed_tokens"] - loop["computed_tokens"]) / saved if saved > 0 else None,
            "goal": ">= 0.5 of the estimate's hit-rate loss to the oracle",
            "met": value is not None and value >= 0.5,
        }
    if est.get("built"):
        last = [v for v in est["last_stale_s"] if v is not None]
        stopped = all(
            v is None or (v < TRUTH_TTL_S and after > 0)
            for v, after in zip(est["last_stale_s"], est["routed_after_last_stale"], strict=True)
        )
        out["estimate_stops_within_ttl"] = {
            "value": max(last) if last else None,
            "goal": f"the last stale hit prediction on the restarted engine within the index TTL ({TRUTH_TTL_S:g} s), "
            "and requests routed there after it",
            "met": stopped,
        }
    return out


def truth_summary(report: dict[str, Any]) -> str:
    """The report as text: the load, a row per mode (totals), a row per run, the goals."""
    w = report["load"]
    lines = [
        f"{w['engines']} engines ({w['profile']}, KV cache {w['kv_cache_tokens']} tokens each), "
        f"engine-{w['restart_engine']} restarted halfway; {w['tenants']} tenants x {w['conversations']} "
        f"conversations x {w['turns']} turns, {w['at_once']} workers x {w['interleave']} open; system prompts "
        f"{w['system_words']} tokens, user turns {w['user_words']}, replies {w['reply_tokens']}; "
        f"{w['direct_share']:.0%} of requests sent straight to an engine ({w['direct_words']}-token prompts); "
        f"K = {w['time_scale']:g}; index TTL {w['index_ttl_s']:g} s",
        f"load average {_loads(report['load_average_start'])} at the start, "
        f"{_loads(report['load_average_end'])} at the end",
        "",
        f"{'mode':20} {'hit rate':>8} {'after restart':>13} {'prefill computed':>16} {'TTFT p50':>9} "
        f"{'TTFT p95':>9}  stale hit predictions on the restarted engine: count; last (s after the restart); "
        "forget signals",
    ]
    for name, t in report["totals"].items():
        if not t.get("built"):
            lines.append(f"{name:20} not built")
            continue
        last = " ".join("-" if v is None else f"{v:.1f}" for v in t["last_stale_s"])
        stale = " ".join(map(str, t["stale_hit_predictions"]))
        lines.append(
            f"{name:20} {t['hit_rate']:8.1%} {t['hit_rate_after_restart'] or 0:13.1%} {t['computed_tokens']:16,.0f} "
            f"{_ms(t['ttft_p50_ms']):>9} {_ms(t['ttft_p95_ms']):>9}  {stale}; {last}; "
            f"{', '.join(t['restart_signals']) or 'none'}"
        )
    lines += [
        "",
        f"{'run':26} {'hit rate':>8} {'after restart':>13} {'computed':>9} {'all':>9} {'late':>6}  load avg",
    ]
    for r in report["runs"]:
        if r.get("built"):
            lines.append(
                f"{r['mode'] + ' #' + str(r['repetition']):26} {r['hit_rate']:8.1%} "
                f"{r['after_restart']['hit_rate'] or 0:13.1%} {r['computed_tokens']:9,.0f} "
                f"{r['engines']['computed_tokens']:9,.0f} {r['engines']['steps_later_than_10ms'] or 0:6.1%}  "
                f"{_loads(r['load_average_start'])}"
            )
    lines.append("")
    for name, goal in report["goals"].items():
        if goal.get("note"):
            lines.append(f"{name}: {goal['note']} (goal {goal['goal']})")
        else:
            value = "-" if goal["value"] is None else f"{goal['value']:.3f}"
            lines.append(f"{name}: {value} (goal {goal['goal']}): {'met' if goal['met'] else 'MISSED'}")
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--serve-oracle", metavar="POLICY", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--admin-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--phase-s", type=float, default=120.0, help="wall seconds of load per phase")
    parser.add_argument("--warmup", type=float, default=0.35, help="share of each phase before the window")
    parser.add_argument("--load", type=float, default=0.7, help="offered load as a share of capacity")
    parser.add_argument("--capacity", type=float, default=None, help="skip measuring: C in simulated req/s")
    parser.add_argument(
        "--capacity-strategies",
        default="prefix_affinity",
        help="strategies whose flood is measured; C is the first one's completions/s",
    )
    parser.add_argument("--flood-rate", type=float, default=120.0, help="simulated req/s offered in a flood")
    parser.add_argument("--flood-s", type=float, default=150.0, help="wall seconds of a flood phase")
    parser.add_argument("--hot", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--hot-time-scale",
        type=float,
        default=12.0,
        help="K of the hot-prompt phases: short cached requests stream ~4x the tokens per second",
    )
    parser.add_argument("--hot-flood-rate", type=float, default=400.0, help="simulated req/s of the hot flood")
    parser.add_argument(
        "--fleet",
        type=int,
        default=0,
        metavar="N",
        help="also run prefix_affinity on N replicas sharing Redis, requests spread at random, with and "
        "without the prefix view, against one replica in the same run (issue 13, proof 3)",
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the fleet's Redis")
    parser.add_argument(
        "--cache-scope",
        choices=("pool", "slots", "running"),
        default="pool",
        help="with --fleet: engines whose prefix cache is their slots (slots, running) run the issue-28 "
        "conversations instead of the phases above (see slot_fleet)",
    )
    parser.add_argument("--repetitions", type=int, default=3, help="interleaved repetitions (slot-scoped fleet)")
    parser.add_argument("--configs", default="", help=argparse.SUPPRESS)  # a subset, for diagnosis
    parser.add_argument("--slot-capacity", default=SLOT_CAPACITY, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="default: loadtests/results/routing[-truth]")
    truth_options = parser.add_argument_group("engine truth (--truth, issue 30)")
    truth_options.add_argument(
        "--truth",
        action="store_true",
        help="the estimate, the closed loop, KV events and the oracle on engines that evict, with a restart "
        "and traffic behind the gateway's back, --repetitions times interleaved (see the module docstring)",
    )
    truth_options.add_argument("--modes", default="", help="a subset of the modes, comma-separated")
    for field, spec in TruthLoad.__dataclass_fields__.items():
        kind = float if isinstance(spec.default, float) else int
        truth_options.add_argument(
            f"--{field.replace('_', '-')}", dest=f"truth_{field}", type=kind, default=spec.default
        )
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.serve_oracle:
        return serve_oracle_gateway(args.serve_oracle, args.port, args.admin_port)
    os.environ.setdefault(SECRET_ENV, BENCH_SECRET)
    if args.truth:
        args.argv = [a for a in argv if a != "--truth"]
        load = TruthLoad(**{f: getattr(args, f"truth_{f}") for f in TruthLoad.__dataclass_fields__})
        out = args.out or Path("loadtests/results/routing-truth")
        truth_report = truth(args, load)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(truth_report, indent=1))
        text = truth_summary(truth_report)
        (out / "summary.txt").write_text(text)
        print(text, flush=True)
        return 0
    args.out = args.out or Path("loadtests/results/routing")
    if args.fleet > 1 and args.cache_scope != "pool":
        slot_report = slot_fleet(args)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "routing-fleet-running.json").write_text(json.dumps(slot_report, indent=1))
        text = slot_summary(slot_report)
        (args.out / "summary.txt").write_text(text)
        print(text, flush=True)
        return 0
    workload = load_workload(WORKLOADS / "routing.yaml")
    report: dict[str, Any] = {
        "time_scale": args.time_scale,
        "phase_s": args.phase_s,
        "warmup": args.warmup,
        "load_average_start": list(os.getloadavg()),
    }
    capacity = args.capacity
    if capacity is None:
        floods = {
            s: run_phase(f"capacity-{s}", s, workload, args.flood_rate, args, args.warmup, flood=True)
            for s in args.capacity_strategies.split(",")
        }
        capacity = next(iter(floods.values()))["engine_completed_per_s"]
        report["capacity_phases"] = floods
        report["capacity_strategy"] = next(iter(floods))
    report["C"] = capacity
    print(f"capacity C = {capacity:.2f} simulated requests/s; offered {args.load:g} C", flush=True)
    results = {
        s: run_phase(s, s, workload, args.load * capacity, args, args.warmup) for s in args.strategies.split(",") if s
    }
    report["strategies"] = results
    report["goals"] = goals(results)
    if args.fleet > 1:
        report["fleet"] = fleet_phases(workload, args.load * capacity, args, results.get("prefix_affinity"))
        report["goals"].update(fleet_goals(report["fleet"], args.fleet))
    if args.hot:
        hot = load_workload(WORKLOADS / "routing-hot.yaml")
        hot_args = argparse.Namespace(**{**vars(args), "time_scale": args.hot_time_scale})
        hot_flood = run_phase("capacity-hot", "least_load", hot, args.hot_flood_rate, hot_args, args.warmup, flood=True)
        report["hot_capacity_phase"] = hot_flood
        one_engine = hot_flood["engine_completed_per_s"] / ENGINES
        report["hot_prompt"] = run_phase("hot-prompt", "prefix_affinity", hot, 2 * one_engine, hot_args, 0.2)
        # offered twice one engine's capacity, an engine serving more than half of it would be overloaded
        top = max(report["hot_prompt"]["request_share_per_engine"])
        report["goals"]["hot_prompt_top_engine_share"] = {"value": top, "goal": "<= 0.5", "met": top <= 0.5}
    report["load_average_end"] = list(os.getloadavg())
    print(json.dumps({"C": capacity, "goals": report["goals"]}, indent=1), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing.json").write_text(json.dumps(report, indent=1))
    text = summary(report)
    (args.out / "summary.txt").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
