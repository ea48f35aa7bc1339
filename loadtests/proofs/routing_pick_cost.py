"""Routing cost per pick: ``prefix_affinity`` against ``round_robin`` in the same run.

Usage::

    python -m loadtests.proofs.routing_pick_cost [--chats 16] [--turns 10] [--repeat 5]

Picks among four backends for the turns of long chats shaped like the routing benchmark's
(a 2k-token system prompt, user turns of ~384 tokens, replies of ~192): turn t of every chat,
then turn t + 1, each request new (its prefix keys computed), each pick followed by
``on_dispatch`` as in the gateway. Prints microseconds per pick (best of ``--repeat`` runs;
the pick only, not the index insert) for each strategy, and for ``prefix_affinity`` without its
``ChainMemo`` (every turn hashed whole), and the ratio to ``round_robin``. In the gateway a
pick runs between other work on a shared core, so ``gateway_routing_pick_seconds`` reads higher
(the routing benchmark reports it); this is the pick's own cost.
"""

from __future__ import annotations

import argparse
import random
import time

from gateway.admission.build import build_request
from gateway.clock import MonotonicClock
from gateway.dialects.chat import CHAT
from gateway.dispatch.backends import BackendPool
from gateway.dispatch.router import Router
from gateway.policy.snapshot import PolicySnapshot
from gateway.request.keys import hash_api_key
from gateway.request.tokens import CharRatioEstimator
from gateway.routing.prefix_affinity import PrefixAffinityRouter
from gateway.routing.prefix_secret import PrefixSecret
from gateway.routing.registry import RouterSpec, build_router
from gateway.service import parse_policy
from gateway.types import InferenceRequest
from loadtests.loadgen.prompts import words

MODEL = "m"
PICK_SECRET = PrefixSecret(b"pick-cost")
"""The cache-salt secret of the routers measured (it keys the prefix roots)."""


def policy(strategy: str) -> PolicySnapshot:
    backends = "\n".join(
        f'  - {{name: b{i}, url: "http://127.0.0.1:{1 + i}", kind: sim, models: [{MODEL}], '
        "capacity: {max_concurrent: 100, kv_cache_tokens: 411520}}"
        for i in range(4)
    )
    return parse_policy(
        f"""
version: pick-cost
classes:
  interactive: {{rank: 0, slo: {{ttft_ms: 500, itl_ms: 30, e2e_ms: 60000}}}}
models:
  - {{name: {MODEL}, max_prompt_tokens: 200000, routing: {{strategy: {strategy}}}}}
backends:
{backends}
tenants:
  - {{name: acme, key_hashes: ["{hash_api_key("key-acme")}"], models: ["*"], default_class: interactive}}
""",
        "pick-cost.yaml",
    )


def requests(snapshot: PolicySnapshot, chats: list[list[str]], system: str, turns: int) -> list[InferenceRequest]:
    out = []
    for t in range(1, turns + 1):
        for chat in chats:
            messages = [{"role": "system", "content": system}]
            messages += [
                {"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(chat[: 2 * t - 1])
            ]
            body = {"model": MODEL, "messages": messages, "max_tokens": 128}
            out.append(
                build_request(
                    api=CHAT,
                    body=body,
                    raw_body=b"",
                    request_id="r",
                    arrival=0.0,
                    model_policy=snapshot.models[MODEL],
                    limits=snapshot.policy.limits,
                    estimator=CharRatioEstimator(),
                )
            )
    return out


def run(
    strategy: str,
    chats: list[list[str]],
    system: str,
    turns: int,
    *,
    memo: bool = True,
    secret: PrefixSecret = PICK_SECRET,
) -> float:
    """Mean seconds per pick over every turn of every chat (``secret`` keys the prefix roots)."""
    snapshot = policy(strategy)
    router: Router = build_router(RouterSpec(MODEL, snapshot.models[MODEL].routing, MonotonicClock(), secret, 3.0))
    if not memo and isinstance(router, PrefixAffinityRouter):
        router.memo = None
    candidates = list(BackendPool(snapshot).for_model(MODEL))
    tenant = snapshot.policy.tenants[0]
    batch = requests(snapshot, chats, system, turns)
    spent = 0.0
    for request in batch:
        start = time.perf_counter()
        decision = router.pick(request, tenant, candidates)
        spent += time.perf_counter() - start
        router.on_dispatch(request, tenant, decision)
    return spent / len(batch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--chats", type=int, default=16)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    rng = random.Random(1)
    system = words(2048, rng)
    chats = [[words(384 if i % 2 == 0 else 192, rng) for i in range(2 * args.turns)] for _ in range(args.chats)]
    cases = [("round_robin", True), ("least_load", True), ("prefix_affinity", False), ("prefix_affinity", True)]
    results = {
        case: min(run(case[0], chats, system, args.turns, memo=case[1]) for _ in range(args.repeat)) for case in cases
    }
    base = results[("round_robin", True)]
    for (strategy, memo), seconds in results.items():
        label = strategy if memo or strategy != "prefix_affinity" else "prefix_affinity (no memo)"
        print(f"{label:28} {seconds * 1e6:7.1f} us/pick  {seconds / base:6.1f} x round_robin")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
