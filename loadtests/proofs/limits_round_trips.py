"""Redis round trips per request that tenant limits cost, before and after leases (issue 28, item 5).

Usage::

    python -m loadtests.proofs.limits_round_trips [--rate 200,2000] [--seconds 6] [--warmup-s 2] [--tenants 1,20]
                                          [--hold-ms 20] [--baseline d09cf7b]
                                          [--out loadtests/results/limits_round_trips]

One process plays a gateway replica's limit path at ``--rate`` requests a second: each request
is admitted through ``TenantLimiter`` (a concurrency slot, a request and its tokens), runs
``--hold-ms``, and is settled with its real usage; the store's keeper (``run()``: pings,
renewals, lease top-ups) runs beside, as in the gateway. Tenants have limits the load never
reaches (rpm 10^7, tpm 10^10, 5,000 slots), spread round-robin over ``--tenants`` of them.
The store reaches the real Redis at 127.0.0.1:6379 through a proxy on a thread of the same
process (``loadtests/harness/delay_proxy.py``) that counts what the client writes: a command, or a
pipeline, is one write, one round trip. Counted after ``--warmup-s``.

Each configuration runs for this tree and for ``--baseline`` (the revision before leases,
its code extracted by ``git archive``), alternating, in a child process with that tree's
``gateway`` on its path (this file is the driver for both). The parent writes the child's policy,
picks its key prefix and drops that prefix's keys when the child ends: the child imports nothing
of the bench but the proxy, so a baseline tree needs neither this tree's harness nor a test
suite. Reported: round trips per request (the store's own: ping, keeper, admissions,
settlements), the rate achieved, the time a request spent in admission plus settlement
(P50/P95/P99, µs), the store's fall-backs (operations answered without Redis: a store that fell
back sends nothing, so its figure is no cost), the load average. At 2,000 req/s the code before
leases cannot keep its Redis within the request budget on a shared 2-core machine (each request
two round trips through the in-process proxy) and falls back: its row there is not its cost;
the 200 req/s rows are.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
REDIS_PORT = 6379
MODEL = "m"
LIMITS = "{rpm: 10000000, tpm: 10000000000, max_concurrent: 5000}"
"""Each tenant's limits: ones the load never reaches (module docstring)."""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def policy(tenants: int) -> str:
    """Tenants ``t0``, ``t1``, ... with ``LIMITS``, in the smallest policy both trees load (the
    parent's: the import is here because a baseline's ``gateway`` keeps ``hash_api_key`` elsewhere)."""
    from gateway.request.keys import hash_api_key

    rows = [
        f'  - {{name: t{i}, key_hashes: ["{hash_api_key(f"key-t{i}")}"], models: ["*"], default_class: interactive,'
        f" limits: {LIMITS}}}"
        for i in range(tenants)
    ]
    return f"""
version: limits-round-trips
classes:
  interactive: {{rank: 0, slo: {{ttft_ms: 500, itl_ms: 30, e2e_ms: 60000}}}}
models:
  - {{name: {MODEL}, max_prompt_tokens: 64, max_output_tokens: 32}}
backends:
  - {{name: nowhere, url: "http://127.0.0.1:1", kind: vllm, models: [{MODEL}]}}
tenants:
""" + "\n".join(rows)


async def drive(
    rate: float, seconds: float, warmup_s: float, policy_text: str, prefix: str, hold_ms: float
) -> dict[str, Any]:
    """The child: the limit path of one replica at ``rate`` (module docstring); this tree's or the
    baseline's code, with every tenant of ``policy_text``, under the key ``prefix``."""
    from gateway.admission.tenant_limits import TenantLimiter
    from gateway.dialects.chat import CHAT
    from gateway.limitstore.redis import RedisConfig, RedisLimitStore
    from gateway.service import parse_policy
    from gateway.types import InferenceRequest

    try:
        from loadtests.harness.delay_proxy import DelayProxy
    except ModuleNotFoundError:  # a baseline tree from before loadtests/ was split (issue 29)
        from loadtests.delay_proxy import DelayProxy  # type: ignore[import-not-found,no-redef]

    chosen = list(parse_policy(policy_text, "limits_round_trips.yaml").policy.tenants)
    with DelayProxy(upstream_port=REDIS_PORT) as proxy:
        fallbacks: list[str] = []
        config = RedisConfig(url=proxy.url, key_prefix=prefix, timeout_s=0.2, request_budget_s=0.1)
        store = RedisLimitStore(config, on_fallback=fallbacks.append)
        limiter = TenantLimiter(store)
        waits: list[float] = []
        counting = False

        async def one(i: int) -> None:
            request = InferenceRequest("id", CHAT, MODEL, {}, b"", False, False, 100, 200, 0.0)
            started = time.perf_counter()
            admission = await limiter.admit(chosen[i % len(chosen)], request)
            admitted = time.perf_counter()
            await asyncio.sleep(hold_ms / 1000)
            settling = time.perf_counter()
            await limiter.settle(admission, used_tokens=150)
            if counting:
                waits.append((admitted - started + time.perf_counter() - settling) * 1e6)

        await store.check()
        keeper = asyncio.create_task(store.run())
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()
        start = loop.time()
        sent_at, sent_until, requests, started_at, ended_at = 0, 0, 0, 0.0, 1.0
        try:
            i = 0
            while (now := loop.time()) < start + warmup_s + seconds:
                if not counting and now >= start + warmup_s:
                    counting, sent_at, requests, started_at = True, proxy.sent, 0, now
                    fallbacks.clear()
                due = int((now - start) * rate)
                while i < due:
                    task = loop.create_task(one(i))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    i += 1
                    requests += 1
                await asyncio.sleep(0.001)
            sent_until, ended_at = proxy.sent, loop.time()
            await asyncio.gather(*tasks)
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            up = store.up
            await store.aclose()
    return {
        "requests": requests,
        "rate_achieved": requests / (ended_at - started_at),
        "round_trips": sent_until - sent_at,
        "round_trips_per_request": (sent_until - sent_at) / max(1, requests),
        "store_wait_us": {
            "p50": percentile(waits, 0.5),
            "p95": percentile(waits, 0.95),
            "p99": percentile(waits, 0.99),
            "mean": statistics.fmean(waits) if waits else 0.0,
        },
        "redis_up_at_end": up,
        "fallback_operations": len(fallbacks),
    }


def child(tree: Path, args: argparse.Namespace, tenants: int, rate: float) -> dict[str, Any]:
    """Run ``drive`` in a child process whose ``gateway`` (and loadtests) come from ``tree``; its
    policy and key prefix are this process's, and so is the tidy-up of its keys."""
    from loadtests.harness.processes import policy_file  # the parent's: the child may run a tree without them
    from loadtests.harness.shared_redis import REDIS_URL, drop_keys

    prefix = f"rt-bench-{uuid.uuid4().hex[:8]}:"
    argv = [sys.executable, str(Path(__file__).resolve()), "--driver", "--rate", str(rate)]
    argv += ["--seconds", str(args.seconds), "--warmup-s", str(args.warmup_s), "--prefix", prefix]
    argv += ["--hold-ms", str(args.hold_ms)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    load = os.getloadavg()
    with policy_file(policy(tenants)) as path:
        try:
            done = subprocess.run(
                [*argv, "--policy", str(path)], cwd=tree, env=env, check=True, capture_output=True, text=True
            )
        finally:
            drop_keys(REDIS_URL, prefix)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["load_average_start"] = load
    result["load_average_end"] = os.getloadavg()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rate", default="200,2000", help="requests a second (a list: one run each)")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--tenants", default="1,20")
    parser.add_argument("--hold-ms", type=float, default=20.0)
    parser.add_argument("--baseline", default="d09cf7b")
    parser.add_argument("--out", default=None)
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--policy", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.driver:
        text = args.policy.read_text()
        result = asyncio.run(drive(float(args.rate), args.seconds, args.warmup_s, text, args.prefix, args.hold_ms))
        print(json.dumps(result))
        return 0

    from loadtests.harness.processes import checkout

    runs: list[dict[str, Any]] = []
    print(f"# {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}, {os.cpu_count()} cores")
    print(
        f"{'code':<22}{'tenants':>8}{'req/s':>8}{'rt/req':>9}{'rt':>7}{'fall-backs':>11}"
        "   wait µs P50 / P95 / P99   load avg"
    )
    with checkout(args.baseline) as before:
        for rate in (float(r) for r in args.rate.split(",")):
            for tenants in (int(t) for t in args.tenants.split(",")):
                for label, tree in ((f"{args.baseline} (before)", before), ("leases (this tree)", ROOT)):
                    result = child(tree, args, tenants, rate)
                    result.update(code=label, tenants=tenants, rate=rate)
                    runs.append(result)
                    w = result["store_wait_us"]
                    print(
                        f"{label:<22}{tenants:>8}{result['rate_achieved']:>8.0f}"
                        f"{result['round_trips_per_request']:>9.4f}{result['round_trips']:>7}"
                        f"{result['fallback_operations']:>11}   {w['p50']:>7.0f} / {w['p95']:>6.0f} / {w['p99']:>6.0f}"
                        f"   {result['load_average_start'][0]:.2f}"
                    )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
