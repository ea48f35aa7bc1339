"""Replaying a trace through a real gateway and simulated engines: every request accounted for,
classes and SLOs as the gateway has them, time compression, session pacing, refusals by reason,
and a roofline engine's prefix cache showing in TTFT."""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from loadtests.loadgen.runner import run_sync
from loadtests.whatif.model import ReplayRequest, SideRun, StageSettings, Trace
from loadtests.whatif.replay import replay_on, replay_side, run_side
from loadtests.whatif.stage import StageError, StagePlan, running, stage_policy
from tests.whatif.conftest import BLOCK_TOKENS, request

WritePolicy = Callable[..., Path]
Ports = Callable[[int], int]
FIXED_TTFT_S, FIXED_ITL_S = 0.05, 0.01
"""The ``fixed`` profile's delays (``loadtests/sim/profiles.py``)."""


def trace_of(*requests: ReplayRequest) -> Trace:
    return Trace(tuple(requests), "minimal")


def replay(trace: Trace, policy: Path, tmp_path: Path, ports: Ports, **settings: object) -> SideRun:
    staged = StageSettings(**{"profile": "fixed", "engines": 1, **settings})  # type: ignore[arg-type]
    return run_side(trace, policy, staged, side="current", repeat=0, work_dir=tmp_path, port_base=ports(3))


def test_every_request_gets_a_record_in_the_class_the_gateway_serves_it_in(
    write_policy: WritePolicy, tmp_path: Path, ports: Ports
) -> None:
    slos = {"interactive": {"ttft_ms": 20, "itl_ms": 50, "e2e_ms": 30000}}
    policy = write_policy(classes={"interactive": {"slo": slos["interactive"]}})
    trace = trace_of(
        request(0.00, tenant="acme"),  # no class: acme's default, interactive
        request(0.05, tenant="acme", class_name="batch"),  # a lower class is granted
        request(0.10, tenant="globex", class_name="interactive"),  # a higher one is not: batch
        request(0.15, tenant="acme", class_name="gold"),  # unknown to the policy: not sent
        request(0.20, tenant="acme", stream=False),
        request(0.25, tenant="globex", stream=False, output_tokens=5),
    )
    run = replay(trace, policy, tmp_path, ports)
    assert [r.extra["trace_index"] for r in run.records] == list(range(6))
    assert [r.class_name for r in run.records] == [
        "interactive",
        "batch",
        "batch",
        "interactive",
        "interactive",
        "batch",
    ]
    assert [r.status for r in run.records] == [200] * 6
    assert [r.tokens_out for r in run.records] == [8, 8, 8, 8, 8, 5]
    assert [r.tokens_in for r in run.records] == [64] * 6
    for record in run.records:
        assert record.ttft_s is not None
        assert FIXED_TTFT_S <= record.ttft_s < 0.5
    # The gateway's goodput rule: an interactive stream misses its 20 ms TTFT objective; a whole
    # answer is judged on E2E alone, and batch's objectives are loose.
    assert [r.slo_met for r in run.records] == [False, True, True, False, True, True]
    assert run.rejections == {}
    assert sum(e.requests for e in run.engines) == 6
    assert run.engines[0].busy_fraction > 0
    assert run.elapsed_s >= 0.25


def test_a_trace_naming_a_tenant_the_policy_lacks_is_refused_before_anything_starts(
    write_policy: WritePolicy, tmp_path: Path, ports: Ports
) -> None:
    with pytest.raises(StageError, match="tenants not in the policy: initech"):
        replay(trace_of(request(0.0, tenant="initech")), write_policy(), tmp_path, ports)


@contextmanager
def stages(*plans: StagePlan) -> Iterator[None]:
    """Start every plan's processes at once (threads), stop them all at the end."""
    with ExitStack() as stack:
        errors: list[BaseException] = []

        def start(plan: StagePlan) -> None:
            try:
                stack.enter_context(running(plan))
            except BaseException as exc:  # re-raised below, in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(plan,)) for plan in plans]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        yield


def timed_replay(trace: Trace, plan: StagePlan) -> tuple[SideRun, float]:
    start = time.perf_counter()
    run = run_sync(lambda: replay_on(trace, plan, side=f"speed-{plan.speed:g}", repeat=0))
    return run, time.perf_counter() - start


def test_speed_4_replays_four_times_faster_and_keeps_trace_time_latencies(
    write_policy: WritePolicy, tmp_path: Path, ports: Ports
) -> None:
    """Tolerances: wall time at least 3x shorter (4x less the fixed costs of starting and
    draining); trace-time TTFT P50 within 30% (or 20 ms) of speed 1's: the gateway's and the
    client's own real milliseconds (about 3 here) are multiplied by the speed too, so speed 4
    adds about 3 x 3 ms to a 50 ms TTFT."""
    policy = write_policy()
    trace = trace_of(*(request(i * 0.125, tenant=("acme", "globex")[i % 2], output_tokens=10) for i in range(16)))
    slow, fast = (
        stage_policy(
            policy, StageSettings("fixed", engines=1, speed=k), work_dir=tmp_path / f"x{k}", port_base=ports(3)
        )
        for k in (1.0, 4.0)
    )
    with stages(slow, fast):
        at_1, wall_1 = timed_replay(trace, slow)
        at_4, wall_4 = timed_replay(trace, fast)
    assert wall_1 > 1.875
    assert wall_4 < wall_1 / 3
    ttft_1 = statistics.median(r.ttft_s or 0.0 for r in at_1.records)
    ttft_4 = statistics.median(r.ttft_s or 0.0 for r in at_4.records)
    assert abs(ttft_4 - ttft_1) <= max(0.3 * ttft_1, 0.02), (ttft_1, ttft_4)
    assert abs(at_4.elapsed_s - at_1.elapsed_s) <= 0.25 * at_1.elapsed_s
    e2e_4 = statistics.median(r.e2e_s or 0.0 for r in at_4.records)
    assert e2e_4 >= FIXED_TTFT_S + 9 * FIXED_ITL_S  # simulated durations are back in trace time


def test_a_turn_is_never_sent_before_its_previous_turn_ended_and_its_think_time_passed(
    write_policy: WritePolicy, tmp_path: Path, ports: Ports
) -> None:
    think_s = 0.3
    turns = [request(0.0, session="s1", think_s=None if i == 0 else think_s, output_tokens=10) for i in range(4)]
    loose = request(0.0, tenant="globex", session="s2")  # another session: open loop
    run = replay(trace_of(*turns, loose), write_policy(), tmp_path, ports, speed=2.0)
    records = run.records
    for before, after in itertools.pairwise(records[:4]):
        ended = before.extra["sent_offset_s"] + (before.e2e_s or 0.0)
        gap = after.extra["sent_offset_s"] - ended
        assert think_s - 0.01 <= gap < think_s + 0.2, gap
    assert records[4].extra["sent_offset_s"] < 0.1
    assert all(r.status == 200 for r in records)


def test_refusals_are_counted_by_reason_and_match_the_records(
    write_policy: WritePolicy, tmp_path: Path, ports: Ports
) -> None:
    policy = write_policy(
        tenants={"acme": {"limits": {"rpm": 2}}},
        backends={"sim-a": {"capacity": {"max_concurrent": 1}}},
        classes={"batch": {"queue": {"max_depth": 1, "max_wait_s": 60}}},
    )
    acme = [request(0.0, tenant="acme") for _ in range(5)]
    globex = [request(1.0, tenant="globex", output_tokens=30) for _ in range(5)]
    run = replay(trace_of(*acme, *globex), policy, tmp_path, ports)
    assert len(run.records) == 10
    refused = Counter(r.error for r in run.records if r.status != 200)
    assert run.rejections == dict(refused)
    assert run.rejections["tenant_rate_limited"] == 3
    assert sum(n for reason, n in run.rejections.items() if reason != "tenant_rate_limited") >= 1
    assert [r.status for r in run.records[5:]].count(200) >= 2
    assert not any(r.slo_met for r in run.records if r.status != 200)


def test_on_a_roofline_engine_a_cached_head_shortens_the_prefill(
    write_policy: WritePolicy, tmp_path: Path, ports: Ports
) -> None:
    """One tenant sends seven turns sharing 112 blocks (1,792 tokens) of 2,000-token prompts, one
    after another (paced by their session): on the roofline model the first prefills them all,
    the next ones only their tail, so their TTFT is under half of the first's."""
    head = tuple(f"{i:016x}" for i in range(112))
    turns = [
        request(0.0, prompt_tokens=2000, hashes=head, session="s", think_s=None if i == 0 else 0.0, output_tokens=4)
        for i in range(7)
    ]
    policy = write_policy(models={"sim-model": {"max_prompt_tokens": 8192}})
    run = replay(trace_of(*turns), policy, tmp_path, ports, profile="llama-3.1-8b-h100", speed=2.0)
    first, rest = run.records[0], run.records[1:]
    assert all(r.status == 200 for r in run.records)
    assert first.cached_tokens == 0
    assert all((r.cached_tokens or 0) >= len(head) * BLOCK_TOKENS for r in rest)
    cold = first.ttft_s or 0.0
    assert statistics.median(r.ttft_s or 0.0 for r in rest) < 0.5 * cold, [r.ttft_s for r in run.records]
    assert run.prefix_hit_rate is not None
    assert run.prefix_hit_rate > 0.7
    assert run.engines[0].requests == 7


def test_a_request_still_running_at_the_drain_deadline_is_recorded_as_cancelled(
    write_policy: WritePolicy, tmp_path: Path, ports: Ports
) -> None:
    trace = trace_of(request(0.0, output_tokens=4), request(0.0, tenant="globex", output_tokens=250))
    settings = StageSettings("fixed", engines=1)
    run = run_sync(
        lambda: replay_side(
            trace,
            write_policy(),
            settings,
            side="current",
            repeat=0,
            work_dir=tmp_path,
            port_base=ports(2),
            drain_timeout_s=0.5,
        )
    )
    assert [(r.status, r.error) for r in run.records] == [(200, None), (0, "cancelled_at_end")]
    assert not run.records[1].slo_met
