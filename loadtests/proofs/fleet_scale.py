"""What a fleet of gateway processes costs its Redis: round trips per request by source, and sizing.

Usage::

    python -m loadtests.proofs.fleet_scale [--processes 10,50,100] [--rate 4] [--rate-high 40] [--workers 2]
                                    [--warmup-s 4] [--window-s 8] [--tenants 20] [--backends 4]
                                    [--calibrate-concurrency 64] [--lease-cell 4:200:4] [--shared-map]
                                    [--label before]
                                    [--out loadtests/results/fleet_scale]

Many simulated gateway processes against private ``redis-server`` s (started here on free ports,
no persistence), one per family of keys (``FAMILIES``: tenant limits, the ledger, the prefix
view, response affinity with rollouts), so that each family's CPU and memory are Redis's own
figures; together they are what one Redis would do. ``--workers`` OS processes each host their share of the simulated
processes as asyncio tasks, and every simulated process has its own Redis clients and
connection pools, as a real replica has, so Redis sees as many clients as real replicas would.
No HTTP and no engine: each simulated process drives the real state code of the gateway, as
``gateway/service.py`` wires it, and nothing else:

* tenant limits: the ``LimitStore`` of ``gateway/limitstore/factory.py`` behind the real
  ``TenantLimiter`` (``gateway/admission/tenant_limits.py``): ``admit`` at arrival, ``settle`` at the end
  (a usage that differs from the reservation, as real answers do), the store's background
  ``check``/``run``;
* capacity: the real ``FleetCoordinator`` and ``FleetLedger`` over ``--backends`` backends,
  its ``run`` loop at the policy's ``sync_interval_s``, with a ``Demand`` that has nothing
  waiting (a steady state: no wake-ups);
* the prefix view: the real ``PrefixSync`` (one decision of ``--blocks`` blocks per request,
  ``exchange`` every ``prefix_flush_s``);
* response affinity: for ``--responses-share`` of the requests, the real ``ResponseAffinity``
  issues the answer's id; ``--followup-share`` of them is a follow-up naming an id that one of
  the simulated processes of the same OS process created, as through a load balancer. By
  default ids are sealed (the replicas share the cache-salt secret, as ``deploy/`` sets it:
  ``gateway/responses/ids.py``), so neither costs a round trip; with ``--shared-map`` the id is
  written to Redis and looked up there when another process created it;
* canary rollouts (``--rollouts``, one by default): the ``RedisRolloutStore`` called as the
  controller's ``tick`` calls it, every ``interval_s`` (the controller itself is not run).

Requests arrive as a Poisson process at ``--rate`` per simulated process and hold their slot
``--hold-s``. Tenant limits are ``--limit-headroom`` times what each tenant uses across the
fleet, so nothing is refused (the point is the cost of enforcing, not refusing).

**Counted, not read off the code.** Every redis-py connection's ``send_packed_command`` (one
write of a command or of a whole pipeline, whose replies are then read: a round trip) and
``pack_command`` (one command) is counted under the source the running task belongs to (a
context variable set around each call and inherited by the background tasks the code
creates); a connection's handshake is counted apart. Each Redis reports the rest over a window
of ``--window-s`` after ``--warmup-s``: its main thread's CPU (``used_cpu_*_main_thread``, less
what it uses idle), commands (``total_commands_processed``, those run by scripts included), and
memory (``used_memory``; ``MEMORY USAGE`` of its keys at the end). A family's CPU is split over
its sources by their round trips.

**Extrapolated, and where linear stops.** This 2-core machine cannot generate 2,000 requests/s
for each of 100 processes, so the simulation runs at a lower rate per process and measures
per-request and per-process costs: round trips per process per second are fitted per source as
``fixed + per_request x rate`` from two rates at the smallest fleet; the Redis time of a ledger
sync as ``a + b x processes`` (its script reads every process's entry) and the prefix view's as
so much per round trip plus so much per decision delivered to a reader (each process reads
every other's), over the fleet sizes; the limits' and responses' per round trip from a closed
loop at the highest rate this machine makes (``calibrate``). Admission's round trips per request
come from the *lease cell* (``--lease-cell``, 4 processes at 200 req/s over 4 tenants): its cost
depends on each process's spending per tenant, which the fleet cells keep far below a replica's
(``lease_admission``). The sizing (``fleets`` in the JSON)
applies them to 10, 100 and 1,000 replicas at 2,000 requests/s each, and says when one Redis core (one primary)
stops sufficing and which keys could not be spread over cluster shards. Results:
``<out>/<label>.txt`` and ``.json``, with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import subprocess
import sys
import time
import uuid
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import redis
from redis.asyncio.connection import AbstractConnection

SOURCE: contextvars.ContextVar[str] = contextvars.ContextVar("fleet_scale_source", default="other")
HANDSHAKE: contextvars.ContextVar[bool] = contextvars.ContextVar("fleet_scale_handshake", default=False)

PER_REQUEST = ("admit", "settle", "resp_publish", "resp_lookup")
BACKGROUND = ("limits_bg", "ledger", "prefix", "rollout")
SOURCES = (*PER_REQUEST, *BACKGROUND, "other")
MODEL = "sim/model"
SAFE_CORE_SHARE = 0.7
"""The main-thread load a Redis primary should stay under (headroom for bursts, failover, BGSAVE)."""
TARGET_RATE = 2000.0
TARGET_FLEETS = (10, 100, 1000)


# -- counting round trips --------------------------------------------------------------------


@dataclass
class Tally:
    """What the connections of one OS process sent, by source (module docstring)."""

    round_trips: Counter[str] = field(default_factory=Counter)
    commands: Counter[str] = field(default_factory=Counter)
    handshakes: Counter[str] = field(default_factory=Counter)
    signatures: dict[str, Counter[str]] = field(default_factory=dict)
    """Command signature (``EVALSHA <name>``, ``XADD``, ...) -> source -> commands."""

    def snapshot(self) -> dict[str, Any]:
        return {
            "round_trips": dict(self.round_trips),
            "commands": dict(self.commands),
            "handshakes": dict(self.handshakes),
            "signatures": {sig: dict(by) for sig, by in self.signatures.items()},
        }


def script_texts() -> dict[str, str]:
    """Every Lua script the gateway sends, by a readable name (``module.CONSTANT``): the constants
    holding one (or a ``Script`` with its ``text``) in the modules that talk to Redis."""
    import gateway.fleet.ledger
    import gateway.limitstore.scripts
    import gateway.responses.sharing
    import gateway.rollout.store

    texts: dict[str, str] = {}
    modules: tuple[ModuleType, ...] = (
        gateway.limitstore.scripts,
        gateway.fleet.ledger,
        gateway.responses.sharing,
        gateway.rollout.store,
    )
    for module in modules:
        for attr, value in vars(module).items():
            text = getattr(value, "text", value)
            if isinstance(text, str) and "redis.call" in text and not attr.startswith("_"):
                texts[f"{module.__name__.rsplit('.', 1)[-1]}.{attr}"] = text
    return texts


def script_names() -> dict[str, str]:
    """SHA-1 of every Lua script the gateway sends -> its name (``script_texts``)."""
    return {hashlib.sha1(text.encode()).hexdigest(): name for name, text in script_texts().items()}


def signature(args: tuple[Any, ...], scripts: Mapping[str, str]) -> str:
    """A command's name, and the script's name for ``EVALSHA``/``EVAL``."""
    name = _text(args[0]).upper() if args else "?"
    if " " in name:
        name = name.split(" ", 1)[0]
    if name in ("EVALSHA", "EVALSHA_RO") and len(args) > 1:
        return f"EVALSHA {scripts.get(_text(args[1]), _text(args[1])[:12])}"
    if name == "EVAL" and len(args) > 1:
        sha = hashlib.sha1(_bytes(args[1])).hexdigest()
        return f"EVAL {scripts.get(sha, sha[:12])}"
    return name


def _text(value: Any) -> str:
    return bytes(value).decode(errors="replace") if isinstance(value, bytes | bytearray | memoryview) else str(value)


def _bytes(value: Any) -> bytes:
    return bytes(value) if isinstance(value, bytes | bytearray | memoryview) else str(value).encode()


def instrument(tally: Tally) -> Callable[[], None]:
    """Count every round trip and command of every redis-py asyncio connection in this process;
    the function returned puts redis-py back as it was."""
    scripts = script_names()
    send, pack, handshake = (
        AbstractConnection.send_packed_command,
        AbstractConnection.pack_command,
        AbstractConnection.on_connect_check_health,
    )

    async def counted_send(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        source = SOURCE.get()
        (tally.handshakes if HANDSHAKE.get() else tally.round_trips)[source] += 1
        await send(self, command, check_health)

    def counted_pack(self: AbstractConnection, *args: Any) -> list[bytes]:
        if not HANDSHAKE.get():
            source = SOURCE.get()
            tally.commands[source] += 1
            tally.signatures.setdefault(signature(args, scripts), Counter())[source] += 1
        return pack(self, *args)

    async def counted_handshake(self: AbstractConnection, check_health: bool = True) -> None:
        token = HANDSHAKE.set(True)
        try:
            await handshake(self, check_health)
        finally:
            HANDSHAKE.reset(token)

    AbstractConnection.send_packed_command = counted_send  # type: ignore[method-assign]
    AbstractConnection.pack_command = counted_pack  # type: ignore[method-assign]
    AbstractConnection.on_connect_check_health = counted_handshake  # type: ignore[method-assign]

    def restore() -> None:
        AbstractConnection.send_packed_command = send  # type: ignore[method-assign]
        AbstractConnection.pack_command = pack  # type: ignore[method-assign]
        AbstractConnection.on_connect_check_health = handshake  # type: ignore[method-assign]

    return restore


def spawn(coro: Coroutine[Any, Any, Any], source: str) -> asyncio.Task[Any]:
    """A task whose round trips (and those of the tasks it creates) count under ``source``."""
    context = contextvars.copy_context()
    context.run(SOURCE.set, source)
    return asyncio.get_running_loop().create_task(coro, context=context)


async def under(source: str, call: Awaitable[Any]) -> Any:
    token = SOURCE.set(source)
    try:
        return await call
    finally:
        SOURCE.reset(token)


# -- one simulated gateway process -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SimConfig:
    urls: dict[str, str]
    """The Redis of each family of keys (``FAMILIES``)."""
    key_prefix: str
    processes: int
    """Simulated processes in the whole fleet (for the tenants' limits)."""
    rate: float
    hold_s: float
    tenants: int
    backends: int
    blocks: int
    responses_share: float
    followup_share: float
    rollouts: int
    limit_headroom: float
    sealed_ids: bool = True
    """Response ids carry their holder (the replicas share the cache-salt secret, as ``deploy/``
    sets it: ``gateway/responses/ids.py``); False: the shared map in Redis (``--shared-map``)."""
    prompt_tokens: int = 1000
    max_tokens: int = 200
    rollout_interval_s: float = 5.0
    fleet_cells: int = 1
    """The fleet split into this many cells (``fleet.cell``), process ``i`` in cell ``i mod fleet_cells``:
    each cell a ledger and a prefix view of its own; the tenant limits stay fleet-wide."""


def fleet_cell_of(index: int, fleet_cells: int) -> str:
    """The ``fleet.cell`` of simulated process ``index`` ('': the one unnamed cell)."""
    return f"c{index % fleet_cells}" if fleet_cells > 1 else ""


def sim_policy(config: SimConfig, cell: str = "") -> str:
    """The policy a simulated process loads: backends, tenants with limits, Redis state, its cell."""
    import yaml

    from gateway.request.keys import hash_api_key

    per_tenant_rps = config.processes * config.rate / config.tenants
    tokens = config.prompt_tokens + config.max_tokens
    limits = {
        "rpm": max(10, math.ceil(per_tenant_rps * 60 * config.limit_headroom)),
        "tpm": max(100_000, math.ceil(per_tenant_rps * 60 * tokens * config.limit_headroom)),
        "max_concurrent": max(16, math.ceil(per_tenant_rps * config.hold_s * config.limit_headroom * 2)),
    }
    slo = {"ttft_ms": 1000, "itl_ms": 100, "e2e_ms": 60000}
    policy: dict[str, Any] = {
        "version": "fleet-scale",
        "classes": {"interactive": {"rank": 0, "slo": slo}, "batch": {"rank": 1, "slo": slo, "max_share": 0.5}},
        "models": [{"name": MODEL}],
        "backends": [
            {
                "name": f"b{i}",
                "url": "http://127.0.0.1:1",
                "kind": "vllm",
                "models": [MODEL],
                "capacity": {"max_concurrent": 64, "max_tokens_in_flight": 1_000_000},
            }
            for i in range(config.backends)
        ],
        "tenants": [
            {
                "name": f"t{i}",
                "key_hashes": [hash_api_key(f"fleet-scale-key-{i}")],
                "models": [MODEL],
                "default_class": "interactive" if i % 4 else "batch",
                "limits": limits,
            }
            for i in range(config.tenants)
        ],
        # Generous timeouts: this machine is shared and busy; a fallback would hide round trips.
        "state": {
            "backend": "redis",
            "redis_url": config.urls["limits"],
            "key_prefix": config.key_prefix,
            "timeout_ms": 2000,
            "request_budget_ms": 2000,
        },
        "fleet": {"timeout_ms": 2000, "cell": cell},
    }
    if config.rollouts:
        policy["models"] = [{"name": MODEL}, {"name": f"{MODEL}-b"}]
        policy["backends"][0]["models"] = [MODEL, f"{MODEL}-b"]
    return str(yaml.safe_dump(policy, sort_keys=False))


@dataclass
class Shared:
    """What the simulated processes of one OS process share: responses ids for follow-ups, counts."""

    ids: deque[tuple[int, str, str]] = field(default_factory=lambda: deque(maxlen=5000))
    """(creator, tenant, response id) of recent answers."""
    counts: Counter[str] = field(default_factory=Counter)


class SimProcess:
    """One simulated gateway process (module docstring): the real state code, its own clients."""

    def __init__(self, index: int, config: SimConfig, shared: Shared) -> None:
        from gateway.admission.tenant_limits import TenantLimiter
        from gateway.clock import MonotonicClock
        from gateway.dispatch.backends import BackendPool
        from gateway.fleet.coordinator import FleetCoordinator
        from gateway.fleet.ledger import FleetLedger
        from gateway.fleet.prefix_sync import PrefixSync, prefix_view_key
        from gateway.limitstore.factory import build_limit_store
        from gateway.responses.affinity import ResponseAffinity
        from gateway.responses.ids import ResponseIds
        from gateway.rollout.store import RedisRolloutStore
        from gateway.routing.prefix_secret import PrefixSecret
        from gateway.service import parse_policy
        from gateway.shared.connect import redis_client
        from gateway.telemetry.metrics import Metrics

        self.index = index
        self.config = config
        self.shared = shared
        self._clients: list[Any] = []
        self.snapshot = parse_policy(sim_policy(config, fleet_cell_of(index, config.fleet_cells)), "fleet-scale.yaml")
        policy = self.snapshot.policy
        self.clock = MonotonicClock()
        self.random = random.Random(index)
        self.tenants = list(policy.tenants)
        self.metrics = Metrics(redis=True)
        self.store = build_limit_store(
            policy.state,
            self.clock,
            on_error=lambda operation: shared.counts.update([f"store_error:{operation}"]),
            on_fallback=lambda operation: shared.counts.update([f"store_fallback:{operation}"]),
            processes=lambda: config.processes,
        )
        self.limiter = TenantLimiter(self.store, self.clock)
        self.pool = BackendPool(self.snapshot)
        self.states = list(self.pool.all())
        self.ledger = FleetLedger(
            self._client(redis_client, "ledger"),
            key_prefix=config.key_prefix,
            replica=f"sim-{os.getpid()}-{index}-{uuid.uuid4().hex[:6]}",
            lease_ttl_s=policy.fleet.entry_ttl_s,
            drain_s=policy.fleet_drain_s,
            cell=policy.fleet.cell,
        )
        self.coordinator = FleetCoordinator(
            self.ledger, self.pool, NoDemand(), lambda: self.snapshot, self.clock, self.metrics
        )
        self.coordinator.adopt(self.snapshot)
        self.view = PrefixSync(
            self._client(redis_client, "prefix"),
            key=prefix_view_key(policy, "sim"),
            origin=self.ledger.replica,
            routers=dict,
            secret=PrefixSecret(b"fleet-scale-secret"),
            pool=self.pool,
            policy=lambda: self.snapshot,
            clock=self.clock,
            metrics=self.metrics,
        )
        self.affinity = ResponseAffinity(
            self.clock,
            shared=self._client(redis_client, "responses"),
            key_prefix=config.key_prefix,
            timeout_s=2.0,
            ids=ResponseIds(b"fleet-scale-secret") if config.sealed_ids else None,
        )
        self.rollouts = RedisRolloutStore(self._client(redis_client, "responses"), config.key_prefix, 2.0)
        self._tasks: set[asyncio.Task[Any]] = set()

    def _client(self, factory: Callable[..., Any], family: str) -> Any:
        client = factory(self.config.urls[family], socket_connect_timeout=2.0, health_check_interval=0)
        self._clients.append(client)
        return client

    async def start(self) -> None:
        """As ``Gateway.start``: the store checked, the first sync, the catch-up, then the loops."""
        from gateway.limitstore.redis import RedisLimitStore

        if isinstance(self.store, RedisLimitStore):
            await under("limits_bg", self.store.check())
            self._keep(spawn(self.store.run(), "limits_bg"))
        await under("ledger", self.coordinator.sync_once())
        self._keep(spawn(self.coordinator.run(), "ledger"))
        await under("prefix", self.view.catch_up())
        self._keep(spawn(self.view.run(), "prefix"))
        if self.config.rollouts:
            self._keep(spawn(self._rollout_loop(), "rollout"))
        self._keep(spawn(self._arrivals(), "other"))

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _arrivals(self) -> None:
        while True:
            await asyncio.sleep(self.random.expovariate(self.config.rate))
            self._keep(spawn(self._request(), "other"))

    async def _request(self) -> None:
        from gateway.errors import Overloaded

        config, shared = self.config, self.shared
        tenant = self.tenants[self.random.randrange(len(self.tenants))]
        request = self.inference_request()
        try:
            admission = await under("admit", self.limiter.admit(tenant, request))
        except Overloaded:
            shared.counts["refused"] += 1
            return
        state = self.states[self.random.randrange(len(self.states))]
        self.view.routed(request, _decision(state))
        shared.counts["decisions"] += 1
        responses = self.random.random() < config.responses_share
        if responses and self.random.random() < config.followup_share and shared.ids:
            await self._follow_up()
        await asyncio.sleep(self.random.expovariate(1 / config.hold_s))
        if responses:
            response_id = f"resp_{uuid.uuid4().hex}"
            token = SOURCE.set("resp_publish")
            try:
                public_id = self.affinity.remember(response_id, tenant.name, state.name, MODEL)
                await self.affinity.shared_now()
            finally:
                SOURCE.reset(token)
            shared.ids.append((self.index, tenant.name, public_id))
            shared.counts["responses"] += 1
        used = config.prompt_tokens + self.random.randrange(config.max_tokens)
        await under("settle", self.limiter.settle(admission, used))
        shared.counts["requests"] += 1

    async def _follow_up(self) -> None:
        from gateway.errors import Overloaded

        creator, tenant, response_id = self.shared.ids[self.random.randrange(len(self.shared.ids))]
        self.shared.counts["followups"] += 1
        if creator != self.index:
            self.shared.counts["followups_elsewhere"] += 1
        try:
            held = await under(
                "resp_lookup", self.affinity.holder(response_id, tenant, self.snapshot.backends_by_model)
            )
        except Overloaded:
            self.shared.counts["followup_unavailable"] += 1
            return
        if held is None:
            self.shared.counts["followup_not_found"] += 1

    def inference_request(self) -> Any:
        from gateway.dialects.chat import CHAT
        from gateway.types import InferenceRequest, PrefixKeys

        blocks = tuple(self.random.getrandbits(63) for _ in range(self.config.blocks))
        return InferenceRequest(
            request_id=uuid.uuid4().hex,
            api=CHAT,
            model=MODEL,
            body={},
            raw_body=b"",
            stream=True,
            client_wants_usage=False,
            prompt_tokens=self.config.prompt_tokens,
            max_tokens=self.config.max_tokens,
            arrival=self.clock.now(),
            prefix_keys=PrefixKeys(1, 64, blocks),
        )

    async def _rollout_loop(self) -> None:
        """What ``Rollouts.tick`` sends for each rollout every ``interval_s``: add the interval's
        counts, load the state, try the judge's lease, and (its holder) read the step's totals."""
        from gateway.rollout.store import RolloutStoreUnavailable

        holder = self.ledger.replica
        interval = self.config.rollout_interval_s
        await asyncio.sleep(self.random.random() * interval)
        while True:
            for rollout in range(self.config.rollouts):
                key = f"group-{rollout}"
                try:
                    await self.rollouts.add_counts(key, 0, {"candidate:requests": 3, "baseline:requests": 7})
                    if await self.rollouts.load(key) is None:
                        await self.rollouts.save(key, {"step": 0})
                    if await self.rollouts.try_lead(key, holder, ttl_s=3 * interval):
                        await self.rollouts.counts(key, 0)
                except RolloutStoreUnavailable:
                    self.shared.counts["rollout_unavailable"] += 1
            await asyncio.sleep(interval)

    async def stop(self) -> None:
        """As ``Gateway.aclose``: the loops stopped (cancelled again if a Redis call swallowed the
        cancellation: ``stop_loops``), a graceful leave, then the stores and clients closed."""
        from gateway.shared.loops import stop_loops

        left = await stop_loops(self._tasks)
        if left:
            raise RuntimeError(f"loops of simulated process {self.index} ignored every cancellation: {left}")
        await under("ledger", self.coordinator.leave())  # as a gateway's graceful exit
        for closing in (self.store.aclose(), self.affinity.aclose(), self.rollouts.aclose()):
            with contextlib.suppress(Exception):  # best effort at the end of a bench
                await asyncio.wait_for(closing, 5)
        for client in self._clients:
            await client.aclose()


class NoDemand:
    """The dispatcher as the coordinator sees it, in a steady state: nothing waits."""

    def waiting(self) -> Mapping[str, Mapping[int, tuple[int, int]]]:
        return {}

    def tenants(self) -> Mapping[str, Any]:
        return {}

    def heard(self, backend: str, others: Mapping[int, Mapping[str, tuple[float, int]]]) -> None:
        return None

    def hand_out_all(self) -> None:
        return None


def _decision(state: Any) -> Any:
    from gateway.dispatch.router import RoutingDecision

    return RoutingDecision(state=state, strategy="prefix", reason="sim")


# -- a worker: many simulated processes in one OS process ------------------------------------


async def worker_main(config: SimConfig, first: int, count: int) -> dict[str, Any]:
    """Start ``count`` simulated processes, say ``ready``, then count from the start time read on
    stdin over the window given with it, and answer the counts (one JSON line)."""
    tally = Tally()
    instrument(tally)
    shared = Shared()
    sims = [SimProcess(first + i, config, shared) for i in range(count)]
    await asyncio.gather(*(sim.start() for sim in sims))
    print("ready", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    start_at, window_s, tail_s = (float(x) for x in line.split())
    await asyncio.sleep(max(0.0, start_at - time.time()))
    before, counts_before = tally.snapshot(), Counter(shared.counts)
    await asyncio.sleep(max(0.0, start_at + window_s - time.time()))
    after, counts_after = tally.snapshot(), Counter(shared.counts)
    await asyncio.sleep(max(0.0, start_at + window_s + tail_s - time.time()))
    result = {"window": _delta(before, after), "counts": dict(counts_after - counts_before), "sims": count}
    print(json.dumps(result), flush=True)  # before stopping: a stop that hangs must not lose the figures
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*(sim.stop() for sim in sims)), 20)
    return result


def _delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("round_trips", "commands", "handshakes"):
        out[name] = dict(Counter(after[name]) - Counter(before[name]))
    out["signatures"] = {
        sig: dict(Counter(by) - Counter(before["signatures"].get(sig, {}))) for sig, by in after["signatures"].items()
    }
    return out


# -- the bench: cells, Redis's figures ------------------------------------------------------

FAMILIES = ("limits", "ledger", "prefix", "responses")
"""One private Redis each: tenant limits (admit, settle, leases), the capacity ledger, the prefix
view's stream, and response affinity with the rollouts. Redis's CPU and memory are then each
family's own, exactly; their sums are one Redis's (a Redis serves one command at a time: the
work does not change with the neighbours, only the idle cost, subtracted here, is per server)."""
FAMILY_OF = {
    "admit": "limits",
    "settle": "limits",
    "limits_bg": "limits",
    "ledger": "ledger",
    "prefix": "prefix",
    "resp_publish": "responses",
    "resp_lookup": "responses",
    "rollout": "responses",
    "other": "responses",
}


@dataclass(frozen=True, slots=True)
class Cell:
    processes: int
    rate: float
    tenants: int | None = None
    """``--tenants`` unless set (the lease cell's fewer tenants each spend faster)."""
    role: str = "fleet"
    """``fleet``: a cell the model fits; ``lease``: the admission cost at a replica's spending (``--lease-cell``)."""
    fleet_cells: int = 1
    """The processes split into this many fleet cells (``fleet.cell``: ``--split-cell``)."""


class PrivateRedis:
    """A ``redis-server`` of the bench's own, on a free loopback port, without persistence."""

    def __init__(self) -> None:
        from loadtests.harness.processes import free_port

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.client = redis.Redis(port=self.port, socket_timeout=30)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def info(self) -> dict[str, Any]:
        return dict(self.client.info("all"))

    def close(self) -> None:
        self.client.close()
        self.process.kill()
        self.process.wait(10)


def cpu_of(info: Mapping[str, Any]) -> float:
    """CPU seconds of Redis's main thread (the one that runs commands), or of the process."""
    if "used_cpu_sys_main_thread" in info:
        return float(info["used_cpu_sys_main_thread"]) + float(info["used_cpu_user_main_thread"])
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def sim_config(servers: Mapping[str, PrivateRedis], cell: Cell, args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        urls={family: server.url for family, server in servers.items()},
        key_prefix="gw:",
        processes=cell.processes,
        rate=cell.rate,
        hold_s=args.hold_s,
        tenants=cell.tenants or args.tenants,
        backends=args.backends,
        blocks=args.blocks,
        responses_share=args.responses_share,
        followup_share=args.followup_share,
        rollouts=args.rollouts,
        limit_headroom=args.limit_headroom,
        sealed_ids=not args.shared_map,
        fleet_cells=cell.fleet_cells,
    )


def calibrate(servers: Mapping[str, PrivateRedis], args: argparse.Namespace) -> dict[str, float]:
    """Redis µs per round trip of the per-request families at the highest rate this machine makes:
    ``--calibrate-concurrency`` requests in a closed loop through one simulated process's
    ``TenantLimiter`` (admit, settle) and ``ResponseAffinity`` (publish, then a lookup from a
    second process). The cells run far below what one Redis serves a fleet at 2,000 req/s per
    replica, and a Redis woken for every round trip spends more per round trip than a busy one."""
    for server in servers.values():
        server.client.flushall()
    config = sim_config(servers, Cell(1, 100_000.0), args)  # limits far above the loop's rate
    tally = Tally()
    restore = instrument(tally)
    try:
        return asyncio.run(_calibrate(servers, config, args.calibrate_concurrency, args.window_s, tally))
    finally:
        restore()


async def _calibrate(
    servers: Mapping[str, PrivateRedis], config: SimConfig, concurrency: int, seconds: float, tally: Tally
) -> dict[str, float]:
    shared = Shared()
    one, two = SimProcess(0, config, shared), SimProcess(1, config, shared)
    done = Counter[str]()
    running = [True]  # a flag, not cancel(): a call cut by cancel() may be answered by a fallback

    async def limits(i: int) -> None:
        from gateway.errors import Overloaded

        request = one.inference_request()
        while running[0]:
            await asyncio.sleep(0)  # a store answering from its fallback never yields: let the others run
            try:
                admission = await under("admit", one.limiter.admit(one.tenants[i % len(one.tenants)], request))
            except Overloaded:
                done["refused"] += 1
                continue
            await under("settle", one.limiter.settle(admission, config.prompt_tokens))
            done["limits"] += 1

    async def responses(i: int) -> None:
        from gateway.errors import Overloaded

        tenant = one.tenants[i % len(one.tenants)].name
        while running[0]:
            await asyncio.sleep(0)
            response_id = f"resp_{uuid.uuid4().hex}"
            token = SOURCE.set("resp_publish")
            public_id = one.affinity.remember(response_id, tenant, "b0", MODEL)
            await one.affinity.shared_now()
            SOURCE.reset(token)
            try:
                await under("resp_lookup", two.affinity.holder(public_id, tenant, two.snapshot.backends_by_model))
            except Overloaded:
                done["lookup_unavailable"] += 1
            done["responses"] += 1

    out: dict[str, float] = {}
    for family, loop in (("limits", limits), ("responses", responses)):
        running[0] = True
        tasks = [asyncio.get_running_loop().create_task(loop(i)) for i in range(concurrency)]
        await asyncio.sleep(1.0)
        server = servers[family]
        sources = [s for s, f in FAMILY_OF.items() if f == family]
        before, rts, t0 = cpu_of(server.info()), sum(tally.round_trips[s] for s in sources), time.monotonic()
        await asyncio.sleep(seconds / 2)
        cores = (cpu_of(server.info()) - before) / (time.monotonic() - t0)
        calls = sum(tally.round_trips[s] for s in sources) - rts
        out[family] = cores / calls * (time.monotonic() - t0) * 1e6 if calls else 0.0
        out[f"{family}_round_trips_per_s"] = calls / (time.monotonic() - t0)
        running[0] = False
        await asyncio.wait(tasks, timeout=10)
    for sim in (one, two):
        await sim.stop()
    out["refused_or_unavailable"] = float(done["refused"] + done["lookup_unavailable"])
    out["fallbacks"] = float(sum(n for name, n in shared.counts.items() if name.startswith("store_")))
    return out


def run_cell(servers: Mapping[str, PrivateRedis], cell: Cell, args: argparse.Namespace) -> dict[str, Any]:
    """One fleet size at one rate: the workers, then Redis's figures over the window."""
    cell = dataclasses.replace(cell, tenants=cell.tenants or args.tenants)
    empty: dict[str, int] = {}
    for family, server in servers.items():
        server.client.flushall()
        server.client.script_flush()
        empty[family] = int(server.client.info("memory")["used_memory"])
    idle = idle_cpu(servers, 1.0)
    config = sim_config(servers, cell, args)
    workers = min(args.workers, cell.processes)
    shares = [cell.processes // workers + (1 if i < cell.processes % workers else 0) for i in range(workers)]
    procs = []
    first = 0
    for share in shares:
        command = [
            sys.executable,
            "-m",
            "loadtests.proofs.fleet_scale",
            "--worker",
            json.dumps([_asdict(config), first, share]),
        ]
        procs.append(subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        first += share
    try:
        for proc in procs:
            if _read_line(proc) != "ready":
                raise RuntimeError("a worker did not start")
        start_at = time.time() + args.warmup_s
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(f"{start_at} {args.window_s} 0.5\n")
            proc.stdin.flush()
        time.sleep(max(0.0, start_at - time.time()))
        first_info, t0 = {f: s.info() for f, s in servers.items()}, time.monotonic()
        time.sleep(max(0.0, start_at + args.window_s - time.time()))
        last_info, elapsed = {f: s.info() for f, s in servers.items()}, time.monotonic() - t0
        loadavg = Path("/proc/loadavg").read_text().split()[:3]
        memory = {family: key_memory(server.client) for family, server in servers.items()}
        outputs = [json.loads(_read_line(proc)) for proc in procs]
    finally:
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
    redis_side = {
        family: {
            "cpu_cores": max(0.0, (cpu_of(last_info[family]) - cpu_of(first_info[family])) / elapsed - idle[family]),
            "commands_per_s": (
                int(last_info[family]["total_commands_processed"]) - int(first_info[family]["total_commands_processed"])
            )
            / elapsed,
            "used_memory": int(last_info[family]["used_memory"]),
            "memory_over_empty": int(last_info[family]["used_memory"]) - empty[family],
            "connected_clients": int(last_info[family]["connected_clients"]),
            **memory[family],
        }
        for family in servers
    }
    return summarize(cell, outputs, redis_side, elapsed, idle, loadavg)


def idle_cpu(servers: Mapping[str, PrivateRedis], seconds: float) -> dict[str, float]:
    """Each server's CPU (cores) with no client: its timers, subtracted from the window's."""
    before, t0 = {f: cpu_of(s.info()) for f, s in servers.items()}, time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    return {f: (cpu_of(s.info()) - before[f]) / elapsed for f, s in servers.items()}


def key_memory(client: redis.Redis) -> dict[str, int]:
    """Keys, their bytes (``MEMORY USAGE ... SAMPLES 0``) and stream entries held."""
    keys = size = entries = responses = 0
    for raw in client.scan_iter(count=1000):
        keys += 1
        size += int(client.memory_usage(raw, samples=0) or 0)
        kind = client.type(raw)
        if kind == b"stream":
            entries += int(client.xlen(raw))
        elif kind == b"hash" and raw.endswith(b":responses"):
            responses += int(client.hlen(raw))
    return {"keys": keys, "key_bytes": size, "stream_entries": entries, "response_entries": responses}


def _read_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        raise RuntimeError("a worker ended without its figures")
    return line


def _asdict(config: SimConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in SimConfig.__dataclass_fields__}


def summarize(
    cell: Cell,
    outputs: list[dict[str, Any]],
    redis_side: Mapping[str, Mapping[str, Any]],
    window: float,
    idle: Mapping[str, float],
    loadavg: list[str],
) -> dict[str, Any]:
    """One cell's figures: by source (client side), by family (Redis side), per request."""
    rts: Counter[str] = Counter()
    cmds: Counter[str] = Counter()
    shakes: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    sigs: dict[str, Counter[str]] = {}
    for out in outputs:
        rts.update(out["window"]["round_trips"])
        cmds.update(out["window"]["commands"])
        shakes.update(out["window"]["handshakes"])
        counts.update(out["counts"])
        for sig, by in out["window"]["signatures"].items():
            sigs.setdefault(sig, Counter()).update(by)
    requests = counts["requests"]
    family_rts = Counter({family: 0 for family in FAMILIES})
    for source, n in rts.items():
        family_rts[FAMILY_OF.get(source, "responses")] += n
    sources = {}
    for source in SOURCES:
        if not rts.get(source) and not cmds.get(source):
            continue
        family = FAMILY_OF[source]
        share = rts.get(source, 0) / family_rts[family] if family_rts[family] else 0.0
        sources[source] = {
            "round_trips_per_s": rts.get(source, 0) / window,
            "round_trips_per_process_per_s": rts.get(source, 0) / window / cell.processes,
            "round_trips_per_request": rts.get(source, 0) / requests if requests else math.nan,
            "commands_per_s": cmds.get(source, 0) / window,
            "redis_cpu_cores": redis_side[family]["cpu_cores"] * share,
        }
    families = {}
    for family in FAMILIES:
        side = redis_side[family]
        calls = family_rts[family] / window
        families[family] = {
            **side,
            "round_trips_per_s": calls,
            "cpu_us_per_round_trip": side["cpu_cores"] / calls * 1e6 if calls else 0.0,
            "idle_cores_subtracted": idle[family],
        }
    total_cpu = sum(f["cpu_cores"] for f in families.values())
    total_rt = sum(rts.values())
    return {
        "processes": cell.processes,
        "fleet_cells": cell.fleet_cells,
        "processes_per_fleet_cell": cell.processes / cell.fleet_cells,
        "rate_per_process": cell.rate,
        "tenants": cell.tenants,
        "role": cell.role,
        "window_s": window,
        "requests_per_s": requests / window,
        "requests_per_process_per_s": requests / window / cell.processes,
        "decisions_per_s": counts["decisions"] / window,
        "round_trips_per_request": total_rt / requests if requests else math.nan,
        "round_trips_per_s": total_rt / window,
        "redis_cpu_cores": total_cpu,
        "redis_cpu_us_per_request": total_cpu / (requests / window) * 1e6 if requests else math.nan,
        "redis_commands_per_s": sum(f["commands_per_s"] for f in families.values()),
        "redis_memory_over_empty": sum(f["memory_over_empty"] for f in families.values()),
        "families": families,
        "sources": sources,
        "handshakes": dict(shakes),
        "signatures": {sig: dict(by) for sig, by in sigs.items()},
        "counts": dict(counts),
        "loadavg": loadavg,
    }


# -- the extrapolation -----------------------------------------------------------------------


def fit_line(points: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = a + b x``; one point (or one x) gives ``b = 0``."""
    pts = list(points)
    if not pts:
        return 0.0, 0.0
    mean_x = sum(x for x, _ in pts) / len(pts)
    mean_y = sum(y for _, y in pts) / len(pts)
    var = sum((x - mean_x) ** 2 for x, _ in pts)
    if var == 0:
        return mean_y, 0.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in pts) / var
    return mean_y - slope * mean_x, slope


def fit_two(rows: Iterable[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares ``y = a x1 + b x2`` (no intercept), each coefficient at least 0."""
    pts = list(rows)
    s11 = sum(x1 * x1 for x1, _, _ in pts)
    s22 = sum(x2 * x2 for _, x2, _ in pts)
    s12 = sum(x1 * x2 for x1, x2, _ in pts)
    s1y = sum(x1 * y for x1, _, y in pts)
    s2y = sum(x2 * y for _, x2, y in pts)
    det = s11 * s22 - s12 * s12
    if det <= 0:
        return (s1y / s11 if s11 else 0.0), 0.0
    a, b = (s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det
    if b < 0:
        return (s1y / s11 if s11 else 0.0), 0.0
    if a < 0:
        return 0.0, (s2y / s22 if s22 else 0.0)
    return a, b


READ_COUNT = 512
"""``prefix_sync.READ_COUNT``: a read that comes back full is followed by another."""


def lease_admission(
    lease_cells: list[dict[str, Any]], calls: Mapping[str, Mapping[str, float]]
) -> dict[str, Any] | None:
    """The admission's round trips per request at a replica's spending, from the lease cell.

    Why a cell of its own: an admission asks Redis only when its tenant's lease is dry, and a
    lease holds about a second of the process's own spending on that tenant (``limitstore/lease.py``).
    The fleet cells run at 4 and 40 requests/s per process over 20 tenants (0.2 to 2 per tenant),
    where a lease holds one request or none, so their per-request cost, scaled to 2,000 req/s,
    would charge a replica (100 per tenant) the dry leases of a nearly idle one. The lease cell
    runs fewer tenants faster (50 per tenant and process by default); per-request cost falls as
    that rate rises, so its figure bounds the cost at 100 from above. The process's fixed part
    (its keeper's pings) stays the fleet cells' fit."""
    if not lease_cells:
        return None
    cell = max(lease_cells, key=lambda c: c["requests_per_process_per_s"] / c["tenants"])
    requests = cell["requests_per_process_per_s"]
    measured = cell["sources"].get("admit", {}).get("round_trips_per_process_per_s", 0.0)
    fixed = calls.get("admit", {}).get("fixed_per_process_per_s", 0.0)
    return {
        "fixed_per_process_per_s": fixed,
        "per_request": max(0.0, measured - fixed) / requests if requests else 0.0,
        "from_lease_cell": {
            "processes": cell["processes"],
            "tenants": cell["tenants"],
            "requests_per_tenant_per_process_per_s": requests / cell["tenants"],
            "round_trips_per_request": cell["sources"].get("admit", {}).get("round_trips_per_request", math.nan),
        },
    }


def model_of(cells: list[dict[str, Any]], blocks: int, calibrated: Mapping[str, float]) -> dict[str, Any]:
    """The costs the cells measured, as functions of the fleet's size and rate (module docstring)."""
    lease_cells = [c for c in cells if c.get("role") == "lease"]
    cells = [c for c in cells if c.get("role", "fleet") == "fleet"]
    whole = [c for c in cells if c.get("fleet_cells", 1) == 1]
    smallest = min(c["processes"] for c in whole)
    at_smallest = [c for c in whole if c["processes"] == smallest]
    calls: dict[str, dict[str, float]] = {}
    for source in SOURCES:
        fixed, per_request = fit_line(
            (c["requests_per_process_per_s"], c["sources"].get(source, {}).get("round_trips_per_process_per_s", 0.0))
            for c in at_smallest
        )
        if fixed > 0 or per_request > 0:
            calls[source] = {"fixed_per_process_per_s": max(0.0, fixed), "per_request": max(0.0, per_request)}
    admission = lease_admission(lease_cells, calls)
    if admission is not None:
        calls["admit"] = admission

    def weighted_us(family: str) -> float:
        cores = sum(c["families"][family]["cpu_cores"] for c in cells)
        rts = sum(c["families"][family]["round_trips_per_s"] for c in cells)
        return cores / rts * 1e6 if rts else 0.0

    def commands_per_rt(family: str) -> float:
        ops = sum(c["families"][family]["commands_per_s"] for c in cells)
        rts = sum(c["families"][family]["round_trips_per_s"] for c in cells)
        return ops / rts if rts else 0.0

    # A sync reads the entries of its own cell's processes; a decision reaches its own cell's readers.
    ledger_a, ledger_b = fit_line(
        (_per_cell(c), c["families"]["ledger"]["cpu_us_per_round_trip"]) for c in cells if c.get("fleet_cells", 1) == 1
    )
    per_rt, per_delivered = fit_two(
        (
            c["families"]["prefix"]["round_trips_per_s"],
            c["decisions_per_s"] * (_per_cell(c) - 1),
            c["families"]["prefix"]["cpu_cores"] * 1e6,
        )
        for c in whole
    )
    ledger_mem = fit_line((c["processes"], c["families"]["ledger"]["key_bytes"]) for c in whole)
    entry_bytes = []
    for c in cells:
        prefix = c["families"]["prefix"]
        xadds = c["signatures"].get("XADD", {}).get("prefix", 0) / c["window_s"]
        if prefix["stream_entries"] and xadds:
            per_entry_decisions = c["decisions_per_s"] / xadds
            entry_bytes.append(prefix["key_bytes"] / prefix["stream_entries"] - per_entry_decisions * blocks * 8)
    responses = [c["families"]["responses"] for c in cells if c["families"]["responses"]["response_entries"]]
    return {
        "round_trips": calls,
        "us_per_round_trip": {
            family: min(weighted_us(family), calibrated.get(family) or math.inf) for family in ("limits", "responses")
        },
        "us_per_round_trip_in_cells": {family: weighted_us(family) for family in ("limits", "responses")},
        "calibration": dict(calibrated),
        "ledger_us_per_sync": [ledger_a, ledger_b],
        "prefix_us": {"per_round_trip": per_rt, "per_decision_delivered": per_delivered},
        "commands_per_round_trip": {family: commands_per_rt(family) for family in FAMILIES},
        "memory": {
            "limits_bytes": max(c["families"]["limits"]["key_bytes"] for c in cells),
            "ledger_bytes_per_process": max(0.0, ledger_mem[1]),
            "prefix_entry_overhead_bytes": sum(entry_bytes) / len(entry_bytes) if entry_bytes else 0.0,
            "prefix_bytes_per_decision": blocks * 8 + 24,
            "response_entry_bytes": (
                sum(r["key_bytes"] for r in responses) / sum(r["response_entries"] for r in responses)
                if responses
                else 0.0
            ),
        },
    }


def _per_cell(cell: Mapping[str, Any]) -> float:
    """The processes of one fleet cell in a measured cell (all of them when the fleet is one cell)."""
    return float(cell.get("processes_per_fleet_cell", cell["processes"]))


def fleet_at(
    model: Mapping[str, Any], replicas: int, rate: float, args: argparse.Namespace, cell_size: int | None = None
) -> dict[str, Any]:
    """The Redis a fleet of ``replicas`` at ``rate`` requests/s each needs, by the model, as one
    fleet cell or split into cells of ``cell_size`` replicas (each its own ledger and prefix view)."""
    size = min(cell_size or replicas, replicas)
    fleet_cells = math.ceil(replicas / size)
    rts: dict[str, float] = {}
    for source, c in model["round_trips"].items():
        rts[source] = replicas * (c["fixed_per_process_per_s"] + c["per_request"] * rate)
    if "prefix" in rts:  # an exchange reads the others' entries of its cell READ_COUNT at a time
        rts["prefix"] *= max(1, math.ceil((size - 1) / READ_COUNT))
    family_rts: dict[str, float] = dict.fromkeys(FAMILIES, 0.0)
    for source, n in rts.items():
        family_rts[FAMILY_OF[source]] += n
    us = model["us_per_round_trip"]
    ledger_a, ledger_b = model["ledger_us_per_sync"]
    prefix = model["prefix_us"]
    delivered = replicas * rate * (size - 1)
    cores = {
        "limits": family_rts["limits"] * us["limits"] / 1e6,
        "responses": family_rts["responses"] * us["responses"] / 1e6,
        "ledger": family_rts["ledger"] * max(0.0, ledger_a + ledger_b * size) / 1e6,
        "prefix": (family_rts["prefix"] * prefix["per_round_trip"] + delivered * prefix["per_decision_delivered"])
        / 1e6,
    }
    ops = sum(family_rts[f] * model["commands_per_round_trip"][f] for f in FAMILIES)
    mem = model["memory"]
    entry = mem["prefix_entry_overhead_bytes"] + mem["prefix_bytes_per_decision"] * rate * 0.05
    responses_held = args.tenants * min(10_000, rate * replicas * args.responses_share / args.tenants * 3600)
    memory = {
        "limits": mem["limits_bytes"],
        "ledger": mem["ledger_bytes_per_process"] * replicas,
        "prefix": entry * 10_000 * fleet_cells,
        "responses": mem["response_entry_bytes"] * responses_held,
    }
    # One slot holds one cell's ledger (its hash tag), another its prefix view (one key): the
    # hottest single slot is the larger of the two of one cell.
    one_slot = max(cores["ledger"], cores["prefix"]) / fleet_cells
    total = sum(cores.values())
    if total <= SAFE_CORE_SHARE:
        verdict = "one primary"
    elif one_slot <= SAFE_CORE_SHARE:
        verdict = f"cluster of about {math.ceil(total / SAFE_CORE_SHARE)} shards (tenants and cells spread by hash tag)"
    else:
        hot = "ledger" if cores["ledger"] >= cores["prefix"] else "prefix view"
        verdict = f"no: one cell's {hot} needs {one_slot:.1f} cores on one slot (one shard)"
    return {
        "replicas": replicas,
        "cell_size": size,
        "fleet_cells": fleet_cells,
        "hottest_slot_cores": one_slot,
        "rate_per_replica": rate,
        "requests_per_s": replicas * rate,
        "round_trips_per_s": sum(rts.values()),
        "round_trips_per_request": sum(rts.values()) / (replicas * rate),
        "round_trips_per_request_by_source": {s: n / (replicas * rate) for s, n in rts.items()},
        "commands_per_s": ops,
        "redis_cpu_cores": total,
        "cores_by_family": cores,
        "memory_bytes": sum(memory.values()),
        "memory_by_family": memory,
        "verdict": verdict,
    }


# -- the report ------------------------------------------------------------------------------


def _procs(cell: Mapping[str, Any]) -> str:
    if cell.get("role") == "lease":
        return f"{cell['processes']}L"
    split = cell.get("fleet_cells", 1)
    return f"{cell['processes']}/{split}c" if split > 1 else str(cell["processes"])


def split_check(cells: list[dict[str, Any]], model: Mapping[str, Any]) -> list[str]:
    """What splitting into fleet cells did, measured: Redis's time per ledger sync and per prefix
    view exchange in each split cell, against the same processes as one cell and the model's. Per
    call, not per request: a busy machine runs a large cell's loops below their nominal rate (the
    column syncs/p/s), which lowers its cost per request without making a call cheaper."""
    lines = []
    la, lb = model["ledger_us_per_sync"]
    for split in (c for c in cells if c.get("fleet_cells", 1) > 1):
        size = _per_cell(split)
        ledger, prefix = split["families"]["ledger"], split["families"]["prefix"]
        line = (
            f"  {split['processes']} processes in {split['fleet_cells']} cells of {size:g}: ledger "
            f"{ledger['cpu_us_per_round_trip']:.0f} µs per sync (model for {size:g}: {la + lb * size:.0f}), "
            f"prefix view {prefix['cpu_us_per_round_trip']:.0f} µs per exchange"
        )
        whole = [c for c in cells if c.get("fleet_cells", 1) == 1 and c["processes"] == split["processes"]]
        if whole:
            one = whole[0]["families"]
            line += (
                f"; as one cell of {split['processes']}: ledger {one['ledger']['cpu_us_per_round_trip']:.0f} µs "
                f"(x{ledger['cpu_us_per_round_trip'] / max(one['ledger']['cpu_us_per_round_trip'], 1e-9):.2f}), "
                f"prefix view {one['prefix']['cpu_us_per_round_trip']:.0f} µs"
            )
        lines.append(line)
    return lines


def report(
    label: str,
    cells: list[dict[str, Any]],
    model: Mapping[str, Any],
    fleets: list[dict[str, Any]],
    args: argparse.Namespace,
) -> str:
    lines = [
        f"fleet_scale ({label}): simulated gateway processes against private redis-servers (one per key family)",
        f"command: python -m loadtests.proofs.fleet_scale {' '.join(sys.argv[1:])}",
        f"per process: Poisson arrivals at the rate shown, hold {args.hold_s}s, {args.tenants} tenants, "
        f"{args.backends} backends, {args.blocks} prefix blocks/request, Responses {args.responses_share:.0%} "
        f"(follow-ups {args.followup_share:.0%} of them, ids {'in the shared map' if args.shared_map else 'sealed'}), "
        f"{args.rollouts} rollout(s); {args.workers} OS workers; "
        f"window {args.window_s}s after {args.warmup_s}s",
        "",
        "per cell (round trips counted on every connection; CPU, commands, memory by Redis):",
        f"{'procs':>5} {'rate':>5} {'req/s':>7} {'RT/req':>7} {'RT/s':>7} {'cmds/s':>8} {'cores':>6} "
        f"{'us/req':>7} {'mem KB':>7} {'clients':>7} {'syncs/p/s':>9} {'fallbk':>6}  load",
    ]
    for c in cells:
        clients = sum(f["connected_clients"] for f in c["families"].values())
        syncs = c["sources"].get("ledger", {}).get("round_trips_per_process_per_s", 0.0)
        fallbacks = sum(n for name, n in c["counts"].items() if name.startswith("store_fallback"))
        lines.append(
            f"{_procs(c):>5} {c['rate_per_process']:>5g} {c['requests_per_s']:>7.0f} "
            f"{c['round_trips_per_request']:>7.2f} {c['round_trips_per_s']:>7.0f} {c['redis_commands_per_s']:>8.0f} "
            f"{c['redis_cpu_cores']:>6.3f} {c['redis_cpu_us_per_request']:>7.1f} "
            f"{c['redis_memory_over_empty'] / 1e3:>7.0f} {clients:>7} {syncs:>9.1f} {fallbacks:>6}  "
            f"{' '.join(c['loadavg'])}"
        )
    lines += ["", "round trips per request by source:"]
    lines.append(f"{'procs':>5} {'rate':>5} " + " ".join(f"{s:>12}" for s in SOURCES[:-1]))
    for c in cells:
        row = " ".join(f"{c['sources'].get(s, {}).get('round_trips_per_request', 0.0):>12.3f}" for s in SOURCES[:-1])
        lines.append(f"{_procs(c):>5} {c['rate_per_process']:>5g} {row}")
    lines += ["", "Redis CPU by family (cores, idle subtracted) and µs per round trip:"]
    for c in cells:
        row = "  ".join(
            f"{f} {c['families'][f]['cpu_cores']:.4f} ({c['families'][f]['cpu_us_per_round_trip']:.0f} µs)"
            for f in FAMILIES
        )
        lines.append(f"{_procs(c):>5} {c['rate_per_process']:>5g}  {row}")
    lease = [c for c in cells if c.get("role") == "lease"]
    if lease:
        lines.append(
            f"  L: the lease cell, {lease[0]['tenants']} tenants (admission at "
            f"{lease[0]['requests_per_process_per_s'] / lease[0]['tenants']:.0f} req/s per tenant and process; "
            f"a replica at 2,000 req/s over {args.tenants} tenants spends {TARGET_RATE / args.tenants:.0f})"
        )
    lines += ["", "model (fitted from the fleet cells; admission's per-request cost from the lease cell):"]
    for source, m in model["round_trips"].items():
        lines.append(
            f"  {source:>12}: {m['fixed_per_process_per_s']:6.2f} round trips/process/s "
            f"+ {m['per_request']:.3f} per request" + (" (lease cell)" if "from_lease_cell" in m else "")
        )
    us = model["us_per_round_trip"]
    la, lb = model["ledger_us_per_sync"]
    cal = model["calibration"]
    if cal:
        lines.append(
            f"  calibration (closed loop, {args.calibrate_concurrency} at once): limits {cal['limits']:.1f} µs/RT at "
            f"{cal['limits_round_trips_per_s']:.0f} RT/s, responses {cal['responses']:.1f} µs/RT at "
            f"{cal['responses_round_trips_per_s']:.0f} RT/s (cells: limits "
            f"{model['us_per_round_trip_in_cells']['limits']:.1f}, responses "
            f"{model['us_per_round_trip_in_cells']['responses']:.1f}); the lower is used"
        )
    lines.append(
        f"  Redis µs: limits {us['limits']:.1f}/RT, responses {us['responses']:.1f}/RT, ledger {la:.0f} + "
        f"{lb:.2f} x processes per sync, prefix view {model['prefix_us']['per_round_trip']:.1f}/RT + "
        f"{model['prefix_us']['per_decision_delivered']:.3f} per decision delivered to a reader"
    )
    mem = model["memory"]
    lines.append(
        f"  memory: limits {mem['limits_bytes'] / 1e3:.0f} KB ({args.tenants} tenants), ledger "
        f"{mem['ledger_bytes_per_process']:.0f} B/process, stream entry {mem['prefix_entry_overhead_bytes']:.0f} B + "
        f"{mem['prefix_bytes_per_decision']} B/decision (10,000 entries kept), response entry "
        f"{mem['response_entry_bytes']:.0f} B (10,000 per tenant at most)"
    )
    checks = split_check(cells, model)
    if checks:
        lines += ["", "fleet cells (fleet.cell), measured:", *checks]
    lines += [
        "",
        f"extrapolated to {TARGET_RATE:g} req/s per replica (one Redis core = 1.0; safe at {SAFE_CORE_SHARE}):",
    ]
    lines.append(
        f"{'replicas':>8} {'cells':>9} {'req/s':>9} {'RT/req':>7} {'RT/s':>10} {'cmds/s':>10} {'cores':>8} "
        f"{'limits':>7} {'ledger':>8} {'prefix':>8} {'resp':>6} {'slot':>6} {'mem MB':>8}  verdict"
    )
    for f in fleets:
        c = f["cores_by_family"]
        cells_text = f"{f['fleet_cells']}x{f['cell_size']}" if f["fleet_cells"] > 1 else "1"
        lines.append(
            f"{f['replicas']:>8} {cells_text:>9} {f['requests_per_s']:>9.0f} {f['round_trips_per_request']:>7.3f} "
            f"{f['round_trips_per_s']:>10.0f} {f['commands_per_s']:>10.0f} {f['redis_cpu_cores']:>8.2f} "
            f"{c['limits']:>7.2f} {c['ledger']:>8.2f} {c['prefix']:>8.2f} {c['responses']:>6.2f} "
            f"{f['hottest_slot_cores']:>6.2f} {f['memory_bytes'] / 1e6:>8.0f}  {f['verdict']}"
        )
    lines += [
        "",
        "Round trips per request at 2,000 req/s by source: "
        + ", ".join(f"{s} {v:.3f}" for s, v in fleets[0]["round_trips_per_request_by_source"].items()),
        "This 2-core machine runs Redis and every simulated process: the simulation runs below 2,000 req/s per",
        "process and the per-request and per-process costs it measured are scaled (linear in the fleet for",
        "the tenant limits and responses, per-call costs growing with the fleet for the ledger and the view).",
        "Handshakes (new connections) are outside the window.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.proofs.fleet_scale", description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--processes", default="10,50,100")
    parser.add_argument("--rate", type=float, default=4.0, help="requests/s per simulated process")
    parser.add_argument("--rate-high", type=float, default=40.0, help="a second rate at the smallest fleet (0: none)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--warmup-s", type=float, default=4.0)
    parser.add_argument("--window-s", type=float, default=8.0)
    parser.add_argument("--hold-s", type=float, default=0.5)
    parser.add_argument("--tenants", type=int, default=20)
    parser.add_argument("--backends", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--responses-share", type=float, default=0.2)
    parser.add_argument("--followup-share", type=float, default=0.5)
    parser.add_argument("--rollouts", type=int, default=1)
    parser.add_argument(
        "--shared-map",
        action="store_true",
        help="response ids found through the map in Redis (no shared secret), not sealed ids",
    )
    parser.add_argument("--limit-headroom", type=float, default=2.0)
    parser.add_argument(
        "--lease-cell",
        default="4:200:4",
        help="PROCESSES:RATE:TENANTS of the cell that measures admission at a replica's per-tenant spending "
        "('' for none; see model_of)",
    )
    parser.add_argument(
        "--split-cell",
        default="100:10",
        help="PROCESSES:CELLS of a cell whose processes are split into fleet cells (fleet.cell), at --rate ('' none)",
    )
    parser.add_argument("--cell-size", type=int, default=10, help="replicas per fleet cell in the split sizing")
    parser.add_argument("--calibrate-concurrency", type=int, default=64, help="0: no calibration")
    parser.add_argument("--label", default="latest")
    parser.add_argument("--out", default="loadtests/results/fleet_scale")
    args = parser.parse_args(argv)
    if args.worker:
        logging.basicConfig(level=logging.ERROR)
        raw, first, count = json.loads(args.worker)
        asyncio.run(worker_main(SimConfig(**raw), first, count))
        return
    sizes = [int(n) for n in args.processes.split(",")]
    cells = [Cell(n, args.rate) for n in sizes]
    if args.rate_high:
        cells.insert(1, Cell(min(sizes), args.rate_high))
    if args.split_cell:
        processes, split = args.split_cell.split(":")
        cells.append(Cell(int(processes), args.rate, fleet_cells=int(split)))
    if args.lease_cell:
        processes, rate, tenants = args.lease_cell.split(":")
        cells.append(Cell(int(processes), float(rate), int(tenants), role="lease"))
    servers = {family: PrivateRedis() for family in FAMILIES}
    results = []
    try:
        for cell in cells:
            print(
                f"cell: {cell.processes} processes in {cell.fleet_cells} fleet cell(s) at {cell.rate:g} req/s each",
                file=sys.stderr,
                flush=True,
            )
            results.append(run_cell(servers, cell, args))
        calibration = calibrate(servers, args) if args.calibrate_concurrency else {}
    finally:
        for server in servers.values():
            server.close()
    model = model_of(results, args.blocks, calibration)
    fleets = [fleet_at(model, replicas, TARGET_RATE, args) for replicas in TARGET_FLEETS]
    split = [replicas for replicas in TARGET_FLEETS if replicas > args.cell_size]
    fleets += [fleet_at(model, replicas, TARGET_RATE, args, args.cell_size) for replicas in split]
    text = report(args.label, results, model, fleets, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.label}.txt").write_text(text)
    document = {"argv": sys.argv[1:], "cells": results, "model": model, "fleets": fleets}
    (out / f"{args.label}.json").write_text(json.dumps(document, indent=1))
    print(text)


if __name__ == "__main__":
    main()
