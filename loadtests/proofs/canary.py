"""How fast, and how rightly, the canary decides by itself: real processes, open-loop traffic.

Usage::

    python -m loadtests.proofs.canary [--repeats 5] [--out loadtests/results/canary] [--interval-s 0.5]
                               [--rate 40] [--steps 5,25,50,100 --steps 20,50,100]
                               [--scenarios slow_2x,failing,healthy] [--deadline-s 120]

Each run starts fresh processes: two simulated engines (``inference-gateway sim``, profile
``llama-3.1-8b-h100``; the baseline at time scale 0.5) and one gateway (``serve``) with its
rollout state in a new temporary ``GATEWAY_ROLLOUT_DIR``. The policy has one model group whose
targets are ``v1`` (baseline, on the first engine) and ``v2`` (candidate, on the second) and a
rollout from v1 to v2 by ``--steps``, judged every ``--interval-s``, ``min_requests`` 20; retries
and breakers are off, so that every candidate request reaches the candidate's engine (as in
``tests/groups/test_canary.py``). Scenarios, by what the candidate engine is:

* ``slow_2x``: the same profile at twice the time scale (twice the step time): expect ``rolled_back``;
* ``failing``: every request answered 503 (``POST /admin/fault {"mode": "fail_503"}``): expect ``rolled_back``;
* ``healthy``: identical to the baseline: expect ``promoted``.

Once both engines answer and the gateway sees them healthy, an open-loop load starts: Poisson
arrivals at ``--rate`` of streaming chat requests to the group (``max_tokens`` 8), at most
``--max-in-flight`` at once (an arrival beyond that is skipped and counted), while
``GET /admin/rollout`` is polled every 50 ms on the operator port. When the rollout reaches a
terminal state (or ``--deadline-s`` passes: verdict ``timeout``) the run records:

* ``seconds_to_verdict``: from the first request sent to the poll that saw the verdict
  (``seconds_to_decision``: to the state's own ``updated_at``, without the poll's delay);
* ``candidate_requests``: requests the candidate's engine has seen, from its own metrics read
  right then (``vllm:request_success_total`` over every ``finished_reason`` plus
  ``sim:faults_injected_total``; requests still in flight are not counted);
* ``requests_before_verdict``: requests sent until then; the verdict's reason string.

Per steps and scenario: P50/P95/max of both figures, and the wrong verdicts (a healthy
candidate rolled back, a bad one promoted). Results: ``canary.json`` and ``canary.txt`` (the
table, the command line, the date, ``uptime`` before and after) in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import math
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.request.keys import hash_api_key
from loadtests.harness.processes import GATEWAY, Samples, free_port, labelled, metric_sum, policy_file, process

PROFILE = "llama-3.1-8b-h100"
BASE_SCALE = 0.5
GROUP = "llama"
API_KEY = "canary-bench-key"
ADMIN_KEY = "canary-bench-admin"
MIN_REQUESTS = 20
MAX_TOKENS = 8
POLL_S = 0.05
DEFAULT_STEPS: tuple[tuple[float, ...], ...] = ((5, 25, 50, 100), (20, 50, 100))
RESERVED_PORTS = range(19000, 19800)
"""Ports other benchmarks and tests on this machine use: never taken here."""
TERMINAL = ("rolled_back", "promoted")
TIMEOUT = "timeout"
READY_TIMEOUT_S = 60.0
DEFAULT_OUT = Path("loadtests/results/canary")


@dataclass(frozen=True, slots=True)
class Scenario:
    """What the candidate engine is, and the verdict a right canary reaches."""

    name: str
    expect: str
    scale_factor: float = 1.0
    """The candidate engine's time scale over the baseline's (2: twice the step time)."""
    fault: str | None = None
    """A fault injected into the candidate engine before the gateway starts."""


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("slow_2x", "rolled_back", scale_factor=2.0),
        Scenario("failing", "rolled_back", fault="fail_503"),
        Scenario("healthy", "promoted"),
    )
}


@dataclass(slots=True)
class RunResult:
    """One run of one scenario (the module docstring says what each figure is)."""

    scenario: str
    steps: list[float]
    repeat: int
    expect: str
    verdict: str = TIMEOUT
    seconds_to_verdict: float | None = None
    seconds_to_decision: float | None = None
    candidate_requests: float | None = None
    baseline_requests: float | None = None
    requests_before_verdict: int = 0
    requests_sent: int = 0
    skipped: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    targets: dict[str, int] = field(default_factory=dict)
    reason: str = ""
    by: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    @property
    def wrong(self) -> bool:
        """A terminal verdict other than the expected one (a timeout or an error is not a verdict)."""
        return self.verdict in TERMINAL and self.verdict != self.expect


# -- pure parts ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, interpolated linearly between the closest
    ranks (numpy's default); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within 0..100, not {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: Sequence[float]) -> dict[str, float]:
    """P50, P95 and max of ``values`` (NaN each when there are none) and how many there are."""
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "max": max(values) if values else math.nan,
    }


def steps_label(steps: Sequence[float]) -> str:
    return ",".join(f"{s:g}" for s in steps)


def _known(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def summarize(runs: Sequence[RunResult]) -> list[dict[str, Any]]:
    """Per steps and scenario (in the order first seen): the verdicts, the wrong ones, and the
    spread of time to verdict and of candidate requests over the runs that reached a verdict."""
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for run in runs:
        groups.setdefault((steps_label(run.steps), run.scenario), []).append(run)
    out = []
    for (steps, scenario), members in groups.items():
        decided = [r for r in members if r.verdict in TERMINAL]
        out.append(
            {
                "steps": steps,
                "scenario": scenario,
                "expect": members[0].expect,
                "runs": len(members),
                "verdicts": dict(Counter(r.verdict for r in members)),
                "wrong": sum(r.wrong for r in members),
                "no_verdict": len(members) - len(decided),
                "seconds_to_verdict": spread(_known(r.seconds_to_verdict for r in decided)),
                "candidate_requests": spread(_known(r.candidate_requests for r in decided)),
                "requests_before_verdict": spread([float(r.requests_before_verdict) for r in decided]),
            }
        )
    return out


def _fmt(value: float, digits: int) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def format_table(summary: Sequence[Mapping[str, Any]]) -> str:
    """The summary as a fixed-width table, one line per steps and scenario."""
    header = (
        f"{'steps':<13} {'scenario':<8} {'expect':<11} {'runs':>4} {'wrong':>5} {'none':>4}  "
        f"{'time to verdict s P50/P95/max':>30}  {'candidate reqs P50/P95/max':>27}  {'all reqs P50':>12}  verdicts"
    )
    lines = [header, "-" * len(header)]
    for row in summary:
        t, c, a = row["seconds_to_verdict"], row["candidate_requests"], row["requests_before_verdict"]
        times = f"{_fmt(t['p50'], 1)} / {_fmt(t['p95'], 1)} / {_fmt(t['max'], 1)}"
        cand = f"{_fmt(c['p50'], 0)} / {_fmt(c['p95'], 0)} / {_fmt(c['max'], 0)}"
        verdicts = ", ".join(f"{k} {v}" for k, v in sorted(row["verdicts"].items()))
        lines.append(
            f"{row['steps']:<13} {row['scenario']:<8} {row['expect']:<11} {row['runs']:>4} {row['wrong']:>5} "
            f"{row['no_verdict']:>4}  {times:>30}  {cand:>27}  {_fmt(a['p50'], 0):>12}  {verdicts}"
        )
    return "\n".join(lines)


def policy_text(
    baseline_url: str,
    candidate_url: str,
    *,
    steps: Sequence[float],
    interval_s: float,
    min_requests: int = MIN_REQUESTS,
) -> str:
    """The bench's policy: group ``GROUP`` over v1 (baseline) and v2 (candidate), one engine each."""
    rollout = {
        "baseline": "v1",
        "candidate": "v2",
        "steps": list(steps),
        "interval_s": interval_s,
        "min_requests": min_requests,
    }
    return f"""version: canary-bench
classes:
  interactive: {{rank: 0, slo: {{ttft_ms: 500, itl_ms: 30, e2e_ms: 60000}}}}
models:
  - {{name: v1, upstream_name: served-a, max_prompt_tokens: 4096, max_output_tokens: 512}}
  - {{name: v2, upstream_name: served-b, max_prompt_tokens: 4096, max_output_tokens: 512}}
backends:
  - {{name: engine-a, url: "{baseline_url}", kind: sim, models: [v1]}}
  - {{name: engine-b, url: "{candidate_url}", kind: sim, models: [v2]}}
model_groups:
  - name: {GROUP}
    targets: [{{model: v1}}, {{model: v2}}]
    rollout: {json.dumps(rollout)}
tenants:
  - name: bench
    key_hashes: ["{hash_api_key(API_KEY)}"]
    models: ["*"]
    default_class: interactive
admin: {{key_hashes: ["{hash_api_key(ADMIN_KEY)}"]}}
retry: {{max_retries: 0}}
breaker: {{consecutive_failures: null, failure_ratio: null}}
health_checks: {{interval_s: 0.5, timeout_s: 2}}
telemetry: {{tracing: {{enabled: false}}}}
"""


def parse_steps(text: str) -> tuple[float, ...]:
    """``"5,25,50,100"`` as steps; the last must be 100 and they must grow."""
    try:
        steps = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"steps must be comma-separated numbers, not {text!r}") from None
    if any(b <= a for a, b in itertools.pairwise(steps)) or steps[-1] != 100 or steps[0] <= 0:
        raise argparse.ArgumentTypeError(f"steps must grow strictly from above 0 to 100, not {text!r}")
    return steps


def parse_scenarios(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    return names


def _positive(kind: type[float] | type[int]) -> Any:
    def check(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, not {text}")
        return value

    return check


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.proofs.canary", description=__doc__.split("\n", 1)[0] if __doc__ else None
    )
    parser.add_argument("--repeats", type=_positive(int), default=5, help="runs per scenario and steps (5)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results folder ({DEFAULT_OUT})")
    parser.add_argument("--interval-s", type=_positive(float), default=0.5, help="the rollout's interval_s (0.5)")
    parser.add_argument("--rate", type=_positive(float), default=40.0, help="Poisson arrivals per second (40)")
    parser.add_argument(
        "--steps",
        type=parse_steps,
        action="append",
        help="a rollout's steps, repeatable (default: 5,25,50,100 and 20,50,100)",
    )
    parser.add_argument(
        "--scenarios", type=parse_scenarios, default=tuple(SCENARIOS), help=f"comma-separated ({','.join(SCENARIOS)})"
    )
    parser.add_argument("--deadline-s", type=_positive(float), default=120.0, help="per run, from the first request")
    parser.add_argument("--max-in-flight", type=_positive(int), default=64, help="concurrent requests at most (64)")
    parser.add_argument("--min-requests", type=_positive(int), default=MIN_REQUESTS, help="the rollout's (20)")
    parser.add_argument("--seed", type=int, default=1, help="of the arrivals (run i of a scenario: seed + i)")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = list(DEFAULT_STEPS)
    return args


# -- one run -----------------------------------------------------------------------------------


def bench_port(taken: set[int]) -> int:
    """A free loopback port outside ``RESERVED_PORTS`` and not in ``taken`` (which it joins)."""
    for _ in range(1000):
        port = free_port()
        if port not in RESERVED_PORTS and port not in taken:
            taken.add(port)
            return port
    raise RuntimeError("no free port outside the reserved range")


def _env(rollout_dir: str) -> dict[str, str]:
    """This environment without the gateway's and OpenTelemetry's settings, the rollout dir set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "OTEL_"))}
    env["GATEWAY_ROLLOUT_DIR"] = rollout_dir
    return env


def _parse(text: str) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def _scrape(client: httpx.AsyncClient, base_url: str) -> Samples:
    answer = await client.get(base_url + "/metrics", timeout=5)
    answer.raise_for_status()
    return _parse(answer.text)


def engine_requests(samples: Samples) -> float:
    """Requests an engine has finished (any reason) or refused by an injected fault."""
    return metric_sum(samples, "vllm:request_success_total") + metric_sum(samples, "sim:faults_injected_total")


@dataclass(slots=True)
class _Load:
    sent: int = 0
    skipped: int = 0
    in_flight: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    targets: Counter[str] = field(default_factory=Counter)


async def _one(client: httpx.AsyncClient, url: str, body: bytes, load: _Load) -> None:
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    load.in_flight += 1
    try:
        async with client.stream("POST", url, content=body, headers=headers) as answer:
            async for _ in answer.aiter_bytes():
                pass
            load.statuses[str(answer.status_code)] += 1
            load.targets[answer.headers.get("x-gateway-target", "-")] += 1
    except httpx.HTTPError as exc:
        load.statuses[type(exc).__name__] += 1
    finally:
        load.in_flight -= 1


async def _drive(
    args: argparse.Namespace, gateway: str, admin: str, engines: tuple[str, str], result: RunResult, seed: int
) -> None:
    """Open-loop load until the rollout is terminal or the deadline passes; fills ``result``."""
    body = json.dumps(
        {
            "model": GROUP,
            "messages": [{"role": "user", "content": "Tell me about canaries."}],
            "max_tokens": MAX_TOKENS,
            "stream": True,
        }
    ).encode()
    url = f"{gateway}/v1/chat/completions"
    limits = httpx.Limits(max_connections=args.max_in_flight, max_keepalive_connections=args.max_in_flight)
    load = _Load()
    verdict_seen = asyncio.Event()
    rng = random.Random(seed)
    tasks: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()
    async with (
        httpx.AsyncClient(timeout=30, limits=limits) as client,
        httpx.AsyncClient(timeout=5) as operator,
    ):
        start = loop.time()
        wall_start = time.time()

        async def watch() -> None:
            headers = {"authorization": f"Bearer {ADMIN_KEY}"}
            while loop.time() < start + args.deadline_s:
                answer = await operator.get(f"{admin}/admin/rollout", headers=headers)
                answer.raise_for_status()
                rollout = answer.json()["rollouts"][0]
                state = rollout.get("state") or {}
                if state.get("status") in TERMINAL:
                    seen = loop.time()
                    sent = load.sent
                    candidate, baseline = await asyncio.gather(
                        _scrape(operator, engines[1]), _scrape(operator, engines[0])
                    )
                    result.verdict = str(state["status"])
                    result.seconds_to_verdict = seen - start
                    result.seconds_to_decision = float(state["updated_at"]) - wall_start
                    result.candidate_requests = engine_requests(candidate)
                    result.baseline_requests = engine_requests(baseline)
                    result.requests_before_verdict = sent
                    result.reason = str(state.get("reason", ""))
                    result.by = str(state.get("by", ""))
                    result.history = list(rollout.get("history", []))
                    verdict_seen.set()
                    return
                await asyncio.sleep(POLL_S)
            rollout = (await operator.get(f"{admin}/admin/rollout", headers=headers)).json()["rollouts"][0]
            state = rollout.get("state") or {}
            status = state.get("status", "unstarted")
            result.reason = f"still {status} after {args.deadline_s:g}s: {state.get('reason')}"
            result.history = list(rollout.get("history", []))
            result.requests_before_verdict = load.sent
            verdict_seen.set()

        watcher = loop.create_task(watch())
        next_at = start
        while not verdict_seen.is_set() and not watcher.done():
            delay = next_at - loop.time()
            if delay > 0:
                # Wake at the next arrival, or at once when the verdict is seen.
                try:
                    await asyncio.wait_for(verdict_seen.wait(), timeout=delay)
                    break
                except TimeoutError:
                    pass
            next_at += rng.expovariate(args.rate)
            if load.in_flight >= args.max_in_flight:
                load.skipped += 1
                continue
            task = loop.create_task(_one(client, url, body, load))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            load.sent += 1
        await watcher  # raises what the watcher raised
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=30)
            for task in pending:
                task.cancel()
    result.requests_sent = load.sent
    result.skipped = load.skipped
    result.statuses = dict(load.statuses)
    result.targets = dict(load.targets)


@contextmanager
def _fleet(scenario: Scenario, steps: Sequence[float], args: argparse.Namespace) -> Iterator[tuple[str, str, str, str]]:
    """Fresh engines and gateway for one run: (gateway URL, operator URL, baseline engine, candidate engine)."""
    taken: set[int] = set()
    base_port, cand_port, api_port, admin_port = (bench_port(taken) for _ in range(4))
    base, cand = f"http://127.0.0.1:{base_port}", f"http://127.0.0.1:{cand_port}"
    with ExitStack() as stack:
        for port, model, scale in (
            (base_port, "served-a", BASE_SCALE),
            (cand_port, "served-b", BASE_SCALE * scenario.scale_factor),
        ):
            argv = [*GATEWAY, "sim", "--profile", PROFILE, "--port", str(port), "--time-scale", repr(scale)]
            argv += ["--model", model]
            stack.enter_context(process(argv, f"http://127.0.0.1:{port}/health", timeout_s=READY_TIMEOUT_S))
        if scenario.fault is not None:
            answer = httpx.post(f"{cand}/admin/fault", json={"mode": scenario.fault}, timeout=5)
            answer.raise_for_status()
            if answer.json().get("mode") != scenario.fault:
                raise RuntimeError(f"the candidate engine did not take fault {scenario.fault}: {answer.text}")
        rollout_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="canary-rollout-"))
        text = policy_text(base, cand, steps=steps, interval_s=args.interval_s, min_requests=args.min_requests)
        path = stack.enter_context(policy_file(text))
        argv = [*GATEWAY, "serve", "--policy", str(path), "--port", str(api_port), "--admin-port", str(admin_port)]
        gateway, admin = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{admin_port}"
        env = _env(rollout_dir)
        stack.enter_context(process(argv, gateway + "/readyz", timeout_s=READY_TIMEOUT_S, env=env))
        _wait_healthy(admin, {"engine-a", "engine-b"})
        yield gateway, admin, base, cand


def _wait_healthy(admin: str, names: set[str]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            samples = _parse(httpx.get(admin + "/metrics", timeout=2).text)
        except httpx.HTTPError:
            samples = {}
        healthy = labelled(samples, "gateway_backend_healthy")
        if {dict(labels)["backend"] for labels, value in healthy.items() if value == 1} >= names:
            return
        time.sleep(POLL_S)
    raise RuntimeError(f"the gateway did not see {sorted(names)} healthy within {READY_TIMEOUT_S:g}s")


def run_once(scenario: Scenario, steps: Sequence[float], repeat: int, args: argparse.Namespace) -> RunResult:
    result = RunResult(scenario.name, list(steps), repeat, scenario.expect)
    try:
        with _fleet(scenario, steps, args) as (gateway, admin, base, cand):
            seed = args.seed + repeat + 1000 * list(SCENARIOS).index(scenario.name)
            asyncio.run(_drive(args, gateway, admin, (base, cand), result, seed))
    except Exception as exc:  # a run that could not start or be watched is recorded, not fatal
        result.error = f"{type(exc).__name__}: {exc}"[:2000]
        result.verdict = "error"
    return result


# -- the whole bench ------------------------------------------------------------------------------


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _line(run: RunResult) -> str:
    if run.error:
        return f"{run.scenario:<8} [{steps_label(run.steps)}] #{run.repeat}: error {run.error}"
    secs = "-" if run.seconds_to_verdict is None else f"{run.seconds_to_verdict:.1f}s"
    cand = "-" if run.candidate_requests is None else f"{run.candidate_requests:.0f}"
    flag = " WRONG" if run.wrong else ""
    return (
        f"{run.scenario:<8} [{steps_label(run.steps)}] #{run.repeat}: {run.verdict}{flag} after {secs}, "
        f"{cand} to the candidate of {run.requests_before_verdict} sent; {run.reason}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "loadtests.proofs.canary", *(sys.argv[1:] if argv is None else argv)])
    started = datetime.datetime.now(datetime.UTC)
    load_before = _uptime()
    print(f"{command}\n{started:%Y-%m-%d %H:%M:%S} UTC; before: {load_before}", flush=True)
    runs: list[RunResult] = []
    for steps in args.steps:
        for repeat in range(args.repeats):
            for name in args.scenarios:  # interleaved, so that machine noise falls on every scenario
                run = run_once(SCENARIOS[name], steps, repeat, args)
                runs.append(run)
                print(_line(run), flush=True)
    load_after = _uptime()
    summary = summarize(runs)
    table = format_table(summary)
    finished = datetime.datetime.now(datetime.UTC)
    wrong = sum(r.wrong for r in runs)
    report: dict[str, Any] = {
        "command": command,
        "started": started.isoformat(timespec="seconds"),
        "finished": finished.isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "uptime_before": load_before, "uptime_after": load_after},
        "settings": {
            "profile": PROFILE,
            "baseline_time_scale": BASE_SCALE,
            "rate": args.rate,
            "interval_s": args.interval_s,
            "min_requests": args.min_requests,
            "max_tokens": MAX_TOKENS,
            "max_in_flight": args.max_in_flight,
            "deadline_s": args.deadline_s,
            "repeats": args.repeats,
            "steps": [list(s) for s in args.steps],
            "scenarios": {n: asdict(SCENARIOS[n]) for n in args.scenarios},
        },
        "summary": summary,
        "wrong_verdicts": wrong,
        "runs": [{**asdict(r), "wrong": r.wrong} for r in runs],
    }
    text = "\n".join(
        [
            f"canary bench: {command}",
            f"date: {started:%Y-%m-%d %H:%M} - {finished:%H:%M} UTC; {os.cpu_count()} CPUs",
            f"before: {load_before}",
            f"after:  {load_after}",
            f"profile {PROFILE}, baseline time scale {BASE_SCALE:g}; {args.rate:g} req/s Poisson, streams of "
            f"{MAX_TOKENS} tokens, <= {args.max_in_flight} in flight; interval_s {args.interval_s:g}, "
            f"min_requests {args.min_requests}; deadline {args.deadline_s:g}s; {args.repeats} runs each",
            "time to verdict: first request -> the 50 ms poll of GET /admin/rollout that saw it; candidate "
            "reqs: the candidate engine's own count then; wrong: healthy rolled back or bad promoted; "
            "none: no verdict by the deadline (or an error)",
            "",
            table,
            "",
            f"wrong verdicts: {wrong} of {len(runs)} runs",
            "",
        ]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "canary.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "canary.txt").write_text(text)
    print("\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
