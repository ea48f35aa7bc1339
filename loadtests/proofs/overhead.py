"""What the gateway adds to latency, measured against the same backend directly, in one run.

Usage::

    python -m loadtests.proofs.overhead [--rates 100,250,500,1000] [--phase-s 4] [--rounds 2]
                                 [--stream-rates 100,400] [--stream-tokens 64] [--router] [--fleet]
                                 [--out loadtests/results/overhead] [--previous REF]

It starts a zero-delay simulated engine (profile ``instant``) and the gateway in front of it,
each as its own process, the gateway pinned alone to one core (the backend and this load
generator share the other). For each rate it sends the same open-loop Poisson load
alternately straight to the backend and through the gateway, in short phases, several
rounds, so that both see the same machine noise; the figures are differences between the
two in the same run: added latency at P50 and P99 per rate, errors, and for streams the
added TTFT and inter-token latency. Goals of the foundation issue: at 500 req/s added P50
<= 1 ms and P99 <= 5 ms with no errors; 1,000 req/s without errors; at 100 streams/s of 64
tokens, added TTFT P50 <= 1 ms and added inter-token P99 <= 1 ms.

``--router`` adds vLLM's Rust router (``pip install vllm-router``; cache-aware policy, pinned
to the gateway's core) in front of the same backend: its added latency and CPU per request
beside the gateway's, and the ratio of their CPU per request (issue 14: at most 1.5x).
``--stream-rates 100,400`` measures streams at each rate, with CPU per relayed chunk;
``--stream-itl-ms 10`` sends them to a second engine (the ``fixed`` profile, model
``sim-paced``) that emits one token every 10 ms, so that each token is a chunk of its own as
from a real engine (the instant engine's tokens arrive together and are relayed in a few
writes); the router gets a second instance for it. The bench tenant has limits far above the
load, so the limiter runs on every request.

``--previous REF`` adds a fourth mode: the gateway as it was at git revision ``REF`` (checked
out into a temporary folder and run from there, on the same core, with the same policy),
alternating with the others, so that a change is measured against what it replaces in the
same run (``previous`` rows: its added latency and CPU per request beside the current one's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from gateway.request.keys import hash_api_key
from loadtests.harness.processes import GATEWAY, admin_args, checkout, cpu_seconds, pin, policy_file, process

MODEL = "sim-instant"
API_KEY = "overhead-bench-key"
CHAT_BODY = {
    "model": MODEL,
    "max_tokens": 16,
    "messages": [{"role": "user", "content": "Say something short about latency budgets."}],
}


@dataclass
class PhaseResult:
    """Latencies of one mode at one rate (seconds), accumulated over rounds."""

    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    errors: int = 0
    error_reasons: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    cpu_s: float = 0.0
    late: list[float] = field(default_factory=list)


PACED_MODEL = "sim-paced"
"""The model of the paced engine (``--stream-itl-ms``): tokens one at a time, as a real engine sends them."""


def _policy(
    backend_url: str, *, fleet: bool = False, paced_url: str | None = None, tokenizer: str | None = None
) -> str:
    """The bench's policy; ``fleet`` shares the state (and the capacity) through the local Redis;
    ``tokenizer`` (a ``tokenizer.json``) counts the bench model's prompts with it, not the estimate."""
    counted = f', tokenizer: {{path: "{Path(tokenizer).resolve()}"}}' if tokenizer else ""
    shared = (
        f'state: {{backend: redis, redis_url: "redis://127.0.0.1:6379/0", key_prefix: "overhead-{os.getpid()}:"}}'
        if fleet
        else ""
    )
    return f"""{shared}
version: overhead-bench
limits: {{max_body_bytes: 1048576}}
classes:
  interactive: {{rank: 0, slo: {{ttft_ms: 500, itl_ms: 30, e2e_ms: 60000}}}}
models:
  - {{name: {MODEL}, max_prompt_tokens: 8192, max_output_tokens: 4096{counted}}}
  - {{name: {PACED_MODEL}, max_prompt_tokens: 8192, max_output_tokens: 4096}}
backends:
  - {{name: instant, url: "{backend_url}", kind: sim, models: [{MODEL}],
      capacity: {{max_concurrent: 100000, max_tokens_in_flight: 100000000}}}}
  - {{name: paced, url: "{paced_url or backend_url}", kind: sim, models: [{PACED_MODEL}],
      capacity: {{max_concurrent: 100000, max_tokens_in_flight: 100000000}}}}
tenants:
  - name: bench
    key_hashes: ["{hash_api_key(API_KEY)}"]
    models: ["*"]
    default_class: interactive
    # Limits far above the bench's load: the limiter runs on every request (every feature on).
    limits: {{rpm: 100000000, tpm: 100000000000, max_concurrent: 1000000}}
health_checks: {{interval_s: 30, timeout_s: 2}}
"""


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str], stream: bool, out: PhaseResult
) -> None:
    start = time.perf_counter()
    reason = ""
    try:
        async with session.post(url, data=body, headers=headers) as response:
            if response.status != 200:
                reason = f"HTTP {response.status}"
            elif not stream:
                await response.read()
            elif not await _read_stream(response, start, out):
                reason = "stream ended without output or [DONE]"
    except aiohttp.ClientError as exc:
        reason = type(exc).__name__
    if not reason:
        out.latencies.append(time.perf_counter() - start)
    else:
        out.errors += 1
        out.error_reasons[reason] += 1


async def _read_stream(response: aiohttp.ClientResponse, start: float, out: PhaseResult) -> bool:
    first: float | None = None
    last = 0.0
    done = False
    async for line in response.content:
        if not line.startswith(b"data: "):
            continue
        if line.startswith(b"data: [DONE]"):
            done = True
            continue
        if b'"content":"' not in line or b'"content":""' in line:
            continue
        now = time.perf_counter()
        if first is None:
            first = now
            out.ttfts.append(now - start)
        else:
            out.itls.append(now - last)
        last = now
    return done and first is not None


async def _phase(
    session: aiohttp.ClientSession, url: str, rate: float, seconds: float, stream: bool, out: PhaseResult, seed: int
) -> None:
    """Open-loop Poisson arrivals at ``rate`` for ``seconds``; never waits for a response to send."""
    body = dict(CHAT_BODY)
    if PROMPT_CHARS[0]:
        words = " ".join(f"latency{i}" for i in range(PROMPT_CHARS[0] // 9 + 1))[: PROMPT_CHARS[0]]
        body["messages"] = [{"role": "user", "content": words}]
    if stream:
        body = {**body, "stream": True, "max_tokens": STREAM_TOKENS[0]}
        if PACED[0]:
            body["model"] = PACED_MODEL
    payload = json.dumps(body).encode()
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    rng = random.Random(seed)
    tasks: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()
    start = loop.time()
    next_at = start
    while next_at < start + seconds:
        delay = next_at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        out.late.append(max(0.0, loop.time() - next_at))
        task = loop.create_task(_one(session, url, payload, headers, stream, out))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        out.sent += 1
        next_at += rng.expovariate(rate)
    if tasks:
        await asyncio.wait(tasks, timeout=30)


STREAM_TOKENS = [64]
PROMPT_CHARS = [0]
"""Set from ``--prompt-chars`` (0: the short ``CHAT_BODY`` prompt)."""
PACED = [False]
"""Set by ``--stream-itl-ms``: streams go to the paced engine's model."""


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


async def _alternate(
    session: aiohttp.ClientSession,
    modes: list[tuple[str, str, int | None]],
    rate: float,
    stream: bool,
    results: dict[str, PhaseResult],
    args: argparse.Namespace,
) -> None:
    """``--rounds`` rounds of one phase per mode in turn, each mode's process CPU counted over its phases."""
    for round_no in range(args.rounds):
        for mode, url, pid in modes:
            before = cpu_seconds(pid) if pid else 0.0
            await _phase(session, url, rate, args.phase_s, stream, results[mode], seed=round_no)
            results[mode].cpu_s += cpu_seconds(pid) - before if pid else 0.0


async def _run(args: argparse.Namespace, direct: str, through: str) -> dict[str, object]:
    # Bounded: an arm that saturates at a high rate would otherwise hold a socket per late request
    # until the process runs out of files (at 2,000 req/s for 10 s, 20,000 of them).
    connector = aiohttp.TCPConnector(limit=8000, keepalive_timeout=60)
    report: dict[str, object] = {"rates": {}, "stream": {}, "streams": {}}
    async with aiohttp.ClientSession(connector=connector) as session:
        await _phase(session, direct, 50, 1.0, False, PhaseResult(), 0)  # warm both paths
        await _phase(session, through, 50, 1.0, False, PhaseResult(), 0)
        for rate in args.rates:
            results = {"direct": PhaseResult(), "gateway": PhaseResult(), "minimal": PhaseResult()}
            modes = [
                ("direct", direct, None),
                ("gateway", through, args.gateway_pid),
                ("minimal", args.minimal, args.minimal_pid),
            ]
            for label, url, pid in args.extra_arms:
                results[label] = PhaseResult()
                modes.append((label, url, pid))
            await _alternate(session, modes, rate, False, results, args)
            report["rates"][rate] = _compare(results)  # type: ignore[index]
            _print_rate(rate, results)
        for stream_rate in args.stream_rates:
            results = {"direct": PhaseResult(), "gateway": PhaseResult()}
            stream_direct = args.paced_direct or direct
            stream_modes = [("direct", stream_direct, None), ("gateway", through, args.gateway_pid)]
            for label, url, pid in args.extra_arms:
                if label.startswith("minimal_"):  # their upstream is the instant engine only
                    continue
                url, pid = args.stream_urls.get(label, (url, pid))
                results[label] = PhaseResult()
                stream_modes.append((label, url, pid))
            await _alternate(session, stream_modes, stream_rate, True, results, args)
            compared = _compare(results)
            for figures in compared.values():  # per relayed chunk: what a stream costs per token
                if isinstance(figures, dict) and figures.get("gateway_cpu_ms_per_request") is not None:
                    figures["cpu_us_per_chunk"] = 1000 * figures["gateway_cpu_ms_per_request"] / STREAM_TOKENS[0]
            report["streams"][stream_rate] = compared  # type: ignore[index]
            if stream_rate == args.stream_rates[0]:
                report["stream"] = compared  # the first rate, where earlier reports kept it
            _print_stream(stream_rate, results)
    return report


def _compare(results: dict[str, PhaseResult]) -> dict[str, object]:
    d, g = results["direct"], results["gateway"]
    out: dict[str, object] = {}
    for mode, r in results.items():
        out[mode] = {
            "sent": r.sent,
            "errors": r.errors,
            "p50_ms": _pct(r.latencies, 50),
            "p99_ms": _pct(r.latencies, 99),
            "ttft_p50_ms": _pct(r.ttfts, 50),
            "ttft_p99_ms": _pct(r.ttfts, 99),
            "itl_p99_ms": _pct(r.itls, 99),
            "send_late_p99_ms": _pct(r.late, 99),
            "error_reasons": dict(r.error_reasons),
            "gateway_cpu_ms_per_request": r.cpu_s * 1000 / r.sent if r.sent else None,
        }
    if "minimal" in results:
        mini = results["minimal"]
        out["minimal_added_p50_ms"] = _pct(mini.latencies, 50) - _pct(d.latencies, 50)
        out["minimal_added_p99_ms"] = _pct(mini.latencies, 99) - _pct(d.latencies, 99)
    for label in EXTRA_ARMS:
        if label in results:
            arm = results[label]
            out[f"{label}_added_p50_ms"] = _pct(arm.latencies, 50) - _pct(d.latencies, 50)
            out[f"{label}_added_p99_ms"] = _pct(arm.latencies, 99) - _pct(d.latencies, 99)
            out[f"{label}_added_ttft_p50_ms"] = _pct(arm.ttfts, 50) - _pct(d.ttfts, 50)
            out[f"{label}_added_ttft_p99_ms"] = _pct(arm.ttfts, 99) - _pct(d.ttfts, 99)
            out[f"{label}_added_itl_p99_ms"] = _pct(arm.itls, 99) - _pct(d.itls, 99)
    if "fleet" in results and results["fleet"].sent and g.sent and g.cpu_s:
        f = results["fleet"]
        ratio = (f.cpu_s / f.sent) / (g.cpu_s / g.sent)
        extra = _pct(f.latencies or f.ttfts, 50) - _pct(g.latencies or g.ttfts, 50)
        out["fleet_goal"] = {  # issue 13, proof 4: the cost of coordination
            "cpu_per_request_vs_gateway": ratio,
            "added_p50_ms_vs_gateway": extra,
            "goal": "CPU per request <= 1.15 x, P50 <= +0.3 ms",
            "met": ratio <= 1.15 and extra <= 0.3,
        }
    if "router" in results and results["router"].sent and g.sent and results["router"].cpu_s:
        r = results["router"]
        out["vs_router"] = {  # issue 14: this gateway's CPU per request against vLLM's Rust router's
            "cpu_per_request_ratio": (g.cpu_s / g.sent) / (r.cpu_s / r.sent),
            "goal": "<= 1.5",
        }
    out["added_p50_ms"] = _pct(g.latencies, 50) - _pct(d.latencies, 50)
    out["added_p99_ms"] = _pct(g.latencies, 99) - _pct(d.latencies, 99)
    out["added_ttft_p50_ms"] = _pct(g.ttfts, 50) - _pct(d.ttfts, 50)
    out["added_ttft_p99_ms"] = _pct(g.ttfts, 99) - _pct(d.ttfts, 99)
    out["added_itl_p99_ms"] = _pct(g.itls, 99) - _pct(d.itls, 99)
    return out


def _print_rate(rate: float, results: dict[str, PhaseResult]) -> None:
    d, g, mini = results["direct"], results["gateway"], results["minimal"]
    print(
        f"{rate:>6.0f} req/s | direct P50 {_pct(d.latencies, 50):6.2f} P99 {_pct(d.latencies, 99):6.2f} "
        f"err {d.errors:<4d}| gateway P50 {_pct(g.latencies, 50):6.2f} P99 {_pct(g.latencies, 99):6.2f} "
        f"err {g.errors:<4d}| added P50 {_pct(g.latencies, 50) - _pct(d.latencies, 50):+6.2f} ms "
        f"P99 {_pct(g.latencies, 99) - _pct(d.latencies, 99):+6.2f} ms | sent {d.sent}/{g.sent} "
        f"| send lateness P99 {_pct(d.late + g.late, 99):.2f} ms | gateway CPU "
        f"{g.cpu_s * 1000 / max(g.sent, 1):.2f} ms/req {dict(d.error_reasons + g.error_reasons) or ''}",
        flush=True,
    )
    print(
        f"{'':>6} minimal proxy, httpx     | P50 {_pct(mini.latencies, 50):6.2f} P99 {_pct(mini.latencies, 99):6.2f} "
        f"err {mini.errors:<4d}| added P50 {_pct(mini.latencies, 50) - _pct(d.latencies, 50):+6.2f} ms "
        f"P99 {_pct(mini.latencies, 99) - _pct(d.latencies, 99):+6.2f} ms "
        f"| CPU {mini.cpu_s * 1000 / max(mini.sent, 1):.2f} ms/req",
        flush=True,
    )
    _print_previous(results)


EXTRA_ARMS = {
    "minimal_aiohttp": "minimal proxy, aiohttp",
    "minimal_wire": "minimal proxy, wire",
    "previous": "previous revision",
    "fleet": "with fleet (Redis)",
    "router": "vLLM's Rust router",
}
"""Arms beside the gateway: the minimal proxy on aiohttp's own client and on the gateway's
data-plane client (always: the floors of the client choice), an older revision
(``--previous``), the same gateway with its capacity coordinated through Redis (``--fleet``),
vLLM's Rust router (``--router``, the ``vllm-router`` wheel from PyPI, cache-aware policy,
pinned to the gateway's core)."""


def _print_previous(results: dict[str, PhaseResult]) -> None:
    for label, title in EXTRA_ARMS.items():
        if label in results:
            _print_arm(title, results["direct"], results[label])
    compared = _compare(results)
    versus = compared.get("vs_router")
    if isinstance(versus, dict):
        print(
            f"{'':>6} gateway vs vLLM's Rust router: CPU per request x{versus['cpu_per_request_ratio']:.2f} "
            f"(goal {versus['goal']})",
            flush=True,
        )
    goal = compared.get("fleet_goal")
    if isinstance(goal, dict):
        print(
            f"{'':>6} fleet vs gateway: CPU per request x{goal['cpu_per_request_vs_gateway']:.3f}, "
            f"P50 {goal['added_p50_ms_vs_gateway']:+.2f} ms ({goal['goal']}: {'met' if goal['met'] else 'MISSED'})",
            flush=True,
        )


def _print_arm(title: str, d: PhaseResult, p: PhaseResult) -> None:
    print(
        f"{'':>6} {title:<24} | P50 {_pct(p.latencies, 50):6.2f} P99 {_pct(p.latencies, 99):6.2f} "
        f"err {p.errors:<4d}| added P50 {_pct(p.latencies, 50) - _pct(d.latencies, 50):+6.2f} ms "
        f"P99 {_pct(p.latencies, 99) - _pct(d.latencies, 99):+6.2f} ms "
        f"| TTFT P50 added {_pct(p.ttfts, 50) - _pct(d.ttfts, 50):+.2f} ms, "
        f"P99 {_pct(p.ttfts, 99) - _pct(d.ttfts, 99):+.2f} ms "
        f"| CPU {p.cpu_s * 1000 / max(p.sent, 1):.2f} ms/req {dict(p.error_reasons) or ''}",
        flush=True,
    )


def _print_stream(rate: float, results: dict[str, PhaseResult]) -> None:
    d, g = results["direct"], results["gateway"]
    print(
        f"{rate:>6.0f} streams/s x {STREAM_TOKENS[0]} tokens | TTFT P50 direct {_pct(d.ttfts, 50):.2f} "
        f"gateway {_pct(g.ttfts, 50):.2f} added {_pct(g.ttfts, 50) - _pct(d.ttfts, 50):+.2f} ms, "
        f"TTFT P99 direct {_pct(d.ttfts, 99):.2f} gateway {_pct(g.ttfts, 99):.2f} "
        f"added {_pct(g.ttfts, 99) - _pct(d.ttfts, 99):+.2f} ms | "
        f"ITL P99 direct {_pct(d.itls, 99):.3f} gateway {_pct(g.itls, 99):.3f} "
        f"added {_pct(g.itls, 99) - _pct(d.itls, 99):+.3f} ms | errors {d.errors}/{g.errors} "
        f"| gateway CPU {g.cpu_s * 1000 / max(g.sent, 1):.2f} ms/stream "
        f"({g.cpu_s * 1e6 / max(g.sent, 1) / STREAM_TOKENS[0]:.1f} us/chunk) "
        f"{dict(d.error_reasons + g.error_reasons) or ''}",
        flush=True,
    )
    _print_previous(results)


def _router_executable() -> str:
    """``vllm-router`` beside this interpreter (the venv's), else on the PATH."""
    beside = Path(sys.executable).with_name("vllm-router")
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        raise SystemExit("--router needs vLLM's router: pip install vllm-router (into this environment)")
    return found


def _serve_at(tree: Path, policy: str, port: int) -> list[str]:
    """``serve`` from the checkout ``tree``; its operator listener moved aside when it has one."""
    argv = [sys.executable, "-m", "gateway", "serve", "--policy", policy, "--port", str(port)]
    return argv + admin_args(port) if (tree / "gateway" / "server.py").exists() else argv


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rates", default="100,250,500,1000")
    parser.add_argument("--phase-s", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--stream-rates", default="100", help="streams per second, comma-separated (e.g. 100,400)")
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument(
        "--stream-itl-ms",
        type=float,
        default=0.0,
        help="streams from a second engine that sends one token every this many ms (the fixed profile), "
        "so that every token is a chunk of its own as from a real engine (0: the instant engine, whose "
        "tokens arrive together)",
    )
    parser.add_argument(
        "--prompt-chars",
        type=int,
        default=0,
        help="a prompt of this many characters instead of the short one (~4 per token): with 256 or more, "
        "prefix routing hashes full blocks and the fleet arm publishes every decision to its prefix view",
    )
    parser.add_argument("--backend-port", type=int, default=18501)
    parser.add_argument("--gateway-port", type=int, default=18500)
    parser.add_argument("--gateway-cmd", default=None, help="override the gateway command (profiling)")
    parser.add_argument("--out", default=None, help="write the figures as JSON to OUT.json")
    parser.add_argument("--previous", default=None, metavar="REF", help="also run the gateway of git revision REF")
    parser.add_argument(
        "--router",
        action="store_true",
        help="also run vLLM's Rust router (pip install vllm-router) in front of the same backend, pinned alike",
    )
    parser.add_argument(
        "--fleet", action="store_true", help="also run the gateway with its capacity coordinated through Redis"
    )
    parser.add_argument(
        "--current", default=None, metavar="REF", help="run the gateway of git revision REF instead of this tree's"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="count the bench model's prompts with this tokenizer.json (the CPU a request costs with a tokenizer; "
        "a --previous or --current revision before tokenizers refuses the policy)",
    )
    args = parser.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",") if r]
    args.stream_rates = [float(r) for r in args.stream_rates.split(",") if r]
    STREAM_TOKENS[0] = args.stream_tokens
    PROMPT_CHARS[0] = args.prompt_chars
    PACED[0] = args.stream_itl_ms > 0
    paced = f"http://127.0.0.1:{args.backend_port + 10}" if PACED[0] else None
    args.paced_direct = paced + "/v1/chat/completions" if paced else None
    args.stream_urls = {}
    # One cache-salt secret for every gateway of the run, as replicas must have (the fleet arm's
    # prefix view is off without one: README, "One prefix view for the fleet").
    os.environ.setdefault("GATEWAY_CACHE_SALT_SECRET", "overhead-bench-secret")
    backend = f"http://127.0.0.1:{args.backend_port}"
    gateway = f"http://127.0.0.1:{args.gateway_port}"
    exe = [sys.executable, "-m", "gateway"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as policy:
        policy.write(_policy(backend, paced_url=paced, tokenizer=args.tokenizer))
    sim = [*pin(0), *exe, "sim", "--profile", "instant", "--model", MODEL, "--port", str(args.backend_port)]
    serve = [*pin(1), *exe, "serve", "--policy", policy.name, "--port", str(args.gateway_port)]
    if args.gateway_cmd:
        serve = [*pin(1), *args.gateway_cmd.split(), "--policy", policy.name, "--port", str(args.gateway_port)]
    serve += admin_args(args.gateway_port)
    if len(pin(0)):
        os.sched_setaffinity(0, {0})
    minimal_port = args.gateway_port + 2
    minimal = [
        *pin(1),
        sys.executable,
        "-m",
        "loadtests.harness.minimal_proxy",
        "--upstream",
        backend,
        "--port",
        str(minimal_port),
    ]
    minimal_url = f"http://127.0.0.1:{minimal_port}"
    # The same minimal proxy on aiohttp's client called directly, and on the gateway's own data-plane
    # client (gateway/upstream/wire.py): the client choice, measured against httpx-over-aiohttp in the same
    # run (issue 14).
    leans = {
        label: ([*minimal[:-2], "--port", str(args.gateway_port + offset), "--client", client], offset)
        for label, client, offset in (("minimal_aiohttp", "aiohttp", 7), ("minimal_wire", "wire", 8))
    }
    with contextlib.ExitStack() as stack:
        stack.enter_context(process(sim, backend + "/health"))
        if paced:
            paced_sim = [*pin(0), *exe, "sim", "--profile", "fixed", "--model", PACED_MODEL, "--ttft-ms", "0"]
            paced_sim += ["--itl-ms", str(args.stream_itl_ms), "--port", str(args.backend_port + 10)]
            stack.enter_context(process(paced_sim, paced + "/health"))
        if args.current:
            current = stack.enter_context(checkout(args.current))
            serve = [*pin(1), *_serve_at(current, policy.name, args.gateway_port)]
            env = {**os.environ, "PYTHONPATH": str(current)}
            gateway_proc = stack.enter_context(process(serve, gateway + "/healthz", env=env, cwd=current))
        else:
            gateway_proc = stack.enter_context(process(serve, gateway + "/healthz"))
        minimal_proc = stack.enter_context(process(minimal, minimal_url + "/healthz"))
        args.gateway_pid, args.minimal_pid = gateway_proc.pid, minimal_proc.pid
        args.minimal = minimal_url + "/v1/chat/completions"
        args.extra_arms = []
        for label, (argv_lean, offset) in leans.items():
            lean_url = f"http://127.0.0.1:{args.gateway_port + offset}"
            lean_proc = stack.enter_context(process(argv_lean, lean_url + "/healthz"))
            args.extra_arms.append((label, lean_url + "/v1/chat/completions", lean_proc.pid))
        if args.previous:
            previous_port = args.gateway_port + 3
            previous_url = f"http://127.0.0.1:{previous_port}"
            folder = stack.enter_context(checkout(args.previous))
            old = [*pin(1), *_serve_at(folder, policy.name, previous_port)]
            env = {**os.environ, "PYTHONPATH": str(folder)}
            previous_proc = stack.enter_context(process(old, previous_url + "/healthz", env=env, cwd=folder))
            args.extra_arms.append(("previous", previous_url + "/v1/chat/completions", previous_proc.pid))
        if args.fleet:
            fleet_port = args.gateway_port + 4
            fleet_url = f"http://127.0.0.1:{fleet_port}"
            fleet_policy = stack.enter_context(policy_file(_policy(backend, fleet=True, tokenizer=args.tokenizer)))
            serve_fleet = [*pin(1), *GATEWAY, "serve", "--policy", str(fleet_policy), "--port", str(fleet_port)]
            fleet_proc = stack.enter_context(process([*serve_fleet, *admin_args(fleet_port)], fleet_url + "/healthz"))
            args.extra_arms.append(("fleet", fleet_url + "/v1/chat/completions", fleet_proc.pid))
        if args.router:
            router_port = args.gateway_port + 5
            router_url = f"http://127.0.0.1:{router_port}"
            router = [*pin(1), _router_executable(), "--worker-urls", backend, "--port", str(router_port)]
            router += ["--policy", "cache_aware", "--log-level", "warning", "--prometheus-port", str(router_port + 10)]
            router_proc = stack.enter_context(process(router, router_url + "/health"))
            args.extra_arms.append(("router", router_url + "/v1/chat/completions", router_proc.pid))
            if paced:  # the router serves one pool: a second one, pinned alike, for the paced engine
                paced_port = args.gateway_port + 6
                paced_router = [*pin(1), _router_executable(), "--worker-urls", paced, "--port", str(paced_port)]
                paced_router += ["--policy", "cache_aware", "--log-level", "warning"]
                paced_router += ["--prometheus-port", str(paced_port + 10)]
                paced_proc = stack.enter_context(process(paced_router, f"http://127.0.0.1:{paced_port}/health"))
                args.stream_urls["router"] = (f"http://127.0.0.1:{paced_port}/v1/chat/completions", paced_proc.pid)
        print(
            f"overhead benchmark: backend {backend} (instant), gateway {gateway}; "
            f"phases of {args.phase_s}s x {args.rounds} rounds per mode, alternating; "
            + (f"gateway of revision {args.current}; " if args.current else "")
            + f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}"
            + (f"; previous revision {args.previous}" if args.previous else ""),
            flush=True,
        )
        report = asyncio.run(_run(args, backend + "/v1/chat/completions", gateway + "/v1/chat/completions"))
    report["load_average"] = list(os.getloadavg())
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
    os.unlink(policy.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
