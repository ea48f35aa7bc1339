"""Engine truth (issue 30): how well the gateway knows what the engines hold, mode against mode.

Usage::

    python -m loadtests.proofs.routing_truth [--config default|pressure] [--repetitions 3]
                                             [--modes estimate,closed-loop,events,oracle,estimate+detection]
                                             [--tenants 8 --direct-share 0.3 ...] [--out DIR]
    python -m loadtests.proofs.routing_bench --truth ...    # the same (the first results quote it)

Results: ``loadtests/results/routing-truth/`` (``--config default``) and
``loadtests/results/routing-truth-pressure/`` (``--config pressure``), ``results.json`` and
``summary.txt`` (``routing_truth_report`` computes the figures and writes the table).

Simulated engines (``llama-3.1-8b-h100``) whose KV cache evicts (``TRUTH_GPU_MEMORY_UTILIZATION``:
20,896 tokens each), with a share of requests (``--direct-share``, 20%) sent straight to the
engines behind the gateway's back (unique long prompts that fill their caches), and one engine
(``--restart-engine``) restarted halfway: its process stopped and started again on its port,
empty. The traffic (``truth_plans``): conversations of several tenants with long system prompts,
each worker holding a few open and taking their turns in turn; halfway through, every worker
waits until all are there (nothing in flight), the engine restarts, and all go on, so the restart
comes at the same point in every mode.

Modes (``TRUTH_MODES``), each from cold engines, the repetitions interleaved:

* ``estimate``: the index of what was sent where (``routing.index.closed_loop: false``);
* ``closed-loop``: the index corrected by the answers' cached tokens;
* ``events``: the engines' KV events: each backend's ``kv_events`` (the engine's PUB and replay
  sockets, and how it hashes its blocks: ``sha256_cbor``, seed ``"0"``, the simulator's block
  size) and the model's ``tokenizer`` (the bench's ``tokenizer.json`` and the simulator's ChatML
  template), so that the gateway computes each request's block hashes as the engine does and asks
  the engines' own indexes;
* ``oracle``: each engine asked what it holds, for every request (``routing_system.OracleRouter``);
* ``estimate+detection``: the estimate with the gateway's restart detection.

All but the last run with restart detection off (no scrapes, one health check at start-up, no
request in flight across the restart: ``UNWATCHED``), so that what makes a mode stop believing in
the restarted engine's old cache is its own mechanism; the last shows what the gateway's watch
adds (which log line voided the engine's index, when).

Every mode runs on the same engines (``routing_truth_engines``): each started with the bench's
tokenizer (a word-level ``tokenizer.json`` built at run time in the run's folder), the ChatML
template, hash seed 0 and its KV-event sockets, so that what differs between modes is the gateway's
policy alone. One word is one token to that tokenizer, as to the simulator's own, so the load is the
one the first results measured. ``--engine-tokenizer sim`` starts the engines as the first results
did (the simulator's tokenizer, no KV events; the events mode then does not run).

Figures, over the gateway's requests: the hit rate (cached over prompt tokens, as each answer
said), prompt tokens computed, TTFT P50/P95, and the stale hit predictions on the restarted engine
after the restart (``routing_truth_report.stale_predictions``, from the gateway's trace log): how
many, and when the last came; for ``events``, also when the gateway's index of the restarted
engine was seen empty (``/admin/backends``, ``kv_events.blocks``, polled from the engine's stop
on: ``IndexWatch``) and how many stale predictions came after that. Goals: events >= 0.98 x the
oracle's hit rate; events stop predicting hits on the restarted engine within one event batch
(none once its index is emptied); the closed loop recovers at least half of the estimate's
hit-rate loss to the oracle; the estimate stops within its TTL.

Configurations (``CONFIGS``; any field can be set on its own, ``--tenants 6``): ``default`` (the
first results: little eviction, the estimate and the oracle within a point) and ``pressure``
(half of the requests behind the gateway's back: see ``PRESSURE`` for the trials behind it).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtests.harness.processes import (
    metrics,
    policy_file,
    stop,
    wait_ready,
    wait_until,
)
from loadtests.loadgen.stats import percentile
from loadtests.proofs.routing_system import (
    ADMIN_KEY,
    BENCH_SECRET,
    MODEL,
    PROFILE,
    SECRET_ENV,
    TENANTS,
    WATCH,
    Reply,
    System,
    chat,
    engine_counters,
    gateway_policy,
    loads,
    serve_argv,
    tenant_key,
)
from loadtests.proofs.routing_truth_engines import CHAT_TEMPLATE, SYLLABLES, Engines, SimFleet, write_tokenizer
from loadtests.proofs.routing_truth_report import (
    engine_truth,
    prediction_figures,
    restart_signals,
    stale_predictions,
    truth_goals,
    truth_summary,
    truth_totals,
)
from loadtests.sim.profiles import BLOCK_SIZE, get_profile

RESULTS = Path("loadtests/results")
TRUTH_GPU_MEMORY_UTILIZATION = 0.26
"""A KV cache of 20,896 tokens per engine (``llama-3.1-8b-h100``): a few conversations and a few
direct prompts fill it, so it evicts all through a run."""
TRUTH_TTL_S = 600.0
"""The routing index's TTL in simulated seconds: the policy's default."""
UNWATCHED = "health_checks: {interval_s: 86400, timeout_s: 2}\nscrape: {interval_s: 0, timeout_s: 1}"
"""Restart detection off: one health check at start-up, no scrapes (``WATCH`` is the default)."""


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
    events: bool = False
    """The backends' ``kv_events`` with their hashing, and the model's tokenizer: route on the engines' indexes."""
    built: bool = True
    what: str = ""


TRUTH_MODES = (
    TruthMode("estimate", what="the index of what was sent where, LRU-bounded, TTL"),
    TruthMode("closed-loop", closed_loop=True, what="the estimate, corrected by the answers' cached_tokens"),
    TruthMode("events", events=True, what="the engines' KV events: their own indexes, hashes computed by the gateway"),
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


PRESSURE = TruthLoad(direct_share=0.5)
"""More eviction than ``default``: half of all requests go straight to the engines (3,000-token
unique prompts, a seventh of an engine's cache each), so every engine's cache turns over between
two turns of a conversation and the estimate's index, which sees only the gateway's half, believes
in blocks long evicted. Chosen by single-repetition trials of estimate and oracle (seed 1 unless
said; hit rates estimate/oracle): direct share 0.4 gave 78.8/83.2% (the simulator's tokenizer),
82.8/81.5% (the bench's); 0.5 gave 73.6/78.1%, 77.2/78.1%, and 75.8/75.4% with seed 2. More tenants
(8, at 0.35) gave 77.3/79.1%, a smaller cache (``--gpu-memory-utilization 0.25``) 83.4/81.9%: a
repetition varies by 2-4 points, and under eviction the oracle, greedy on what is cached now, is no
ceiling (it spreads a tenant's prompt where the estimate keeps it together)."""
CONFIGS = {"default": TruthLoad(), "pressure": PRESSURE}
"""The committed configurations, by name: ``default`` as the first results ran it."""


def results_dir(config: str) -> Path:
    return RESULTS / ("routing-truth" if config == "default" else f"routing-truth-{config}")


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
    return " ".join(rng.choice(SYLLABLES) for _ in range(count))


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
                reply = await chat(
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
                reply = await chat(client, gateway, tenant_key(step.tenant), messages, max_tokens=load.reply_tokens)
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


class IndexWatch:
    """When the gateway dropped what its KV-event index held of one backend (``GET /admin/backends``,
    ``kv_events.blocks``), polled every ``interval_s`` in a thread from ``start()`` to ``stop()``.

    Started just before the engine's stop. The stopped engine sends nothing more, so its index keeps
    its count until the feed hears the fresh engine: ``AllBlocksCleared`` (empty), or a batch whose
    number went back (the subscriber clears the index, replays the fresh engine's batches from 0 and
    applies them, so the index may hold the fresh engine's few blocks by the next reading). The first
    reading below the count at the stop is when the gateway learnt of the restart (``cleared_at``),
    to within ``interval_s`` and one poll; ``readings`` keeps each change seen, for diagnosis."""

    def __init__(self, admin_url: str, backend: str, *, interval_s: float = 0.01) -> None:
        self._url = f"{admin_url}/admin/backends"
        self._backend = backend
        self._interval_s = interval_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, name=f"index-watch-{backend}", daemon=True)
        self.cleared_at: float | None = None
        self.blocks_at_start: int | None = None
        self.readings: list[tuple[float, int | None]] = []

    def blocks(self, client: httpx.Client) -> int | None:
        answer = client.get(self._url, headers={"authorization": f"Bearer {ADMIN_KEY}"})
        answer.raise_for_status()
        for backend in answer.json()["backends"]:
            if backend["name"] == self._backend and backend.get("kv_events"):
                return int(backend["kv_events"]["blocks"])
        return None

    def start(self) -> IndexWatch:
        self._thread.start()
        return self

    def stop(self) -> float | None:
        self._done.set()
        self._thread.join()
        return self.cleared_at

    def _poll(self) -> None:
        with httpx.Client(timeout=5.0) as client:
            self.blocks_at_start = start = self.blocks(client)
            self.readings.append((time.time(), start))
            while not self._done.is_set():
                blocks = self.blocks(client)
                if blocks != self.readings[-1][1]:
                    self.readings.append((time.time(), blocks))
                if blocks is not None and start is not None and (blocks < start or blocks == 0):
                    self.cleared_at = self.readings[-1][0]
                    return
                self._done.wait(self._interval_s)


def truth_policy(k: float, mode: TruthMode, engine_ports: Sequence[int], load: TruthLoad, engines: Engines) -> str:
    """The gateway's policy in ``mode``: the estimate's index section, the watch or none, and for
    events each backend's ``kv_events`` and the model's tokenizer (absolute paths: the policy file
    lives elsewhere)."""
    capacity = f"{{max_concurrent: 96, max_tokens_in_flight: 100000000, kv_cache_tokens: {load.kv_cache_tokens}}}"
    index = f"{{ttl_s: {TRUTH_TTL_S * k}, closed_loop: {'true' if mode.closed_loop else 'false'}}}"
    watch = WATCH if mode.restart_detection else UNWATCHED
    backend_fields: list[str] = []
    model_fields = ""
    if mode.events:
        backend_fields = [engines.kv_events(i) for i in range(len(engine_ports))]
        model_fields = f'tokenizer: {{path: "{engines.tokenizer}", chat_template: "{CHAT_TEMPLATE}"}}'
    return gateway_policy(
        k,
        mode.strategy,
        engine_ports,
        capacity,
        index=index,
        watch=watch,
        backend_fields=backend_fields,
        model_fields=model_fields,
        tenants=max(TENANTS, load.tenants),
    )


def not_runnable(mode: TruthMode, engine_tokenizer: str) -> str | None:
    """Why ``mode`` cannot run on these engines, or None."""
    if not mode.built:
        return "not built"
    if mode.events and engine_tokenizer != "bench":
        return "not run: the engines count with the simulator's tokenizer and publish no KV events"
    return None


def truth_run(mode: TruthMode, rep: int, load: TruthLoad, args: argparse.Namespace) -> dict[str, Any]:
    """One mode, one repetition: fresh engines and gateway, the traffic with its restart, the figures."""
    why = not_runnable(mode, args.engine_tokenizer)
    if why:
        return {"mode": mode.name, "repetition": rep, "built": False, "why": why}
    k = args.time_scale
    ports = System.free(load.engines, 1)
    plans = truth_plans(load, rep, args.seed)
    marks: dict[str, Any] = {}
    backend = f"engine-{load.restart_engine}"
    load_start = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="routing-truth-") as folder, ExitStack() as stack:
        logs = Path(folder)
        tokenizer = write_tokenizer(logs / "tokenizer.json") if args.engine_tokenizer == "bench" else None
        setup = Engines.of(load.engines, tokenizer)
        options = [setup.options(i, load.gpu_memory_utilization, k) for i in range(load.engines)]
        engines = stack.enter_context(SimFleet(ports.engines, options, logs))
        path = stack.enter_context(policy_file(truth_policy(k, mode, ports.engines, load, setup)))
        argv = serve_argv(mode.strategy, str(path), ports.gateways[0], ports.admins[0], log_level="info")
        env = {**os.environ, "GATEWAY_TRACE_LOG": str(logs / "trace.jsonl")}
        stack.enter_context(logged_gateway(argv, ports.gateways[0], logs / "gateway.log", env))
        marks["start"] = engine_counters(ports.engines)
        watch = IndexWatch(ports.admin_urls()[0], backend) if mode.events else None

        def restart() -> None:
            marks["before_restart"] = engine_counters(ports.engines)
            if watch is not None:
                watch.start()
            marks["stopped_at"] = time.time()
            marks["restart_at"] = engines.restart(load.restart_engine)

        started = time.time()
        urls = [f"http://127.0.0.1:{p}" for p in ports.engines]
        sent = asyncio.run(truth_traffic(load, plans, ports.gateway_urls()[0], urls, restart, args.seed))
        ended = time.time()
        cleared_at = watch.stop() if watch is not None else None
        marks["end"] = engine_counters(ports.engines)
        through = sum(s.step.engine < 0 for s in sent)
        trace = logs / "trace.jsonl"
        wait_until(lambda: _lines(trace) >= through, timeout=30.0, what="the gateway's trace log")
        lines = [orjson.loads(line) for line in trace.read_bytes().splitlines() if line.strip()]
        gateway_metrics = metrics(ports.admin_urls()[0])
        log_text = (logs / "gateway.log").read_text(errors="replace")
        if args.logs is not None:  # the processes' logs, the trace log, the tokenizer: for diagnosis
            shutil.copytree(logs, args.logs / f"{mode.name}-{rep}", dirs_exist_ok=True)
    restart_at = marks["restart_at"]
    report = {
        "mode": mode.name,
        "repetition": rep,
        "built": True,
        "wall_s": round(ended - started, 1),
        **truth_figures(sent, k),
        "engines": engine_truth(marks, load.restart_engine),
        "restart": {
            "engine": backend,
            "down_s": round(restart_at - marks["stopped_at"], 2),
            "after_s": round((ended - restart_at) / k, 1),
            **stale_predictions(lines, backend, restart_at, k, cleared_at),
            "signals": restart_signals(log_text, backend, marks["stopped_at"], k),
            **(index_figures(watch, marks["stopped_at"], restart_at, k) if watch is not None else {}),
        },
        "prediction": prediction_figures(gateway_metrics),
        "load_average_start": load_start,
        "load_average_end": list(os.getloadavg()),
    }
    print(json.dumps({key: v for key, v in report.items() if key != "engines"}), flush=True)
    return report


def index_figures(watch: IndexWatch, stopped_at: float, restart_at: float, k: float) -> dict[str, Any]:
    """When the gateway dropped its index of the restarted engine (``IndexWatch``): simulated s after
    the fresh engine answered (negative: before) and after the old one was stopped; None: not by the
    end. ``index_readings``: each count seen from the stop, [simulated s after the restart, blocks]."""
    at = watch.cleared_at
    return {
        "index_blocks_at_stop": watch.blocks_at_start,
        "index_cleared_s": None if at is None else round((at - restart_at) / k, 3),
        "index_cleared_after_stop_s": None if at is None else round((at - stopped_at) / k, 3),
        "index_readings": [[round((t - restart_at) / k, 3), blocks] for t, blocks in watch.readings],
    }


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


def truth(args: argparse.Namespace, load: TruthLoad) -> dict[str, Any]:
    """Every mode, ``--repetitions`` times interleaved (each repetition runs the modes in turn,
    every one from cold engines), and the goals over the repetitions' totals."""
    modes = [m for m in TRUTH_MODES if not args.modes or m.name in args.modes.split(",")]
    load_start = list(os.getloadavg())
    print(f"load average at the start: {loads(load_start)}", flush=True)
    runs = [truth_run(mode, rep, load, args) for rep in range(1, args.repetitions + 1) for mode in modes]
    totals = {m.name: truth_totals([r for r in runs if r["mode"] == m.name]) for m in modes}
    return {
        "command": " ".join([args.command, *args.argv]),
        "load": {
            "config": args.config,
            **{f: getattr(load, f) for f in TruthLoad.__dataclass_fields__},
            "kv_cache_tokens": load.kv_cache_tokens,
            "time_scale": args.time_scale,
            "index_ttl_s": TRUTH_TTL_S,
            "profile": PROFILE,
            "model": MODEL,
            "engine_tokenizer": args.engine_tokenizer,
        },
        "modes": {
            m.name: {"what": m.what, "built": m.built, "restart_detection": m.restart_detection, "events": m.events}
            for m in modes
        },
        "runs": runs,
        "totals": totals,
        "goals": truth_goals(totals, TRUTH_TTL_S),
        "load_average_start": load_start,
        "load_average_end": list(os.getloadavg()),
    }


def parse(argv: list[str]) -> tuple[argparse.Namespace, TruthLoad]:
    """The options and the load: ``--config``'s, with each field given on its own in its place."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="default", help="a committed configuration")
    parser.add_argument("--repetitions", type=int, default=3, help="interleaved repetitions")
    parser.add_argument("--modes", default="", help="a subset of the modes, comma-separated")
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--engine-tokenizer",
        choices=("bench", "sim"),
        default="bench",
        help="bench: the bench's tokenizer.json, and KV events (every mode); sim: the simulator's own, no events",
    )
    parser.add_argument("--out", type=Path, default=None, help="default: loadtests/results/routing-truth[-CONFIG]")
    parser.add_argument("--logs", type=Path, default=None, help="keep each run's logs in LOGS/<mode>-<repetition>")
    fields = parser.add_argument_group("the load (default: the configuration's)")
    for field, spec in TruthLoad.__dataclass_fields__.items():
        kind = float if isinstance(spec.default, float) else int
        name = field.replace("_", "-")
        fields.add_argument(f"--{name}", dest=f"load_{field}", metavar=field.upper(), type=kind, default=None)
    args = parser.parse_args(argv)
    args.argv = list(argv)
    given = {f: getattr(args, f"load_{f}") for f in TruthLoad.__dataclass_fields__}
    load = dataclasses.replace(CONFIGS[args.config], **{f: v for f, v in given.items() if v is not None})
    args.out = args.out or results_dir(args.config)
    return args, load


def main(argv: list[str] | None = None, *, command: str = "python -m loadtests.proofs.routing_truth") -> int:
    """Run the bench; ``command`` is how the results name it (``routing_bench --truth`` passes its own)."""
    args, load = parse(sys.argv[1:] if argv is None else argv)
    args.command = command
    os.environ.setdefault(SECRET_ENV, BENCH_SECRET)
    report = truth(args, load)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    text = truth_summary(report)
    (args.out / "summary.txt").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
