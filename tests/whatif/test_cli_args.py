"""``inference-gateway whatif`` and ``whatif plan``: both forms parse, bad arguments exit 2 with a
message naming them, and the sides' repeats alternate."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gateway.cli import build_parser, main
from loadtests.whatif.cli import parse_slo_targets, parse_traffic, replay_alternating
from loadtests.whatif.model import ReplayRequest, SideRun, StageSettings, Trace

COMPARISON = [
    "whatif", "--trace", "t.jsonl", "--policy", "current.yaml", "--candidate", "new.yaml", "--profile", "h100-llama8b",
    "--out", "out",
]  # fmt: skip
PLAN = [
    "whatif", "plan", "--trace", "t.jsonl", "--policy", "p.yaml", "--profile", "h100-llama8b",
    "--slo", "interactive=0.99,batch=0.9", "--out", "out",
]  # fmt: skip


def parse(argv: list[str]) -> argparse.Namespace:
    """Through the installed entry point, as ``inference-gateway`` does."""
    return build_parser("whatif").parse_args(argv)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Parse ``argv``, expect a usage error (exit 2), return what was printed."""
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def without(argv: list[str], flag: str) -> list[str]:
    i = argv.index(flag)
    return argv[:i] + argv[i + 2 :]


def test_the_comparison_form_has_no_sub_command_word() -> None:
    args = parse([*COMPARISON, "--engines", "3", "--speed", "4", "--traffic", "x2", "--repeats", "3"])
    assert args.whatif_command is None
    assert (args.trace, args.policy, args.candidate) == (Path("t.jsonl"), Path("current.yaml"), Path("new.yaml"))
    assert (args.profile, args.engines, args.speed, args.traffic, args.repeats) == ("h100-llama8b", 3, 4.0, 2.0, 3)
    assert args.out == Path("out")


def test_the_comparison_form_defaults() -> None:
    args = parse(COMPARISON)
    assert (args.engines, args.speed, args.traffic, args.repeats) == (None, 1.0, 1.0, 2)


def test_the_plan_form() -> None:
    args = parse([*PLAN, "--max-engines", "8", "--traffic", "3", "--speed", "10"])
    assert args.whatif_command == "plan"
    assert args.slo == {"interactive": 0.99, "batch": 0.9}
    assert (args.max_engines, args.traffic, args.speed, args.repeats) == (8, 3.0, 10.0, 2)
    assert args.no_queue_variants is False
    assert args.policy == Path("p.yaml")
    assert args.func is not parse(COMPARISON).func


@pytest.mark.parametrize(
    ("text", "factor"),
    [("x2", 2.0), ("2", 2.0), ("X0.5", 0.5), ("1.5", 1.5), (" x3 ", 3.0)],
    ids=["x2", "a bare 2", "a capital X and a fraction", "a bare fraction", "surrounding spaces"],
)
def test_traffic_factors(text: str, factor: float) -> None:
    assert parse_traffic(text) == factor


@pytest.mark.parametrize(
    "text", ["x0", "-1", "xx", "", "x", "inf", "nan", "2x"], ids=lambda t: f"traffic {t!r} is refused"
)
def test_a_bad_traffic_factor_is_a_usage_error(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused([*COMPARISON, "--traffic", text], capsys)
    assert "--traffic" in err
    assert "positive factor" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("interactive", "CLASS=TARGET"),
        ("=0.9", "CLASS=TARGET"),
        ("interactive=", "must be a number"),
        ("interactive=abc", "must be a number"),
        ("interactive=1.5", "within (0, 1]"),
        ("interactive=0", "within (0, 1]"),
        ("interactive=0.99,interactive=0.9", "given twice"),
        ("interactive=0.99,", "CLASS=TARGET"),
    ],
    ids=[
        "a class without a target",
        "a target without a class",
        "an empty target",
        "a target that is not a number",
        "a target above one",
        "a target of zero",
        "a class given twice",
        "a trailing comma",
    ],
)
def test_a_bad_slo_is_a_usage_error(text: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused([*without(PLAN, "--slo"), "--slo", text], capsys)
    assert "--slo" in err
    assert message in err


def test_slo_targets_keep_their_order() -> None:
    assert list(parse_slo_targets("batch=0.9, interactive=1")) == ["batch", "interactive"]


def test_plan_needs_slo_targets(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--slo" in refused(without(PLAN, "--slo"), capsys)


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--repeats", "0"), ("--speed", "0"), ("--speed", "fast"), ("--engines", "0"), ("--engines", "1.5")],
    ids=["no repeats", "no speed", "a speed that is not a number", "no engines", "a fraction of an engine"],
)
def test_bad_numbers_are_usage_errors(flag: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert flag in refused([*COMPARISON, flag, value], capsys)


def test_max_engines_must_be_at_least_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--max-engines" in refused([*PLAN, "--max-engines", "0"], capsys)


def test_the_plan_form_takes_no_candidate(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*PLAN, "--candidate", "new.yaml"])
    assert exit_.value.code == 2
    assert "--candidate" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--candidate", "--trace", "--policy", "--profile", "--out"])
def test_the_comparison_without_a_required_argument_exits_2_before_any_replay(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(without(COMPARISON, flag)) == 2
    err = capsys.readouterr().err
    assert "required" in err
    assert flag in err


def test_the_plan_without_its_trace_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(without(PLAN, "--trace")) == 2
    assert "--trace" in capsys.readouterr().err


async def test_the_sides_alternate_repeat_by_repeat(tmp_path: Path) -> None:
    order: list[tuple[str, int, Path, Path]] = []

    async def replayer(
        trace: Trace,
        policy: Path,
        settings: StageSettings,
        *,
        side: str,
        repeat: int,
        work_dir: Path,
        port_base: int,
    ) -> SideRun:
        order.append((side, repeat, policy, work_dir))
        return SideRun(side, repeat, (), 1.0, ())

    trace = Trace((ReplayRequest(0.0, "acme", None, "m", True, 10, 2, 64, ()),), "minimal")
    policies = {"current": Path("a.yaml"), "candidate": Path("b.yaml")}
    runs = await replay_alternating(
        trace, policies, StageSettings("fixed"), replayer, repeats=3, work_dir=tmp_path, port_base=19400
    )
    assert [(side, repeat) for side, repeat, _, _ in order] == [
        ("current", 0), ("candidate", 0), ("current", 1), ("candidate", 1), ("current", 2), ("candidate", 2),
    ]  # fmt: skip
    assert all(policy == policies[side] for side, _, policy, _ in order)
    # The replayer files a run under <work_dir>/<side>-r<repeat>: one work dir, distinct runs.
    assert {work_dir for *_, work_dir in order} == {tmp_path}
    assert [r.repeat for r in runs["candidate"]] == [0, 1, 2]
