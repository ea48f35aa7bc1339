"""Admission control proven on load: isolation, fairness and bounds (the admission issue's proof).

Usage::

    python -m loadtests.proofs.admission_bench [--scenarios capacity,isolation,fairness,bounds]
                                        [--time-scale 8] [--phase-s 60] [--replicas 2] [--repeats 3]
                                        [--out loadtests/results/admission]

Two simulated Llama-3.1-8B H100 engines (``inference-gateway sim``, one process) sit behind the
gateway (another process). Every load is open-loop (``loadtests/loadgen``), in simulated
seconds: with ``--time-scale K`` every simulated duration, SLO and rate is scaled by K so that
this 2-core machine keeps up (each report states K and the engines' step lag). Both classes
send requests of the same shape, so that capacity is one number in requests per second.

* capacity: a batch flood far above capacity through the gateway; completions per second at
  saturation are the capacity C every other scenario is expressed in.
* isolation: interactive at 0.3 C alone; then with a batch flood at 3 C, admission on; then
  the same with admission off (a plain proxy: no caps, no queue, no engine priority).
  Goals: interactive P99 TTFT with the flood <= 1.25 x alone, no interactive request refused,
  batch completing >= 80% of the capacity left over (0.8 x 0.7 C).
* fairness: two tenants in one class, light at 0.15 C and heavy at 1.5 C. Goal: the light
  tenant gets all it asks within its SLO, the heavy one the rest; admission off for contrast.
* ``--replicas 2``: the isolation scenario's batch flood arrives on a second gateway replica,
  the interactive traffic on the first, the two sharing the engines' capacity through Redis
  (``gateway/fleet/``): strict class order must hold across replicas.
* bounds: 10 C for the phase: gateway memory flat, every refusal answered within 50 ms,
  accepted requests within their SLO, every queue and in-flight counter back to zero after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.request.keys import hash_api_key
from loadtests.harness.processes import (
    GATEWAY,
    admin_args,
    admin_url,
    metric_sum,
    metrics,
    policy_file,
    process,
    rss_bytes,
)
from loadtests.loadgen.records import RECORDS_FILE, RequestRecord, read_records
from loadtests.loadgen.runner import RunConfig, RunResult, run_sync, run_workload
from loadtests.loadgen.stats import percentile
from loadtests.loadgen.workload import Workload, parse_workload

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PROFILE = "llama-3.1-8b-h100"
ENGINE_PORT = 18601
GATEWAY_PORT = 18600
KEYS = {"acme": "bench-key-acme", "globex": "bench-key-globex", "initech": "bench-key-initech"}
# MLPerf server-scenario SLOs for Llama-3.1-8B (interactive) and a relaxed batch class.
INTERACTIVE_SLO = {"ttft_ms": 500, "tpot_ms": 30}
BATCH_SLO = {"ttft_ms": 10_000, "tpot_ms": 100}
PROMPT = {"dist": "lognormal", "mean": 512, "sigma": 0.5, "min": 32, "max": 2048}
OUTPUT = {"dist": "lognormal", "mean": 128, "sigma": 0.4, "min": 16, "max": 512}


@dataclass(frozen=True)
class Knobs:
    """The policy variables of the benchmark, one place to tune them one at a time."""

    max_concurrent: int = 48  # per engine
    batch_share: float = 0.5
    batch_prefilling: int | None = None  # batch requests per engine still waiting for their first token
    interactive_depth: int = 256
    batch_depth: int = 512


def gateway_policy(k: float, admission: bool, knobs: Knobs, shared: str | None = None) -> str:
    """The bench policy; ``admission=False`` is a plain proxy: no caps, no queueing, no engine priority.
    ``shared`` is a Redis key prefix: the replicas then share the capacity (``gateway/fleet/``)."""
    conc = knobs.max_concurrent if admission else 1_000_000
    share = knobs.batch_share if admission else 1.0
    waiting = 8 if admission else 100_000
    backends = "\n".join(
        f"""  - {{name: engine-{i}, url: "http://127.0.0.1:{ENGINE_PORT + i}", kind: sim, models: [{MODEL}],
      engine_priority: {str(admission).lower()},
      timeouts: {{first_byte_s: {60 * k}, between_chunks_s: {30 * k}}},
      capacity: {{max_concurrent: {conc}, max_tokens_in_flight: 100000000, max_waiting: {waiting}}}}}"""
        for i in range(2)
    )
    tenants = "\n".join(
        f"""  - {{name: {name}, key_hashes: ["{hash_api_key(key)}"], models: ["*"], default_class: interactive}}"""
        for name, key in KEYS.items()
    )
    return f"""
version: admission-bench-{"on" if admission else "off"}
classes:
  interactive:
    rank: 0
    slo: {{ttft_ms: {500 * k}, itl_ms: {30 * k}, e2e_ms: {60_000 * k}}}
    queue: {{max_depth: {knobs.interactive_depth}}}  # max wait: the TTFT objective
  batch:
    rank: 1
    slo: {{ttft_ms: {10_000 * k}, itl_ms: {100 * k}, e2e_ms: {600_000 * k}}}
    max_share: {share}
    max_prefilling: {knobs.batch_prefilling if admission and knobs.batch_prefilling else "null"}
    queue: {{max_depth: {knobs.batch_depth}, max_wait_s: {60 * k}}}
models:
  - {{name: {MODEL}, max_prompt_tokens: 8192, max_output_tokens: 2048}}
backends:
{backends}
tenants:
{tenants}
health_checks: {{interval_s: 2, timeout_s: {2 * k}}}
scrape: {{interval_s: 0.5, timeout_s: 1}}
{_shared_state(shared)}"""


def _shared_state(prefix: str | None) -> str:
    if prefix is None:
        return ""
    state = f'state: {{backend: redis, redis_url: "redis://127.0.0.1:6379/0", key_prefix: "{prefix}"}}'
    return state + "\nfleet: {sync_interval_s: 0.02, lease_ttl_s: 2}\n"


def gateway_port(replica: int) -> int:
    return GATEWAY_PORT + 100 * replica


def workload(name: str, tenant: str, class_name: str) -> Workload:
    slo = INTERACTIVE_SLO if class_name == "interactive" else BATCH_SLO
    raw = {
        "name": name,
        "model": MODEL,
        "stream": True,
        "classes": {class_name: {"share": 1.0, "priority": class_name, "slo": slo}},
        "tenants": {tenant: {"share": 1.0, "api_key": KEYS[tenant]}},
        "prompt_tokens": PROMPT,
        "output_tokens": OUTPUT,
    }
    return parse_workload(raw, source=f"admission_bench:{name}")


@contextmanager
def system(k: float, admission: bool, knobs: Knobs, replicas: int = 1) -> Iterator[int]:
    """Engines and gateways up (``replicas`` of them sharing the capacity through Redis when more
    than one); yields the first gateway's pid."""
    sim = [*GATEWAY, "sim", "--profile", PROFILE, "--port", str(ENGINE_PORT), "--count", "2", "--time-scale", str(k)]
    shared = f"admission-bench-{uuid.uuid4().hex[:8]}:" if replicas > 1 else None
    with ExitStack() as stack:
        stack.enter_context(process(sim, f"http://127.0.0.1:{ENGINE_PORT + 1}/health"))
        path = stack.enter_context(policy_file(gateway_policy(k, admission, knobs, shared)))
        pids = []
        for replica in range(replicas):
            port = gateway_port(replica)
            serve = [*GATEWAY, "serve", "--policy", str(path), "--port", str(port), *admin_args(port)]
            pids.append(stack.enter_context(process(serve, f"http://127.0.0.1:{port}/readyz")).pid)
        yield pids[0]


@dataclass
class Flow:
    workload: Workload
    rate: float  # simulated requests per second
    replica: int = 0  # which gateway replica it is sent to


async def run_flows(flows: list[Flow], phase_s: float, k: float, out: Path, seed: int = 0) -> list[RunResult]:
    runs = [
        run_workload(
            flow.workload,
            RunConfig(
                target=f"http://127.0.0.1:{gateway_port(flow.replica)}",
                rate=flow.rate,
                duration_s=phase_s,
                out_dir=out / flow.workload.name,
                seed=seed + i,
                time_scale=k,
                drain_timeout_s=120 * k,
            ),
            base_dir=Path("."),
        )
        for i, flow in enumerate(flows)
    ]
    return list(await asyncio.gather(*runs))


def figures(records: list[RequestRecord], phase_s: float, k: float) -> dict[str, Any]:
    """Per-flow figures in simulated units: rates per simulated second, latencies in simulated ms.

    Throughput counts completions inside the steady part of the phase (its last three quarters,
    wall clock), so that neither the ramp-up nor the drain after sending stops inflates it.
    """
    ok = [r for r in records if r.ok]
    refused = [r for r in records if r.status in (429, 503)]
    ttft = sorted(r.ttft_s / k * 1000 for r in ok if r.ttft_s is not None)
    # Wall time the client waited for its refusal: immediate refusals (full queue, unmeetable
    # deadline, tenant limits) apart from queue timeouts, which waited in the queue first.
    immediate_ms = sorted((r.e2e_s or 0) * 1000 for r in refused if r.error != "queue_timeout")
    start = min((r.t_send for r in records), default=0.0)
    window = (start + 0.25 * phase_s, start + phase_s)
    done_in_window = sum(1 for r in ok if window[0] <= r.t_send + (r.e2e_s or 0) <= window[1])
    return {
        "sent": len(records),
        "offered_per_s": len(records) / (phase_s / k),
        "ok": len(ok),
        "refused": len(refused),
        "refused_by_reason": _count(r.error or "" for r in refused),
        "other_errors": len(records) - len(ok) - len(refused),
        "completed_per_s": done_in_window / (0.75 * phase_s / k),
        "slo_attainment": (sum(r.slo_met for r in records) / len(records)) if records else None,
        "ttft_p50_ms": percentile(ttft, 50) if ttft else None,
        "ttft_p99_ms": percentile(ttft, 99) if ttft else None,
        "immediate_refusal_wall_ms_max": immediate_ms[-1] if immediate_ms else None,
        "immediate_refusal_wall_ms_p99": percentile(immediate_ms, 99) if immediate_ms else None,
        "queue_timeouts": sum(1 for r in refused if r.error == "queue_timeout"),
    }


def isolation_goal(out: Path, alone: list[dict[str, Any]], flooded: list[dict[str, Any]], k: float) -> dict[str, Any]:
    """Interactive P99 TTFT under the flood against alone: per repeat, and over every repeat's
    requests together (a P99 of ~100 requests is their largest one or two; pooled repeats give
    it a few times more samples). Goal: <= 1.25, with no interactive request refused."""

    def ttfts(phases: list[dict[str, Any]]) -> list[float]:
        out_ms = []
        for ph in phases:
            for r in read_records(out / ph["phase"] / "interactive" / RECORDS_FILE):
                if r.ok and r.ttft_s is not None:
                    out_ms.append(r.ttft_s / k * 1000)
        return sorted(out_ms)

    def interactive(ph: dict[str, Any]) -> dict[str, Any]:
        return next(v for key, v in ph["flows"].items() if "/interactive@" in key)

    per_repeat = [
        {
            "alone_p99_ms": interactive(a)["ttft_p99_ms"],
            "flood_p99_ms": interactive(f)["ttft_p99_ms"],
            "ratio": interactive(f)["ttft_p99_ms"] / interactive(a)["ttft_p99_ms"],
            "interactive_refused_in_flood": interactive(f)["refused"],
        }
        for a, f in zip(alone, flooded, strict=True)
    ]
    pooled_alone, pooled_flood = ttfts(alone), ttfts(flooded)
    ratio = percentile(pooled_flood, 99) / percentile(pooled_alone, 99)
    refused = sum(row["interactive_refused_in_flood"] for row in per_repeat)
    return {
        "per_repeat": per_repeat,
        "pooled": {
            "alone_requests": len(pooled_alone),
            "flood_requests": len(pooled_flood),
            "alone_p50_ms": percentile(pooled_alone, 50),
            "flood_p50_ms": percentile(pooled_flood, 50),
            "alone_p99_ms": percentile(pooled_alone, 99),
            "flood_p99_ms": percentile(pooled_flood, 99),
            "ratio": ratio,
        },
        "goal": "flood P99 <= 1.25 x alone, no interactive refused",
        "met": ratio <= 1.25 and refused == 0,
    }


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def phase(
    name: str, flows: list[Flow], args: argparse.Namespace, admission: bool, knobs: Knobs, watch_memory: bool = False
) -> dict[str, Any]:
    out = args.out / name
    replicas = max(flow.replica for flow in flows) + 1
    with system(args.time_scale, admission, knobs, replicas) as pid:
        memory: list[int] = []
        stop = threading.Event()
        sampler = threading.Thread(target=_sample_rss, args=(pid, memory, stop), daemon=True)
        if watch_memory:
            sampler.start()
        started = time.monotonic()
        results = run_sync(lambda: run_flows(flows, args.phase_s, args.time_scale, out))
        stop.set()
        settle = _wait_for_zero(admin_url(GATEWAY_PORT))
        for replica in range(1, replicas):
            settle = {
                name: settle[name] + value for name, value in _wait_for_zero(admin_url(gateway_port(replica))).items()
            }
        lag = _engine_lag()
    report: dict[str, Any] = {
        "phase": name,
        "admission": admission,
        "wall_s": round(time.monotonic() - started, 1),
        "flows": {
            f"{r.records[0].tenant if r.records else '?'}/{flow.workload.name}@{flow.rate:g}/s": figures(
                r.records, args.phase_s, args.time_scale
            )
            for flow, r in zip(flows, results, strict=True)
        },
        "counters_after": settle,
        "engine_step_lag": lag,
    }
    if watch_memory and memory:
        half = len(memory) // 2
        report["gateway_rss_mib"] = {
            "first": memory[0] / 2**20,
            "max_first_half": max(memory[:half] or memory) / 2**20,
            "max_second_half": max(memory[half:]) / 2**20,
            "last": memory[-1] / 2**20,
            "series": [round(m / 2**20, 1) for m in memory],
        }
    print(json.dumps(report, indent=1), flush=True)
    return report


def _sample_rss(pid: int, out: list[int], stop: threading.Event) -> None:
    while not stop.wait(1.0):
        try:
            out.append(rss_bytes(pid))
        except OSError:
            return


def _wait_for_zero(base_url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """Poll the gateway's operator listener (``base_url``) until its queues and in-flight counters
    are zero; report what it saw."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = metrics(base_url)
        seen = {
            "queue_depth": metric_sum(samples, "gateway_queue_depth"),
            "in_flight_requests": metric_sum(samples, "gateway_backend_in_flight_requests"),
            "in_flight_tokens": metric_sum(samples, "gateway_backend_in_flight_tokens"),
        }
        if not any(seen.values()) or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


def _engine_lag() -> dict[str, float]:
    """The engines' own step lag (how late their steps ran), to show the CPU kept up."""
    out = {}
    for i in range(2):
        samples = metrics(f"http://127.0.0.1:{ENGINE_PORT + i}")
        count = metric_sum(samples, "sim:step_lag_seconds_count")
        late = count - metric_sum(samples, "sim:step_lag_seconds_bucket", le="0.01")
        out[f"engine-{i}_steps_later_than_10ms"] = late / count if count else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--scenarios", default="capacity,isolation,fairness,bounds")
    parser.add_argument("--time-scale", type=float, default=8.0)
    parser.add_argument("--phase-s", type=float, default=60.0, help="wall seconds of load per phase")
    parser.add_argument("--capacity", type=float, default=None, help="skip measuring: C in simulated req/s")
    parser.add_argument("--batch-share", type=float, default=Knobs().batch_share)
    parser.add_argument("--max-concurrent", type=int, default=Knobs().max_concurrent)
    parser.add_argument("--batch-prefilling", type=int, default=None, help="max_prefilling of the batch class")
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="2: interactive and batch arrive on two gateway replicas sharing the capacity through Redis",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the isolation scenario's alone and flood phases this many times, alternated; the goal "
        "is judged on each and on the P99 of all their interactive requests together",
    )
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/admission"))
    args = parser.parse_args(argv)
    knobs = Knobs(
        max_concurrent=args.max_concurrent, batch_share=args.batch_share, batch_prefilling=args.batch_prefilling
    )
    scenarios = args.scenarios.split(",")
    results: dict[str, Any] = {"time_scale": args.time_scale, "phase_s": args.phase_s, "knobs": knobs.__dict__}
    interactive = workload("interactive", "acme", "interactive")
    batch = workload("batch", "globex", "batch")
    capacity = args.capacity
    if capacity is None or "capacity" in scenarios:
        flood = phase("capacity", [Flow(batch, 200.0)], args, True, Knobs(knobs.max_concurrent, 1.0, None))
        capacity = next(iter(flood["flows"].values()))["completed_per_s"]
        results["capacity"] = flood
    results["C"] = capacity
    print(f"capacity C = {capacity:.2f} simulated requests/s", flush=True)
    if "isolation" in scenarios:
        flood_replica = 1 if args.replicas > 1 else 0
        alone, flooded = [], []
        for repeat in range(args.repeats):  # alternated, so that drift on the machine hits both alike
            tag = "" if args.repeats == 1 else f"-{repeat + 1}"
            alone.append(phase(f"isolation-alone{tag}", [Flow(interactive, 0.3 * capacity)], args, True, knobs))
            flows = [Flow(interactive, 0.3 * capacity), Flow(batch, 3 * capacity, replica=flood_replica)]
            flooded.append(phase(f"isolation-flood{tag}", flows, args, True, knobs))
        contrast = phase(
            "isolation-flood-no-admission",
            [Flow(interactive, 0.3 * capacity), Flow(batch, 3 * capacity)],
            args,
            False,
            knobs,
        )
        results["isolation"] = [*alone, *flooded, contrast]
        results["isolation_goal"] = isolation_goal(args.out, alone, flooded, args.time_scale)
        print(json.dumps({"isolation_goal": results["isolation_goal"]}, indent=1), flush=True)
    if "fairness" in scenarios:
        light = workload("light", "acme", "interactive")
        heavy = workload("heavy", "initech", "interactive")
        flows = [Flow(light, 0.15 * capacity), Flow(heavy, 1.5 * capacity)]
        results["fairness"] = [
            phase("fairness", flows, args, True, knobs),
            phase("fairness-no-admission", flows, args, False, knobs),
        ]
    if "bounds" in scenarios:
        results["bounds"] = phase("bounds", [Flow(interactive, 10 * capacity)], args, True, knobs, watch_memory=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "admission.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
