"""``inference-gateway whatif``: replay a trace against two policies, or plan a fleet for one.

::

    inference-gateway whatif --trace T --policy CURRENT.yaml --candidate NEW.yaml --profile NAME
        [--engines N] [--speed X] [--traffic xK] [--repeats R] --out DIR
    inference-gateway whatif plan --trace T --policy P --profile NAME --slo interactive=0.99[,batch=0.9]
        [--speed X] [--traffic xK] [--max-engines M] [--repeats R] --out DIR
    inference-gateway whatif record --policy P --profile NAME --workload W --rate R --duration S
        [--engines N] [--seed N] --out TRACE.jsonl

The first form has no sub-command word, so ``plan`` is an optional sub-command of ``whatif``:
argparse would demand the comparison's required options of ``plan`` too, so the comparison
checks its own (``--trace``, ``--policy``, ``--candidate``, ``--profile``, ``--out``) and exits 2
naming what is missing, like any usage error. The sides' repeats alternate (current r0,
candidate r0, current r1, ...) so that drift of the machine hits both sides alike. ``plan``
exits 1 when no fleet up to ``--max-engines`` meets the targets (its report says so).

The trace reader and the replay are imported when a command runs: they bring the gateway's
policy loader, the simulator and the load generator, which ``--help`` does not need.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

from loadtests.whatif.model import SideRun, StageSettings, Trace
from loadtests.whatif.plan import DEFAULT_MAX_ENGINES, QUEUE_VARIANTS, Replayer

USAGE_ERROR = 2
DEFAULT_REPEATS = 2
DEFAULT_PORT_BASE = 18600
SIDES = ("current", "candidate")
_FORMS = """forms:
  whatif --trace T --policy CURRENT.yaml --candidate NEW.yaml --profile NAME [--engines N] [--speed X]
         [--traffic xK] [--repeats R] --out DIR
  whatif plan --trace T --policy P --profile NAME --slo interactive=0.99[,batch=0.9] [--speed X]
         [--traffic xK] [--max-engines M] [--repeats R] --out DIR
  whatif record --policy P --profile NAME --workload W --rate R --duration S [--engines N] [--seed N]
         --out TRACE.jsonl"""
_PLAN_REQUIRED = (("trace", "--trace"), ("policy", "--policy"), ("profile", "--profile"), ("out", "--out"))
_COMPARISON_REQUIRED = (*_PLAN_REQUIRED, ("candidate", "--candidate"))


def parse_traffic(text: str) -> float:
    """``x2``, ``X2`` or ``2``: the factor the arrival rate is multiplied by."""
    try:
        factor = float(text.strip().removeprefix("x").removeprefix("X"))
    except ValueError:
        factor = math.nan
    if not math.isfinite(factor) or factor <= 0:
        raise argparse.ArgumentTypeError(f"takes a positive factor such as x2 or 0.5, not {text!r}")
    return factor


def parse_slo_targets(text: str) -> dict[str, float]:
    """``interactive=0.99,batch=0.9``: each class's attainment target, within (0, 1]."""
    targets: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"takes CLASS=TARGET[,CLASS=TARGET...], not {text!r}")
        try:
            target = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: the target must be a number, not {value!r}") from None
        if not 0 < target <= 1:
            raise argparse.ArgumentTypeError(f"{name}: the target is a share of requests within (0, 1], not {value}")
        if name.strip() in targets:
            raise argparse.ArgumentTypeError(f"{name}: given twice")
        targets[name.strip()] = target
    return targets


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return value


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``whatif`` (and ``whatif plan``) to the ``inference-gateway`` command line."""
    whatif = subparsers.add_parser(
        "whatif",
        help="replay a recorded trace against a candidate policy; 'whatif plan' sizes the fleet",
        description="Replay a trace through the current and a candidate policy, side by side.",
        epilog=_FORMS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _stage_arguments(whatif)
    whatif.add_argument("--candidate", type=Path, help="the candidate policy YAML")
    whatif.add_argument("--engines", type=positive_int, help="engines per served model (default: one per backend)")
    whatif.set_defaults(func=_comparison_command)
    commands = whatif.add_subparsers(dest="whatif_command", metavar="[plan]", required=False)
    plan = commands.add_parser(
        "plan",
        help="the smallest fleet (and queue settings) meeting every class's SLO attainment target",
        description="Search the smallest number of engines that meets every class's attainment target.",
    )
    _stage_arguments(plan)
    plan.add_argument("--slo", type=parse_slo_targets, required=True, help="targets: interactive=0.99,batch=0.9")
    plan.add_argument("--max-engines", type=positive_int, default=DEFAULT_MAX_ENGINES)
    plan.add_argument("--no-queue-variants", action="store_true", help="keep the policy's queue settings as written")
    plan.set_defaults(func=_plan_command)
    record = commands.add_parser(
        "record",
        help="record a trace: a load-generator workload through the policy, staged on simulated engines",
        description="Record a gateway trace log of a workload run through POLICY staged on simulated engines.",
    )
    record.add_argument("--policy", type=Path, required=True, help="the policy YAML to record under")
    record.add_argument("--profile", required=True, help="simulated engine profile")
    record.add_argument("--engines", type=positive_int, help="engines per served model (default: one per backend)")
    record.add_argument(
        "--workload", type=Path, required=True, help="load-generator workload YAML (its tenants: the policy's)"
    )
    record.add_argument("--rate", type=positive_float, required=True, help="requests per second")
    record.add_argument("--duration", type=positive_float, required=True, help="seconds of arrivals")
    record.add_argument("--seed", type=int, default=0)
    record.add_argument("--out", type=Path, required=True, help="the trace file to write (must not exist)")
    record.add_argument("--port-base", type=int, default=DEFAULT_PORT_BASE, help="first loopback port of the stage")
    record.set_defaults(func=_record_command)


def _stage_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, help="trace: gateway trace log, load-generator records or minimal JSONL")
    parser.add_argument("--policy", type=Path, help="the (current) policy YAML")
    parser.add_argument("--profile", help="simulated engine profile (inference-gateway sim --help lists them)")
    parser.add_argument("--speed", type=positive_float, default=1.0, help="time compression: 4 replays 4x faster")
    parser.add_argument("--traffic", type=parse_traffic, default=1.0, help="arrival rate factor: x2 or 2")
    parser.add_argument("--repeats", type=positive_int, default=DEFAULT_REPEATS, help="runs per side (default 2)")
    parser.add_argument("--out", type=Path, help="output directory")
    parser.add_argument("--port-base", type=int, default=DEFAULT_PORT_BASE, help="first loopback port of the stages")


def missing_arguments(args: argparse.Namespace, required: tuple[tuple[str, str], ...]) -> list[str]:
    return [flag for dest, flag in required if getattr(args, dest, None) is None]


async def replay_alternating(
    trace: Trace,
    policies: Mapping[str, Path],
    settings: StageSettings,
    replayer: Replayer,
    *,
    repeats: int,
    work_dir: Path,
    port_base: int,
) -> dict[str, tuple[SideRun, ...]]:
    """Every side's repeats, interleaved (current r0, candidate r0, current r1, ...): drift of the
    machine over the runs (another job starting, a warmer CPU) then falls on every side alike
    instead of on whichever ran last."""
    runs: dict[str, list[SideRun]] = {side: [] for side in policies}
    for repeat in range(repeats):
        for side, policy in policies.items():
            run = await replayer(
                trace, policy, settings, side=side, repeat=repeat, work_dir=work_dir, port_base=port_base
            )
            runs[side].append(run)
    return {side: tuple(side_runs) for side, side_runs in runs.items()}


def _comparison_command(args: argparse.Namespace) -> int:
    missing = missing_arguments(args, _COMPARISON_REQUIRED)
    if missing:
        print(f"whatif: the following arguments are required: {', '.join(missing)}", file=sys.stderr)
        return USAGE_ERROR
    return _run(lambda: _comparison(args))


def _plan_command(args: argparse.Namespace) -> int:
    missing = missing_arguments(args, _PLAN_REQUIRED)
    if missing:
        print(f"whatif plan: the following arguments are required: {', '.join(missing)}", file=sys.stderr)
        return USAGE_ERROR
    return _run(lambda: _plan(args))


def _record_command(args: argparse.Namespace) -> int:
    return _guarded(lambda: _record(args))


def _record(args: argparse.Namespace) -> int:
    from loadtests.whatif.record import record_trace

    recording = record_trace(
        args.policy,
        args.workload,
        StageSettings(profile=args.profile, engines=args.engines),
        rate=args.rate,
        duration_s=args.duration,
        out=args.out,
        port_base=args.port_base,
        seed=args.seed,
    )
    print(f"{recording.trace}: {recording.requests} requests ({recording.sent} sent by the load generator)")
    return 0


def _run(command: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run a command on the load generator's loop (``_guarded``)."""
    from loadtests.loadgen.runner import run_sync

    return _guarded(lambda: run_sync(command))


def _guarded(command: Callable[[], int]) -> int:
    """Run a command; a bad trace, policy, workload or profile exits 2 with its message."""
    from gateway.policy.loader import PolicyError

    try:
        return command()
    except (OSError, ValueError, PolicyError) as exc:
        print(f"whatif: {exc}", file=sys.stderr)
        return USAGE_ERROR


def _read(args: argparse.Namespace) -> Trace:
    """The trace, scaled by ``--traffic``; a minimal trace's lines without a tenant or a model
    are the policy's first tenant's and first model's (a Mooncake trace names neither)."""
    from gateway.service import load_policy
    from loadtests.whatif.trace import read_trace

    policy = load_policy(args.policy).policy
    trace = read_trace(args.trace, default_tenant=policy.tenants[0].name, default_model=policy.models[0].name)
    if not trace.requests:
        raise ValueError(f"{args.trace}: no requests to replay")
    return trace if args.traffic == 1 else trace.scaled(args.traffic)


async def _comparison(args: argparse.Namespace) -> int:
    from loadtests.whatif.compare import compare
    from loadtests.whatif.replay import replay_side
    from loadtests.whatif.report import write_report

    trace = _read(args)
    settings = StageSettings(profile=args.profile, engines=args.engines, speed=args.speed)
    policies = dict(zip(SIDES, (args.policy, args.candidate), strict=True))
    if args.repeats < 2:
        print("whatif: one repeat per side: no difference can be flagged (no spread to judge it by)", file=sys.stderr)
    runs = await replay_alternating(
        trace,
        policies,
        settings,
        replay_side,
        repeats=args.repeats,
        work_dir=args.out / "runs",
        port_base=args.port_base,
    )
    comparison = compare(runs[SIDES[0]], runs[SIDES[1]])
    title = f"What-if: {args.candidate.name} against {args.policy.name}"
    path = write_report(
        comparison, args.out, title=title, settings=settings, trace=trace, traffic=args.traffic, policies=policies
    )
    print(path)
    for group, difference in comparison.flagged():
        print(f"  {group.name}: {difference.metric.label} {difference.verdict}")
    return 0


async def _plan(args: argparse.Namespace) -> int:
    from loadtests.whatif.plan import AS_WRITTEN, plan
    from loadtests.whatif.replay import replay_side
    from loadtests.whatif.report import answer_text, write_plan_report

    trace = _read(args)
    settings = StageSettings(profile=args.profile, engines=None, speed=args.speed)
    result = await plan(
        trace,
        args.policy,
        settings,
        args.slo,
        replay_side,
        work_dir=args.out / "runs",
        port_base=args.port_base,
        max_engines=args.max_engines,
        queue_variants=(AS_WRITTEN,) if args.no_queue_variants else QUEUE_VARIANTS,
        repeats=args.repeats,
    )
    title = f"Capacity plan: {args.policy.name}"
    path = write_plan_report(
        result, args.out, title=title, settings=settings, trace=trace, traffic=args.traffic, policy=args.policy
    )
    print(path)
    print(answer_text(result))
    return 0 if result.chosen is not None else 1
