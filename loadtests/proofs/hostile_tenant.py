"""What a tenant sending large invalid bodies does to another tenant's latency, in one run.

Usage::

    python -m loadtests.proofs.hostile_tenant [--victim-rate 20] [--abuser-rate 12] [--phase-s 5] [--rounds 3]
                                       [--shapes many_messages,tiny_parts,deep_nesting,many_numbers,many_keys]
                                       [--versus plain] [--abuser-rpm 100000] [--gateway-pythonpath DIR] [--out FILE]

    # does any body shape cost the victim more than a plain body of the same size? (issue 27)
    python -m loadtests.proofs.hostile_tenant --versus plain --shapes escaped_spaced,duplicate_key --abuser-rate 30

A zero-delay simulated engine (profile ``instant``) and the gateway, each its own process, the
gateway pinned alone to one core. The victim tenant sends small chat requests, open-loop
Poisson at ``--victim-rate``; in alternate phases ("alone", "attacked") the abuser tenant also
sends ``--abuser-rate`` bodies a second of about 900 KiB each, every one invalid (``n: 0``, or
refused for its structure first), rotating through ``--shapes``, from a client process of its
own (so that sending them costs the victim's client nothing). Reported: the victim's P50,
P95 and P99 in each mode and their ratio attacked/alone, the abuser's answers, the gateway's
CPU per abuser request (the CPU of attacked phases less that of alone phases), and the
machine's load average at start and end (the machine is shared: read the ratio, not the
absolute figures). The abuser's ``rpm`` is high by default, so the figure is the CPU bound
per request, not the rate limit; lower it to see invalid requests charged to its rate.

With ``--versus SHAPE`` every shape (and ``SHAPE``) gets attacked phases of its own, in an
order rotated each round, and the report adds each shape's victim P99 over ``SHAPE``'s: the cost
a body's *shape* adds to what its size costs. ``plain`` is a compact body of 400 long messages
that passes every structural bound (refused after parsing, for ``n: 0``); ``escaped_spaced``
is the same document spaced as ``json.dumps`` writes it, its text holding an escaped backslash
before ``u003a`` (which once sent every such body through a second, hooked parse: 16 ms of CPU);
``duplicate_key`` is the plain body with its last key repeated. Every shape is one size.

``--gateway-pythonpath`` runs the gateway from another source tree (a checkout of an older
commit), for a before/after in the same conditions. Ports are free ones, probed at start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing import Queue
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

from gateway.request.keys import hash_api_key
from loadtests.harness.processes import cpu_seconds, free_port, pin, policy_file, process

MODEL = "sim-instant"
VICTIM_KEY, ABUSER_KEY = "victim-bench-key", "abuser-bench-key"
VICTIM_BODY = orjson.dumps(
    {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "A short question about latency."}]}
)
TARGET_BYTES = 900 * 1024


def hostile_body(shape: str) -> bytes:
    """About 900 KiB of ``shape``, invalid (``n: 0``) even when its structure passes."""
    body: dict[str, Any] = {"model": MODEL, "n": 0, "messages": [{"role": "user", "content": "x"}]}
    if shape == "many_messages":
        body["messages"] = [{"role": "user", "content": "hi"}] * (TARGET_BYTES // 31)
    elif shape == "tiny_parts":
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "a"}] * (TARGET_BYTES // 27)}]
    elif shape == "deep_nesting":
        node: Any = 1
        for _ in range(28):
            node = [node]
        body["tools"] = [node] * (TARGET_BYTES // 59)
    elif shape == "many_numbers":
        body["logit_bias"] = [1] * (TARGET_BYTES // 2)
    elif shape == "many_keys":
        body.update({f"k{i}": 1 for i in range(TARGET_BYTES // 10)})
    elif shape == "giant_string":
        body["messages"] = [{"role": "user", "content": "x" * TARGET_BYTES}]
    elif shape in ("plain", "escaped_spaced", "duplicate_key"):
        return _same_document(shape)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return orjson.dumps(body)


def _same_document(shape: str) -> bytes:
    """One document of 400 messages (within every structural bound), written as ``shape`` says."""
    clause = (
        "Clause 12\\u003a the parties agree that "
        if shape == "escaped_spaced"
        else "Clause 12: the parties agree that "
    )
    per_message = TARGET_BYTES // 400 - 40
    if shape == "escaped_spaced":  # an escaped backslash before u003a in each clause; the same body size
        per_message = per_message * 374 // 400
    text = (clause * 64)[:per_message]
    body = {"model": MODEL, "n": 0, "messages": [{"role": "user", "content": text}] * 400}
    if shape == "escaped_spaced":
        return json.dumps(body).encode()  # ", " and ": " separators, as requests and json.dumps send
    raw = orjson.dumps(body)
    return raw[:-1] + b',"n":0}' if shape == "duplicate_key" else raw


def policy(backend_url: str, abuser_rpm: int) -> str:
    return f"""
version: hostile-tenant-bench
limits: {{max_body_bytes: 1048576}}
classes:
  interactive: {{rank: 0, slo: {{ttft_ms: 500, itl_ms: 30, e2e_ms: 60000}}}}
models:
  - {{name: {MODEL}, max_prompt_tokens: 8192, max_output_tokens: 4096}}
backends:
  - {{name: instant, url: "{backend_url}", kind: sim, models: [{MODEL}],
      capacity: {{max_concurrent: 100000, max_tokens_in_flight: 100000000}}}}
tenants:
  - {{name: victim, key_hashes: ["{hash_api_key(VICTIM_KEY)}"], models: ["*"], default_class: interactive}}
  - {{name: abuser, key_hashes: ["{hash_api_key(ABUSER_KEY)}"], models: ["*"], default_class: interactive,
      limits: {{rpm: {abuser_rpm}}}}}
health_checks: {{interval_s: 30, timeout_s: 2}}
"""


@dataclass
class Mode:
    """One mode's figures, accumulated over rounds."""

    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    abuser: Counter[str] = field(default_factory=Counter)
    abuser_sent: int = 0
    cpu_s: float = 0.0
    seconds: float = 0.0


async def _victim(session: aiohttp.ClientSession, url: str, mode: Mode) -> None:
    started = time.perf_counter()
    try:
        async with session.post(url, data=VICTIM_BODY, headers=_headers(VICTIM_KEY)) as response:
            await response.read()
            if response.status != 200:
                mode.errors[f"HTTP {response.status}"] += 1
                return
    except aiohttp.ClientError as exc:
        mode.errors[type(exc).__name__] += 1
        return
    mode.latencies.append(time.perf_counter() - started)


async def _abuser(session: aiohttp.ClientSession, url: str, body: bytes, mode: Mode) -> None:
    try:
        async with session.post(url, data=body, headers=_headers(ABUSER_KEY)) as response:
            payload = await response.read()
            code = orjson.loads(payload).get("error", {}).get("code") if response.status != 200 else "ok"
            mode.abuser[f"{response.status} {code}"] += 1
    except (aiohttp.ClientError, orjson.JSONDecodeError) as exc:
        mode.abuser[type(exc).__name__] += 1


def _headers(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", "content-type": "application/json"}


async def _arrivals(rate: float, seconds: float, seed: int, launch: Any) -> None:
    """Open-loop Poisson arrivals: ``launch()`` at each, never waiting for an answer."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    tasks: set[asyncio.Task[None]] = set()
    start = loop.time()
    next_at = start + rng.expovariate(rate)
    while next_at < start + seconds:
        await asyncio.sleep(max(0.0, next_at - loop.time()))
        task = loop.create_task(launch())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        next_at += rng.expovariate(rate)
    if tasks:
        await asyncio.wait(tasks, timeout=30)


async def _phase(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    mode: Mode,
    attacked: bool,
    seed: int,
    bodies: tuple[int, ...] = (),
) -> None:
    """One phase: the victim's arrivals, and the abuser's (bodies by index; () every body) if ``attacked``."""
    before, started = cpu_seconds(args.gateway_pid), time.perf_counter()
    if attacked:
        args.control.put((args.phase_s, seed + 1, bodies))
    await _arrivals(args.victim_rate, args.phase_s, seed, lambda: _victim(session, args.url, mode))
    if attacked:
        sent, answers = await asyncio.get_running_loop().run_in_executor(None, args.results.get)
        mode.abuser_sent += sent
        mode.abuser.update(answers)
    mode.cpu_s += cpu_seconds(args.gateway_pid) - before
    mode.seconds += time.perf_counter() - started


def _abuser_process(url: str, bodies: list[bytes], rate: float, control: Queue[Any], results: Queue[Any]) -> None:
    """The abuser, a client process of its own: one attack of ``(seconds, seed)`` per command."""

    async def serve() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            loop = asyncio.get_running_loop()
            while (command := await loop.run_in_executor(None, control.get)) is not None:
                seconds, seed, chosen = command
                sending = [bodies[i] for i in chosen] if chosen else bodies
                mode, sent = Mode(), 0

                def attack(mode: Mode = mode, sending: list[bytes] = sending) -> Any:
                    nonlocal sent
                    sent += 1
                    return _abuser(session, url, sending[sent % len(sending)], mode)

                await _arrivals(rate, seconds, seed, attack)
                results.put((sent, dict(mode.abuser)))

    asyncio.run(serve())


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def _schedule(args: argparse.Namespace) -> dict[str, tuple[int, ...] | None]:
    """Each mode's abuser bodies: None alone; () every shape in turn; with ``--versus`` one mode per shape."""
    if not args.versus:
        return {"alone": None, "attacked": ()}
    return {"alone": None, **{f"attacked:{shape}": (i,) for i, shape in enumerate(args.shape_names)}}


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    schedule = _schedule(args)
    modes = {name: Mode() for name in schedule}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await _phase(session, args, Mode(), attacked=False, seed=0)  # warm up
        order = list(schedule)
        for round_no in range(args.rounds):
            shift = round_no % len(order)  # rotated, so that no mode always follows the same one
            for name in order[shift:] + order[:shift]:
                bodies = schedule[name]
                await _phase(session, args, modes[name], bodies is not None, round_no * 7, bodies or ())
    if args.versus:
        return _versus_report(args, modes)
    alone, attacked = modes["alone"], modes["attacked"]
    cpu_alone_per_s = alone.cpu_s / alone.seconds
    extra_cpu = attacked.cpu_s - cpu_alone_per_s * attacked.seconds
    report: dict[str, Any] = {
        name: {
            "victim_requests": len(m.latencies),
            "victim_errors": dict(m.errors),
            "p50_ms": _pct(m.latencies, 50),
            "p95_ms": _pct(m.latencies, 95),
            "p99_ms": _pct(m.latencies, 99),
            "gateway_cpu_share": m.cpu_s / m.seconds,
        }
        for name, m in modes.items()
    }
    report["ratio_attacked_over_alone"] = {
        f"p{q}": _pct(attacked.latencies, q) / _pct(alone.latencies, q) for q in (50, 95, 99)
    }
    report["abuser_answers"] = dict(attacked.abuser)
    report["abuser_sent"] = attacked.abuser_sent
    report["gateway_cpu_ms_per_abuser_request"] = extra_cpu * 1000 / max(attacked.abuser_sent, 1)
    return report


def _figures(mode: Mode) -> dict[str, Any]:
    return {
        "victim_requests": len(mode.latencies),
        "victim_errors": dict(mode.errors),
        "p50_ms": _pct(mode.latencies, 50),
        "p95_ms": _pct(mode.latencies, 95),
        "p99_ms": _pct(mode.latencies, 99),
        "gateway_cpu_share": mode.cpu_s / mode.seconds,
    }


def _versus_report(args: argparse.Namespace, modes: dict[str, Mode]) -> dict[str, Any]:
    """Each shape's figures, its gateway CPU per abuser request, and its victim P99 over ``--versus``'s."""
    alone = modes["alone"]
    cpu_alone_per_s = alone.cpu_s / alone.seconds
    shapes: dict[str, Any] = {}
    for shape in args.shape_names:
        mode = modes[f"attacked:{shape}"]
        extra_cpu = mode.cpu_s - cpu_alone_per_s * mode.seconds
        shapes[shape] = {
            **_figures(mode),
            "abuser_sent": mode.abuser_sent,
            "abuser_answers": dict(mode.abuser),
            "gateway_cpu_ms_per_abuser_request": extra_cpu * 1000 / max(mode.abuser_sent, 1),
        }
    baseline = shapes[args.versus]["p99_ms"]
    for figures in shapes.values():
        figures["p99_over_versus"] = figures["p99_ms"] / baseline
    worst = max((s for s in shapes if s != args.versus), key=lambda s: shapes[s]["p99_over_versus"], default=None)
    return {"alone": _figures(alone), "versus": args.versus, "shapes": shapes, "worst_shape": worst}


def _print_versus(report: dict[str, Any]) -> None:
    r = report["alone"]
    print(f"victim alone: P50 {r['p50_ms']:7.2f} ms  P95 {r['p95_ms']:7.2f} ms  P99 {r['p99_ms']:7.2f} ms")
    for shape, r in report["shapes"].items():
        print(
            f"attacked by {shape:>15}: victim P50 {r['p50_ms']:7.2f}  P95 {r['p95_ms']:7.2f}  P99 {r['p99_ms']:7.2f} ms"
            f"  P99/{report['versus']} {r['p99_over_versus']:.2f}x  | gateway CPU "
            f"{r['gateway_cpu_ms_per_abuser_request']:.1f} ms per abuser request, answers {r['abuser_answers']}"
        )
    worst = report["worst_shape"]
    if worst is not None:
        ratio = report["shapes"][worst]["p99_over_versus"]
        print(f"worst shape: {worst}, victim P99 {ratio:.2f}x the {report['versus']} body's (goal: at most 1.20x)")


def _print(report: dict[str, Any], args: argparse.Namespace) -> None:
    if args.versus:
        _print_versus(report)
        return
    for name in ("alone", "attacked"):
        r = report[name]
        print(
            f"victim {name:>8}: P50 {r['p50_ms']:7.2f} ms  P95 {r['p95_ms']:7.2f} ms  P99 {r['p99_ms']:7.2f} ms  "
            f"({r['victim_requests']} requests, errors {r['victim_errors'] or 0}, gateway CPU "
            f"{r['gateway_cpu_share'] * 100:.0f}% of a core)"
        )
    ratio = report["ratio_attacked_over_alone"]
    print(
        f"ratio attacked/alone: P50 {ratio['p50']:.2f}x  P95 {ratio['p95']:.2f}x  P99 {ratio['p99']:.2f}x  | abuser: "
        f"{report['abuser_sent']} sent at {args.abuser_rate}/s, answers {report['abuser_answers']}, "
        f"gateway CPU {report['gateway_cpu_ms_per_abuser_request']:.1f} ms per abuser request"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--victim-rate", type=float, default=20.0)
    parser.add_argument("--abuser-rate", type=float, default=12.0)
    parser.add_argument("--phase-s", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", default="many_messages,tiny_parts,deep_nesting,many_numbers,many_keys")
    parser.add_argument("--versus", default=None, help="a phase per shape, each shape's victim P99 over this one's")
    parser.add_argument("--abuser-rpm", type=int, default=100_000)
    parser.add_argument("--backend-port", type=int, default=0, help="0: a free port")
    parser.add_argument("--gateway-port", type=int, default=0, help="0: a free port")
    parser.add_argument("--gateway-pythonpath", default=None, help="run the gateway from this source tree")
    parser.add_argument("--out", default=None, help="write the figures as JSON to this file")
    args = parser.parse_args(argv)
    args.shape_names = list(dict.fromkeys([*args.shapes.split(","), *([args.versus] if args.versus else [])]))
    args.bodies = [hostile_body(shape) for shape in args.shape_names]
    args.backend_port = args.backend_port or free_port()
    args.gateway_port = args.gateway_port or free_port()
    backend = f"http://127.0.0.1:{args.backend_port}"
    gateway = f"http://127.0.0.1:{args.gateway_port}"
    args.url = gateway + "/v1/chat/completions"
    exe = [sys.executable, "-m", "gateway"]
    env = dict(os.environ)
    gateway_exe = exe
    if args.gateway_pythonpath:
        env["PYTHONPATH"] = args.gateway_pythonpath
        gateway_exe = [sys.executable, "-P", "-m", "gateway"]  # -P: not the working directory's tree
    load_before = os.getloadavg()
    with policy_file(policy(backend, args.abuser_rpm)) as path:
        sim = [*pin(0), *exe, "sim", "--profile", "instant", "--model", MODEL, "--port", str(args.backend_port)]
        serve = [*pin(1), *gateway_exe, "serve", "--policy", str(path), "--port", str(args.gateway_port)]
        if len(pin(0)):
            os.sched_setaffinity(0, {0})
        context = multiprocessing.get_context("spawn")
        args.control, args.results = context.Queue(), context.Queue()
        abuser = context.Process(
            target=_abuser_process, args=(args.url, args.bodies, args.abuser_rate, args.control, args.results)
        )
        with process(sim, backend + "/health"), process(serve, gateway + "/healthz", env=env) as gateway_proc:
            args.gateway_pid = gateway_proc.pid
            abuser.start()
            print(
                f"hostile tenant: victim {args.victim_rate}/s small chats, abuser {args.abuser_rate}/s invalid bodies "
                f"of ~{len(args.bodies[0]) // 1024} KiB ({','.join(args.shape_names)}), "
                f"phases of {args.phase_s}s x {args.rounds} rounds, alternating; "
                f"gateway from {args.gateway_pythonpath or 'this tree'}",
                flush=True,
            )
            try:
                report = asyncio.run(_run(args))
            finally:
                args.control.put(None)
                abuser.join(timeout=30)
    report["load_average"] = {"start": load_before, "end": os.getloadavg()}
    print(f"load average (1, 5, 15 min): start {load_before}, end {report['load_average']['end']}")
    _print(report, args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
