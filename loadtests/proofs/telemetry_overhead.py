"""What telemetry costs: the gateway with metrics and tracing at 100% sampling against telemetry off.

Usage::

    python -m loadtests.proofs.telemetry_overhead [--rates 200,400] [--stream-rate 100] [--flood-clients 64]
                                           [--phase-s 4] [--rounds 3] [--out loadtests/results/telemetry]

The observability issue's goal: at most 10% lower throughput and at most 0.5 ms added P50
with every request traced, against the same gateway with telemetry off. Processes, each its
own: a zero-delay simulated engine (profile ``instant``) and an OTLP/HTTP receiver
(``loadtests/harness/otlp_sink.py``, counting spans) share core 0 with this load generator; two
gateways share core 1 and are loaded in turn, never together:

* ``off``: ``GATEWAY_TELEMETRY=off``: no request metrics, no cost accounting, no spans;
* ``metrics``: metrics and cost accounting on, tracing off (to tell the two costs apart);
* ``sampled``: everything on, tracing at ``sampling_ratio: 0.01`` (the production setting the
  hot-path issue asks to cost nothing measurable);
* ``on``: everything on, ``telemetry.tracing`` with ``sampling_ratio: 1.0`` exporting every span
  to the receiver over OTLP/HTTP protobuf from the export thread, as in production.

Phases alternate (off, metrics, on, off, ...) for ``--rounds`` rounds so both see the same noise.
Figures, all as on-versus-off in the same run: P50 and P99 latency of an open-loop Poisson load
at each rate (non-streaming) and TTFT / inter-token P50/P99 of a stream load; gateway CPU per
request (its inverse is the throughput one core can give); and the saturated throughput of a
closed-loop flood of ``--flood-clients`` concurrent requests. Throughput phases taken in turn
swing with whatever else the shared machine does (rounds differ by 2x), so each round also
floods the metrics-only gateway and a traced one *together* on their one core (``_contest``):
the scheduler splits the core between them, and their throughput ratio is tracing's cost, with
the same noise on both sides. Spans received by the sink are
counted against those expected (3 per request: server, route, upstream attempt), so a batch
processor that silently drops spans under load shows up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from loadtests.harness.processes import admin_args, cpu_seconds, pin, process
from loadtests.proofs.overhead import API_KEY, CHAT_BODY, STREAM_TOKENS, PhaseResult, _pct, _phase, _policy

SPANS_PER_REQUEST = 3
MODES = ("off", "metrics", "sampled", "on")


@dataclass
class FloodResult:
    completed: int = 0
    errors: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    per_round: list[float] = field(default_factory=list)
    """Each round's throughput: modes are compared round by round, then by the median ratio."""

    @property
    def throughput(self) -> float:
        return self.completed / self.seconds if self.seconds else 0.0


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """The median of per-round ratios: phases of one round ran side by side, under the same noise,
    so their ratio cancels what a round's neighbours did to the machine; the median drops the
    rounds a burst of other work hit (this machine is shared)."""
    ratios = sorted(a / b for a, b in zip(numerators, denominators, strict=True) if b)
    if not ratios:
        return 0.0
    middle = len(ratios) // 2
    return ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2


@dataclass
class ModeRun:
    """Everything measured for one mode."""

    rates: dict[float, PhaseResult] = field(default_factory=dict)
    stream: PhaseResult = field(default_factory=PhaseResult)
    flood: FloodResult = field(default_factory=FloodResult)
    contest: list[tuple[float, float, float]] = field(default_factory=list)
    """Per round, against the metrics-only gateway flooded at the same time on the same core:
    (this mode's throughput / its rival's, its rival's CPU per request / this mode's, the two
    processes' CPU summed in cores: about 1.0 when the pair saturated the core, as it must)."""


async def _flood(session: aiohttp.ClientSession, url: str, clients: int, seconds: float, out: FloodResult) -> None:
    """Closed loop: ``clients`` requests always in flight for ``seconds``; counts completions."""
    payload = json.dumps(CHAT_BODY).encode()
    headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds

    async def client() -> None:
        while loop.time() < end:
            try:
                async with session.post(url, data=payload, headers=headers) as response:
                    await response.read()
                    if response.status == 200:
                        out.completed += 1
                    else:
                        out.errors += 1
            except aiohttp.ClientError:
                out.errors += 1

    start, before = loop.time(), out.completed
    await asyncio.gather(*(client() for _ in range(clients)))
    out.seconds += loop.time() - start
    out.per_round.append((out.completed - before) / (loop.time() - start))


async def _contest(
    session: aiohttp.ClientSession, urls: dict[str, str], pids: dict[str, int], rival: str, args: argparse.Namespace
) -> tuple[float, float, float]:
    """The metrics-only gateway and ``rival`` flooded together, on the one core both are pinned to.

    The scheduler shares a core fairly between two processes that always have work, so each
    serves in proportion to the inverse of its CPU per request, and whatever else the machine
    does at that moment (this machine is shared) slows both alike: the most direct measure of
    what tracing costs in throughput on one core.
    """
    pair = ("metrics", rival)
    results = {mode: FloodResult() for mode in pair}
    before = {mode: cpu_seconds(pids[mode]) for mode in pair}
    start = time.perf_counter()
    await asyncio.gather(
        *(_flood(session, urls[mode], args.flood_clients // 2, args.phase_s, results[mode]) for mode in pair)
    )
    seconds = time.perf_counter() - start
    cpu = {mode: cpu_seconds(pids[mode]) - before[mode] for mode in pair}
    base, traced = results["metrics"], results[rival]
    throughput_ratio = traced.completed / max(base.completed, 1)
    cpu_ratio = (cpu["metrics"] / max(base.completed, 1)) / (cpu[rival] / max(traced.completed, 1))
    return throughput_ratio, cpu_ratio, sum(cpu.values()) / seconds


async def _run(args: argparse.Namespace, urls: dict[str, str], pids: dict[str, int]) -> dict[str, ModeRun]:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    runs = {mode: ModeRun() for mode in MODES}
    async with aiohttp.ClientSession(connector=connector) as session:
        for mode in MODES:  # warm both
            await _phase(session, urls[mode], 50, 1.0, False, PhaseResult(), 0)
        for round_no in range(args.rounds):
            for rate in args.rates:
                for mode in MODES:
                    result = runs[mode].rates.setdefault(rate, PhaseResult())
                    before = cpu_seconds(pids[mode])
                    await _phase(session, urls[mode], rate, args.phase_s, False, result, seed=round_no)
                    result.cpu_s += cpu_seconds(pids[mode]) - before
            for mode in MODES:
                before = cpu_seconds(pids[mode])
                await _phase(session, urls[mode], args.stream_rate, args.phase_s, True, runs[mode].stream, round_no)
                runs[mode].stream.cpu_s += cpu_seconds(pids[mode]) - before
            for mode in MODES:
                flood = runs[mode].flood
                before = cpu_seconds(pids[mode])
                await _flood(session, urls[mode], args.flood_clients, args.phase_s, flood)
                flood.cpu_s += cpu_seconds(pids[mode]) - before
            for rival in ("on", "sampled"):
                runs[rival].contest.append(await _contest(session, urls, pids, rival, args))
            print(f"round {round_no + 1}/{args.rounds} done", flush=True)
    return runs


def _report(runs: dict[str, ModeRun], spans_received: int) -> dict[str, object]:
    off, on, metrics_only = runs["off"], runs["on"], runs["metrics"]
    report: dict[str, object] = {"rates": {}}
    lines = []
    for rate, r_off in off.rates.items():
        r_on = on.rates[rate]
        cpu_off, cpu_on = r_off.cpu_s * 1000 / r_off.sent, r_on.cpu_s * 1000 / r_on.sent
        row = {
            "off_p50_ms": _pct(r_off.latencies, 50),
            "on_p50_ms": _pct(r_on.latencies, 50),
            "added_p50_ms": _pct(r_on.latencies, 50) - _pct(r_off.latencies, 50),
            "off_p99_ms": _pct(r_off.latencies, 99),
            "on_p99_ms": _pct(r_on.latencies, 99),
            "added_p99_ms": _pct(r_on.latencies, 99) - _pct(r_off.latencies, 99),
            "cpu_ms_per_request_off": cpu_off,
            "cpu_ms_per_request_on": cpu_on,
            "cpu_throughput_ratio": cpu_off / cpu_on,
            "errors": {"off": r_off.errors, "on": r_on.errors},
            "sent": {"off": r_off.sent, "on": r_on.sent},
        }
        report["rates"][rate] = row  # type: ignore[index]
        lines.append(
            f"{rate:>5.0f} req/s | P50 off {row['off_p50_ms']:.2f} on {row['on_p50_ms']:.2f} "
            f"added {row['added_p50_ms']:+.2f} ms | P99 off {row['off_p99_ms']:.2f} on {row['on_p99_ms']:.2f} "
            f"added {row['added_p99_ms']:+.2f} ms | CPU/req off {cpu_off:.3f} on {cpu_on:.3f} ms "
            f"(throughput on one core x{cpu_off / cpu_on:.3f}) | errors {r_off.errors}/{r_on.errors}"
        )
    s_off, s_on = off.stream, on.stream
    report["stream"] = {
        "ttft_p50_ms": {"off": _pct(s_off.ttfts, 50), "on": _pct(s_on.ttfts, 50)},
        "added_ttft_p50_ms": _pct(s_on.ttfts, 50) - _pct(s_off.ttfts, 50),
        "itl_p99_ms": {"off": _pct(s_off.itls, 99), "on": _pct(s_on.itls, 99)},
        "added_itl_p99_ms": _pct(s_on.itls, 99) - _pct(s_off.itls, 99),
        "cpu_ms_per_stream": {"off": s_off.cpu_s * 1000 / s_off.sent, "on": s_on.cpu_s * 1000 / s_on.sent},
        "errors": {"off": s_off.errors, "on": s_on.errors},
    }
    stream = report["stream"]
    lines.append(
        f"streams x {STREAM_TOKENS[0]} tokens | TTFT P50 off {_pct(s_off.ttfts, 50):.2f} on {_pct(s_on.ttfts, 50):.2f} "
        f"added {stream['added_ttft_p50_ms']:+.2f} ms | ITL P99 off {_pct(s_off.itls, 99):.3f} "  # type: ignore[index]
        f"on {_pct(s_on.itls, 99):.3f} added {stream['added_itl_p99_ms']:+.3f} ms | "  # type: ignore[index]
        f"errors {s_off.errors}/{s_on.errors}"
    )
    f_off, f_on, f_metrics = off.flood, on.flood, metrics_only.flood
    report["flood"] = {
        "throughput_off": f_off.throughput,
        "throughput_metrics_only": f_metrics.throughput,
        "throughput_on": f_on.throughput,
        "throughput_ratio": f_on.throughput / f_off.throughput if f_off.throughput else None,
        "throughput_ratio_metrics_only": f_metrics.throughput / f_off.throughput if f_off.throughput else None,
        "cpu_ms_per_request": {mode: r.flood.cpu_s * 1000 / max(r.flood.completed, 1) for mode, r in runs.items()},
        "errors": {"off": f_off.errors, "metrics": f_metrics.errors, "on": f_on.errors},
    }
    cpu = report["flood"]["cpu_ms_per_request"]  # type: ignore[index]
    # Tracing's own cost: the traced gateway against the one with metrics only (both keep every
    # other feature on), round by round; "off" also drops the metrics.
    tracing_ratio = median_ratio(f_on.per_round, f_metrics.per_round)
    sampled_ratio = median_ratio(runs["sampled"].flood.per_round, f_metrics.per_round)
    report["flood"].update(  # type: ignore[attr-defined]
        {
            "per_round": {mode: r.flood.per_round for mode, r in runs.items()},
            "tracing_median_round_ratio": tracing_ratio,
            "sampled_median_round_ratio": sampled_ratio,
        }
    )
    lines.append(
        f"flood | off {f_off.throughput:.0f} req/s, metrics only {f_metrics.throughput:.0f} "
        f"(x{f_metrics.throughput / max(f_off.throughput, 1e-9):.3f}), metrics + tracing {f_on.throughput:.0f} "
        f"(x{f_on.throughput / max(f_off.throughput, 1e-9):.3f}) | CPU/req off {cpu['off']:.3f} metrics "
        f"{cpu['metrics']:.3f} on {cpu['on']:.3f} ms | errors {f_off.errors}/{f_metrics.errors}/{f_on.errors}"
    )
    lines.append(
        f"flood, tracing's own cost (median of {len(f_on.per_round)} per-round ratios against metrics only) | "
        f"100%: x{tracing_ratio:.3f} | 1%: x{sampled_ratio:.3f}"
    )
    report["contest"], contest_lines = _contest_report(runs)
    lines += contest_lines
    sampled = runs["sampled"]
    report["sampled"] = {}
    for rate, r_sampled in sampled.rates.items():
        r_off = off.rates[rate]
        ratio = (r_off.cpu_s / r_off.sent) / (r_sampled.cpu_s / r_sampled.sent)
        added = _pct(r_sampled.latencies, 50) - _pct(r_off.latencies, 50)
        report["sampled"][rate] = {"added_p50_ms": added, "cpu_throughput_ratio": ratio}  # type: ignore[index]
        lines.append(
            f"{rate:>5.0f} req/s tracing at 1% | P50 added {added:+.2f} ms | CPU/req "
            f"{r_sampled.cpu_s * 1000 / r_sampled.sent:.3f} ms (throughput on one core x{ratio:.3f} of off)"
        )
    f_sampled = sampled.flood
    flood_ratio = f_sampled.throughput / max(f_off.throughput, 1e-9)
    report["sampled_flood_throughput_ratio"] = flood_ratio
    lines.append(f"flood tracing at 1% | {f_sampled.throughput:.0f} req/s (x{flood_ratio:.3f} of off)")
    for rate, r_metrics in metrics_only.rates.items():
        added = _pct(r_metrics.latencies, 50) - _pct(off.rates[rate].latencies, 50)
        cpu_per_request = r_metrics.cpu_s * 1000 / r_metrics.sent
        lines.append(f"{rate:>5.0f} req/s metrics only | P50 added {added:+.2f} ms | CPU/req {cpu_per_request:.3f} ms")
    traced = sum(r.sent for r in on.rates.values()) + on.stream.sent + f_on.completed + f_on.errors
    expected = traced * SPANS_PER_REQUEST
    report["spans"] = {"expected_at_least": expected, "received": spans_received}
    lines.append(f"spans | received {spans_received} of at least {expected} expected ({SPANS_PER_REQUEST}/request)")
    for line in lines:
        print(line, flush=True)
    report["text"] = lines
    return report


def _contest_report(runs: dict[str, ModeRun]) -> tuple[dict[str, object], list[str]]:
    """The contests' figures (medians over rounds) and their lines, for 100% and 1% tracing."""
    report: dict[str, object] = {}
    lines = []
    for rival, label in (("on", "100%"), ("sampled", "1%")):
        rounds = runs[rival].contest
        throughput = statistics.median(r[0] for r in rounds) if rounds else 0.0
        cpu_ratio = statistics.median(r[1] for r in rounds) if rounds else 0.0
        cores = [round(r[2], 2) for r in rounds]
        report[rival] = {"throughput_ratio": throughput, "cpu_ratio": cpu_ratio, "rounds": rounds}
        lines.append(
            f"contest, tracing at {label} against metrics only, flooded together on one core | throughput "
            f"x{throughput:.3f}, CPU per request x{cpu_ratio:.3f} (medians of {len(rounds)} rounds; "
            f"the pair's CPU in cores per round: {cores})"
        )
    return report, lines


def _sink_count(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(url + "/count", timeout=5) as response:
        return int(response.read())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rates", default="200,400")
    parser.add_argument("--stream-rate", type=float, default=100.0)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--flood-clients", type=int, default=64)
    parser.add_argument("--phase-s", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=18600, help="first of six consecutive ports")
    parser.add_argument("--out", default=None, help="write the figures as JSON to OUT.json and text to OUT.txt")
    args = parser.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    STREAM_TOKENS[0] = args.stream_tokens
    ports = {"backend": args.port, "sink": args.port + 1, "off": args.port + 2, "on": args.port + 3}
    ports["metrics"] = args.port + 4
    ports["sampled"] = args.port + 5
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    exe = [sys.executable, "-m", "gateway"]
    base = _policy(url["backend"])
    traced = (
        base + f"telemetry:\n  tracing: {{enabled: true, sampling_ratio: 1.0, endpoint: '{url['sink']}/v1/traces'}}\n"
    )
    folder = tempfile.mkdtemp(prefix="telemetry-bench-")
    paths = {"off": Path(folder, "off.yaml"), "metrics": Path(folder, "metrics.yaml"), "on": Path(folder, "on.yaml")}
    paths["off"].write_text(base)
    paths["metrics"].write_text(base)
    paths["on"].write_text(traced)
    paths["sampled"] = Path(folder, "sampled.yaml")
    paths["sampled"].write_text(traced.replace("sampling_ratio: 1.0", "sampling_ratio: 0.01"))
    sim = [*pin(0), *exe, "sim", "--profile", "instant", "--model", "sim-instant", "--port", str(ports["backend"])]
    sink = [*pin(0), sys.executable, "-m", "loadtests.harness.otlp_sink", "--port", str(ports["sink"])]

    def serve(mode: str) -> list[str]:
        port = ports[mode]
        return [*pin(1), *exe, "serve", "--policy", str(paths[mode]), "--port", str(port), *admin_args(port)]

    if len(pin(0)):
        os.sched_setaffinity(0, {0})
    env_off = {**os.environ, "GATEWAY_TELEMETRY": "off"}
    with (
        process(sim, url["backend"] + "/health"),
        process(sink, url["sink"] + "/count"),
        process(serve("off"), url["off"] + "/healthz", env=env_off) as gw_off,
        process(serve("metrics"), url["metrics"] + "/healthz") as gw_metrics,
        process(serve("on"), url["on"] + "/healthz") as gw_on,
        process(serve("sampled"), url["sampled"] + "/healthz") as gw_sampled,
    ):
        print(
            f"telemetry overhead: off {url['off']} vs on {url['on']} (tracing 100% to {url['sink']}); "
            f"phases of {args.phase_s}s x {args.rounds} rounds, alternating",
            flush=True,
        )
        paths_ = {mode: url[mode] + "/v1/chat/completions" for mode in MODES}
        t0 = time.perf_counter()
        pids = {"off": gw_off.pid, "metrics": gw_metrics.pid, "sampled": gw_sampled.pid, "on": gw_on.pid}
        runs = asyncio.run(_run(args, paths_, pids))
        print(f"load done in {time.perf_counter() - t0:.0f}s; waiting for the last span batches", flush=True)
        gw_on.terminate()  # SIGTERM: the gateway drains and flushes its span processor before exiting
        gw_on.wait(timeout=30)
        spans = _sink_count(url["sink"])
    report = _report(runs, spans)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str))
        out.with_suffix(".txt").write_text("\n".join(report["text"]) + "\n")  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
