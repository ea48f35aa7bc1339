"""The generator's own ceiling, measured by ramping against a zero-delay backend.

A zero-delay backend (``inference-gateway sim --profile instant``, or the tests' fake) makes
every request cost the generator its fixed work — plan, send, parse a short stream, record —
and almost nothing else, so what limits the ramp is the generator. Each step doubles the rate
for a few seconds of a tiny built-in workload (16-word prompts, 16 streamed tokens) and stops at
the first step that is not sustained:

* P99 send lateness above half the mean arrival gap, or 5 ms (`summary.lateness_limit`), or
* the sending rate below 90% of the offered rate, or
* more than 1% errors (the target, not the generator, gave up).

The ceiling is the last sustained rate; 1/(CPU per request) at that step is the one-core estimate.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from loadtests.loadgen.runner import ProgressSink, RunConfig, run_workload
from loadtests.loadgen.summary import lateness_limit
from loadtests.loadgen.workload import Workload, parse_workload

_PROBE: dict[str, Any] = {
    "name": "ceiling-probe",
    "model": "probe",
    "classes": {"probe": {"share": 1, "priority": "standard", "slo": {"ttft_ms": 60_000, "tpot_ms": 60_000}}},
    "tenants": {"probe": {"share": 1, "api_key": "ceiling-probe-key"}},
    "prompt_tokens": {"dist": "fixed", "value": 16},
    "output_tokens": {"dist": "fixed", "value": 16},
}


def probe_workload(model: str = "probe") -> Workload:
    return parse_workload({**_PROBE, "model": model}, source="<ceiling probe>")


@dataclass(frozen=True, slots=True)
class CeilingStep:
    rate: float
    send_rate: float
    cpu_s_per_request: float | None
    lateness_p99_s: float | None
    error_fraction: float
    sustained: bool


def judge(rate: float, summary: dict[str, Any]) -> CeilingStep:
    gen, overall = summary["generator"], summary["overall"]
    requests = overall["requests"] or 1
    errors = (overall["requests"] - overall["ok"]) / requests
    lateness = gen["lateness_s"]["p99"]
    on_time = lateness is None or lateness <= lateness_limit(rate)
    sustained = gen["send_rate"] >= 0.9 * rate and errors <= 0.01 and on_time
    return CeilingStep(rate, gen["send_rate"], gen["cpu_s_per_request"], lateness, errors, sustained)


async def measure_ceiling(
    target: str,
    out_dir: Path,
    *,
    start_rate: float = 100.0,
    max_rate: float = 8000.0,
    step_s: float = 3.0,
    model: str = "probe",
    progress: Callable[[float], AbstractContextManager[ProgressSink | None]],
) -> dict[str, Any]:
    """Ramp until a step is not sustained; write and return ``ceiling.json``."""
    workload = probe_workload(model)
    steps: list[CeilingStep] = []
    rate = start_rate
    while rate <= max_rate:
        config = RunConfig(target=target, rate=rate, duration_s=step_s, out_dir=out_dir / f"rate-{rate:g}")
        with progress(rate) as sink:
            result = await run_workload(workload, config, base_dir=out_dir, progress=sink)
        steps.append(judge(rate, result.summary))
        if not steps[-1].sustained:
            break
        rate *= 2
    sustained = [s for s in steps if s.sustained]
    best = sustained[-1] if sustained else None
    cpu = best.cpu_s_per_request if best else None
    document = {
        "target": target,
        "ceiling_rps": best.rate if best else None,
        "cpu_s_per_request": cpu,
        "one_core_estimate_rps": 1 / cpu if cpu else None,
        "reached_max_rate": bool(steps) and steps[-1].sustained,
        "steps": [asdict(s) for s in steps],
    }
    _write(out_dir / "ceiling.json", document)
    return document


def _write(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
