"""What the routing benches share: the oracle router, the gateway's policy, one chat turn, the engines' counters.

Usage (the oracle's gateway process, which the benches start themselves)::

    python -m loadtests.proofs.routing_system POLICY --port 8080 --admin-port 8081

Two benches measure routing on simulated engines: ``routing_bench`` (strategies under an open
load, fleets of replicas, slot-scoped engines) and ``routing_truth`` (how well the gateway knows
what the engines hold, issue 30). Both route with the same policy, compare against the same
oracle and read the same counters, so these live here, imported by both: neither bench imports
the other's internals (``routing_bench --truth`` only calls ``routing_truth.main``).

The oracle is a router written here that knows every engine's cache: for each candidate it asks
the engine (``POST /debug/prefix_cache``, the simulator's debug endpoint) how many prompt tokens
its prefix cache holds for this very request under the salt the gateway will set, then weighs
that exactly as ``prefix_affinity`` weighs its estimate (same load scorers, weights and
bounded-load rule). It is the ceiling of what a better index could reach; the calls block the
gateway's loop for about a millisecond per candidate, which only the oracle pays. The gateway
runs it through this module's ``__main__``, which registers the strategy and then runs
``inference-gateway serve`` (``serve_argv``).
"""

from __future__ import annotations

import argparse
import http.client
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import httpx
import orjson

from gateway.dispatch.cache_report import CacheReport
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
from loadtests.harness.processes import GATEWAY, free_port, metric_sum, metrics
from loadtests.sim.profiles import BLOCK_SIZE

if TYPE_CHECKING:
    from gateway.dispatch.backends import BackendState

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROFILE = "llama-3.1-8b-h100"
SECRET_ENV = "GATEWAY_CACHE_SALT_SECRET"
BENCH_SECRET = "routing-bench-secret"
PREFIX_WEIGHT, LOAD_WEIGHTS = 3.0, (1.0, 1.0, 0.5)  # the prefix_affinity defaults (registry.DEFAULT_WEIGHTS)
TENANTS = 8
"""The policy's tenants by default: ``t1``..``t8``, keys ``routing-key-t<i>`` (``tenant_key``)."""
ADMIN_KEY = "routing-bench-admin"
"""The operator's key for ``/admin/*`` (``/admin/backends``: each backend's KV-event index)."""
WATCH = "health_checks: {interval_s: 2, timeout_s: 2}\nscrape: {interval_s: 0.5, timeout_s: 1}"
"""How the gateway watches its engines: health checks, and scrapes of /metrics (load signals and
restart detection, ``gateway/dispatch/scrape.py``)."""


def tenant_key(tenant: int) -> str:
    return f"routing-key-t{tenant}"


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


def serve_oracle_gateway(policy: str, port: int, admin_port: int, log_level: str = "warning") -> int:
    """``inference-gateway serve`` with the oracle strategy registered (the bench's gateway process)."""
    from gateway.cli import main as gateway_main

    salter = CacheSalter.from_env(SECRET_ENV)
    register_strategy("oracle", lambda spec: OracleRouter(spec, salter))
    argv = ["serve", "--policy", policy, "--port", str(port), "--admin-port", str(admin_port)]
    return gateway_main([*argv, "--log-level", log_level])


def serve_argv(strategy: str, policy: str, port: int, admin_port: int, log_level: str = "warning") -> list[str]:
    """The command line of a gateway routing with ``strategy`` (the oracle's runs this module);
    ``log_level`` the gateway's (``info`` shows the KV-event feeds' transitions)."""
    if strategy == "oracle":
        serve = [sys.executable, "-m", "loadtests.proofs.routing_system", policy]
    else:
        serve = [*GATEWAY, "serve", "--policy", policy]
    return [*serve, "--port", str(port), "--admin-port", str(admin_port), "--log-level", log_level]


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


def gateway_policy(
    k: float,
    strategy: str,
    engine_ports: Sequence[int],
    capacity: str,
    shared: str = "",
    *,
    index: str = "",
    watch: str = WATCH,
    backend_fields: Sequence[str] = (),
    model_fields: str = "",
    tenants: int = TENANTS,
) -> str:
    """The benches' policy; ``index`` is the routing index section (default: a TTL of 600 simulated s).

    ``backend_fields``: more fields of each backend's flow mapping, one string per backend in the
    order of ``engine_ports`` (``kv_events: {...}``); ``model_fields``: more fields of the model,
    one line (``tokenizer: {...}``); ``shared``: sections appended at the end (``state``, ``fleet``);
    ``tenants``: how many (``t1``.., keys ``tenant_key``). The operator's key (``ADMIN_KEY``) opens
    ``/admin/*`` on the operator listener."""
    extras = list(backend_fields) or [""] * len(engine_ports)
    backends = "\n".join(
        f"""  - {{name: engine-{i}, url: "http://127.0.0.1:{port}", kind: sim, models: [{MODEL}],
      engine_priority: true, timeouts: {{first_byte_s: {600 * k}, between_chunks_s: {600 * k}}},
      capacity: {capacity}{", " + extra if extra else ""}}}"""
        for i, (port, extra) in enumerate(zip(engine_ports, extras, strict=True))
    )
    tenant_list = "\n".join(
        f"""  - {{name: t{i}, key_hashes: ["{hash_api_key(tenant_key(i))}"], models: ["*"],
      default_class: interactive}}"""
        for i in range(1, tenants + 1)
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
{f"    {model_fields}" if model_fields else ""}
backends:
{backends}
tenants:
{tenant_list}
admin: {{key_hashes: ["{hash_api_key(ADMIN_KEY)}"]}}
breaker: {{consecutive_failures: null, failure_ratio: null}}
{watch}
{shared}"""


def engine_counters(ports: Sequence[int]) -> list[dict[str, float]]:
    """Each engine's prefix-cache queries and hits (tokens), finished requests and (late) steps."""
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


# -- one chat turn -----------------------------------------------------------------------------


@dataclass(slots=True)
class Reply:
    status: int
    ttft_s: float | None = None
    text: str = ""
    engine: str = ""
    """The engine that answered (the simulator's id prefix, random per engine), for diagnosis."""
    cached: int = 0
    """Prompt tokens the engine found cached (``usage.prompt_tokens_details.cached_tokens``)."""
    prompt: int = 0
    """The prompt's tokens as the engine counted them (``usage.prompt_tokens``)."""


async def chat(
    client: httpx.AsyncClient,
    url: str,
    key: str,
    messages: list[dict[str, str]],
    *,
    max_tokens: int,
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


def loads(values: list[float] | None) -> str:
    """Load averages as a report prints them."""
    return " ".join(f"{v:.2f}" for v in values) if values else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="inference-gateway serve with the oracle strategy registered")
    parser.add_argument("policy")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--admin-port", type=int, required=True)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    return serve_oracle_gateway(args.policy, args.port, args.admin_port, args.log_level)


if __name__ == "__main__":
    sys.exit(main())
