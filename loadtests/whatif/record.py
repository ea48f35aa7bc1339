"""``inference-gateway whatif record``: a trace recorded from the gateway in front of simulated engines.

Why: a what-if is only as good as its replay, and the one way to check a replay is a trace whose
outcome is known. Recorded here, the trace went through the very stage a replay builds (the
policy rewritten for simulated engines of one profile, ``stage.py``), driven by a load-generator
workload (``loadtests/loadgen``), and written by the gateway's own request trace log
(``GATEWAY_TRACE_LOG``): replaying it under the same policy must give back its TTFT
distribution (``tests/whatif/test_fidelity.py``). It is also how the example trace in
``policies/examples/`` was made, and a way for a team without production traffic yet to try a
policy change on a synthetic mix.

The workload's tenants must be the policy's (their keys are replaced by the stage's); it is
recorded in real time (speed 1): a trace's timestamps are the arrivals the replay reproduces.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from loadtests.loadgen.runner import RunConfig, run_sync, run_workload
from loadtests.loadgen.workload import Workload, load_workload
from loadtests.whatif.model import StageSettings
from loadtests.whatif.stage import StageError, StagePlan, running, stage_policy
from loadtests.whatif.trace import read_trace


@dataclass(frozen=True, slots=True)
class Recording:
    """What ``record_trace`` wrote: the trace, the requests it holds, and what the load generator sent."""

    trace: Path
    requests: int
    sent: int


def record_trace(
    policy: Path,
    workload_path: Path,
    settings: StageSettings,
    *,
    rate: float,
    duration_s: float,
    out: Path,
    port_base: int,
    seed: int = 0,
) -> Recording:
    """Run ``workload_path`` at ``rate`` for ``duration_s`` through ``policy`` staged on
    ``settings``' engines; the gateway's trace log of it lands at ``out`` (which must not exist)."""
    if settings.speed != 1:
        raise StageError("a trace is recorded in real time (speed 1): its timestamps are what a replay reproduces")
    if out.exists():
        raise StageError(f"{out} exists: a trace log appends, so record into a new file")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="whatif-record-") as scratch:
        work = Path(scratch)
        plan = stage_policy(policy, settings, work_dir=work / "stage", port_base=port_base)
        workload = with_stage_keys(load_workload(workload_path), plan)
        config = RunConfig(
            target=plan.gateway_url, rate=rate, duration_s=duration_s, out_dir=work / "loadgen", seed=seed
        )
        with running(plan, trace_log=out):
            result = run_sync(lambda: run_workload(workload, config, base_dir=workload_path.parent))
    # The gateway drained its trace log when it stopped: every request it saw has its line.
    return Recording(out, len(read_trace(out).requests), len(result.records))


def with_stage_keys(workload: Workload, plan: StagePlan) -> Workload:
    """``workload`` with each tenant's key replaced by the one the staged policy accepts."""
    unknown = sorted(set(workload.tenants) - set(plan.keys))
    if unknown:
        raise StageError(f"the workload's tenants {unknown} are not in the policy (it has {sorted(plan.keys)})")
    tenants = {
        name: tenant.model_copy(update={"api_key": plan.keys[name], "api_key_env": None})
        for name, tenant in workload.tenants.items()
    }
    return workload.model_copy(update={"tenants": tenants})
