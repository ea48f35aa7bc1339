"""Prefix-aware routing proven on load: cache hits, TTFT and goodput per strategy; a hot prompt's spread.

Usage::

    python -m loadtests.proofs.routing_bench [--strategies round_robin,least_load,prefix_affinity,oracle]
                                      [--time-scale 4] [--phase-s 300] [--hot] [--fleet N]
                                      [--out loadtests/results/routing]
    python -m loadtests.proofs.routing_bench --fleet 3 --cache-scope slots [--repetitions 3]
                                      --out loadtests/results/routing-fleet-running
    python -m loadtests.proofs.routing_bench --truth ...   # = python -m loadtests.proofs.routing_truth ...

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

The oracle (``routing_system.OracleRouter``) knows every engine's cache: for each candidate it
asks the engine how many prompt tokens its prefix cache holds for this very request, then weighs
that exactly as ``prefix_affinity`` weighs its estimate. It is the ceiling of what a better index
could reach (``loadtests/proofs/routing_system.py`` says how; it and the policy, a chat turn and
the engines' counters are what this bench shares with ``routing_truth``).

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

* engine truth (``--truth``, issue 30): ``loadtests/proofs/routing_truth.py``; ``--truth`` here
  runs it with the options that follow (the committed results quote this command).

Goals (issue 5): hit rate >= 0.9 x the oracle's and >= 2 x round-robin's; mean TTFT at least 2 x
better than round-robin's; P99 TTFT no worse than least_load's; goodput >= 1.5 x round-robin's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
import unittest.mock
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from loadtests.harness.processes import GATEWAY, metric_sum, metrics, policy_file, process
from loadtests.loadgen import runner
from loadtests.loadgen.prompts import RequestFactory
from loadtests.loadgen.records import RequestRecord
from loadtests.loadgen.runner import RunConfig, run_sync, run_workload
from loadtests.loadgen.stats import percentile
from loadtests.loadgen.workload import Workload, load_workload
from loadtests.proofs import routing_truth
from loadtests.proofs.routing_system import (
    BENCH_SECRET,
    PROFILE,
    SECRET_ENV,
    System,
    chat,
    engine_counters,
    gateway_policy,
    loads,
    serve_argv,
    tenant_key,
)
from loadtests.sim.profiles import BLOCK_SIZE, get_profile

ENGINES = 4
GPU_MEMORY_UTILIZATION = 0.5  # see the module docstring: a KV cache of 167k tokens per engine
KV_CACHE_TOKENS = get_profile(PROFILE, gpu_memory_utilization=GPU_MEMORY_UTILIZATION).num_kv_blocks * BLOCK_SIZE
WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"
STRATEGIES = ("round_robin", "least_load", "prefix_affinity", "oracle")


# -- the system under test ---------------------------------------------------------------------


def fleet_sections(redis_url: str, key_prefix: str, view: bool) -> str:
    """The policy sections of replicas that share Redis: capacity always, the prefix view or not."""
    return f"""state: {{backend: redis, redis_url: "{redis_url}", key_prefix: "{key_prefix}"}}
fleet: {{prefix_view: {"true" if view else "false"}}}
"""


CAPACITY = f"{{max_concurrent: 96, max_tokens_in_flight: 100000000, kv_cache_tokens: {KV_CACHE_TOKENS}}}"


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
        path = stack.enter_context(policy_file(gateway_policy(k, strategy, ports.engines, capacity, shared)))
        for port, admin in zip(ports.gateways, ports.admins, strict=True):
            argv = serve_argv(strategy, str(path), port, admin)
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
                reply = await chat(client, urls[replica], tenant_key(tenant), messages, max_tokens=REPLY_TOKENS)
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
            f"{r['computed_per_engine']}  {loads(r['load_average_start'])}"
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


def summary(report: dict[str, Any]) -> str:
    """The report as a text table: one row per phase, then the goals."""

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        f"C = {report['C']:.2f} simulated req/s (flood under {report.get('capacity_strategy', '-')}); "
        f"K = {report['time_scale']:g}; phase {report['phase_s']:g} wall s, warmup {report['warmup']:g}; "
        f"load average {loads(report.get('load_average_start'))} at the start, "
        f"{loads(report.get('load_average_end'))} at the end",
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--truth" in argv:  # the engine-truth bench under its first name: the committed results quote it
        return routing_truth.main(
            [a for a in argv if a != "--truth"], command="python -m loadtests.proofs.routing_bench --truth"
        )
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--truth",
        action="store_true",
        help="run python -m loadtests.proofs.routing_truth with the other options (see its --help)",
    )
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
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/routing"))
    args = parser.parse_args(argv)
    os.environ.setdefault(SECRET_ENV, BENCH_SECRET)
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
