"""The canary decides by itself: real simulated engines, real traffic, real gateway processes.

A candidate with twice the baseline's step time (the same engine profile at twice the time
scale) or one that fails (fault injection) is rolled back automatically; a candidate as good as
the baseline is promoted to 100%. A rollback holds across a restart (the state file) and across
replicas (Redis): two gateway processes share one verdict and follow it. Each test prints its
figures (requests to the candidate before the verdict, time to verdict) with ``-s``.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtests.sim import build_engine_app
from tests.conftest import StartGateway
from tests.limitstore.redis_server import REDIS_URL, drop_keys, unique_prefix
from tests.policy_builder import KEY_ACME, admin_keys, backend, build_policy, model, redis_state, tenant
from tests.servers import admin_url, metric, serve_in_process, serve_in_thread, wait_until

GROUP = "llama"
ADMIN_KEY = "admin-key-canary"
PROFILE = "llama-3.1-8b-h100"
BASE_SCALE = 0.5
INTERVAL_S = 0.5
STEPS = (20, 50, 100)


@contextmanager
def engine(name: str, time_scale: float) -> Iterator[str]:
    with serve_in_thread(build_engine_app(PROFILE, model=f"served-{name}", time_scale=time_scale)) as url:
        yield url


def canary_policy(baseline_url: str, candidate_url: str, **sections: Any) -> str:
    return build_policy(
        version="canary-1",
        models=[
            model("v1", upstream_name="served-a", max_prompt_tokens=4096, max_output_tokens=512),
            model("v2", upstream_name="served-b", max_prompt_tokens=4096, max_output_tokens=512),
        ],
        backends=[
            backend("engine-a", baseline_url, ["v1"], kind="sim"),
            backend("engine-b", candidate_url, ["v2"], kind="sim"),
        ],
        model_groups=[
            {
                "name": GROUP,
                "targets": [{"model": "v1"}, {"model": "v2"}],
                "rollout": {
                    "baseline": "v1",
                    "candidate": "v2",
                    "steps": list(STEPS),
                    "interval_s": INTERVAL_S,
                    "min_requests": 20,
                },
            }
        ],
        tenants=[tenant("acme", KEY_ACME)],
        admin=admin_keys(ADMIN_KEY),
        retry={"max_retries": 0},
        breaker={"consecutive_failures": None, "failure_ratio": None},
        **sections,
    )


@dataclass
class Load:
    """Streams sent without pause by a few threads, until ``stop``; counts by target."""

    url: str
    threads: int = 4
    stop: threading.Event = field(default_factory=threading.Event)
    targets: dict[str, int] = field(default_factory=dict)
    statuses: dict[int, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                body = {
                    "model": GROUP,
                    "messages": [{"role": "user", "content": "Tell me about canaries."}],
                    "max_tokens": 8,
                    "stream": True,
                }
                headers = {"authorization": f"Bearer {KEY_ACME}"}
                with client.stream("POST", f"{self.url}/v1/chat/completions", json=body, headers=headers) as answer:
                    for _ in answer.iter_bytes():
                        pass
                    with self._lock:
                        target = answer.headers.get("x-gateway-target", "-")
                        self.targets[target] = self.targets.get(target, 0) + 1
                        self.statuses[answer.status_code] = self.statuses.get(answer.status_code, 0) + 1

    @contextmanager
    def running(self) -> Iterator[Load]:
        workers = [threading.Thread(target=self.run, daemon=True) for _ in range(self.threads)]
        for worker in workers:
            worker.start()
        try:
            yield self
        finally:
            self.stop.set()
            for worker in workers:
                worker.join(timeout=30)


def rollout(url: str) -> dict[str, Any]:
    answer = httpx.get(f"{url}/admin/rollout", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=5)
    answer.raise_for_status()
    rollouts: list[dict[str, Any]] = answer.json()["rollouts"]
    return rollouts[0]


def status(url: str) -> str:
    state = rollout(url)["state"]
    return "-" if state is None else str(state["status"])


def engine_requests(engine_url: str) -> float:
    return sum(
        metric(engine_url, "vllm:request_success_total", finished_reason=reason)
        for reason in ("length", "stop", "abort")
    ) + metric(engine_url, "sim:faults_injected_total", mode="fail_503")


def sent_to_candidate_after(gateway: str, candidate_url: str, requests: int) -> float:
    """Requests the candidate's engine gets while ``requests`` more are sent (nothing in flight)."""
    before = engine_requests(candidate_url)
    body = {"model": GROUP, "messages": [{"role": "user", "content": "after"}], "max_tokens": 2}
    for _ in range(requests):
        httpx.post(
            f"{gateway}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY_ACME}"}, timeout=30
        )
    return engine_requests(candidate_url) - before


def watch_until(url: str, wanted: str, timeout: float) -> float:
    """Seconds until the rollout reaches ``wanted``; fails (with the rollout) after ``timeout``."""
    start = time.monotonic()
    try:
        wait_until(lambda: status(url) in (wanted, "rolled_back", "promoted"), timeout=timeout, what=wanted)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {rollout(url)}") from None
    assert status(url) == wanted, rollout(url)
    return time.monotonic() - start


def test_a_candidate_with_twice_the_step_time_is_rolled_back(start_gateway: StartGateway, tmp_path: Path) -> None:
    with engine("a", BASE_SCALE) as base, engine("b", 2 * BASE_SCALE) as slow:
        text = canary_policy(base, slow)
        with start_gateway(text, health_checks=False, rollout_dir=str(tmp_path)) as url:
            admin = admin_url(url)
            with Load(url).running() as load:
                seconds = watch_until(admin, "rolled_back", timeout=90)
                to_candidate = engine_requests(slow)
            verdict = rollout(admin)
            after = sent_to_candidate_after(url, slow, 40)
            percent = metric(admin, "gateway_rollout_candidate_percent", group=GROUP, candidate="v2")
        # A restart with the same state directory resumes rolled back: nothing to the candidate.
        with start_gateway(text, health_checks=False, rollout_dir=str(tmp_path)) as again:
            restarted = status(admin_url(again))
            after_restart = sent_to_candidate_after(again, slow, 20)
    print(
        f"\n2x step time: rolled back after {seconds:.1f}s, {to_candidate:.0f} requests to the candidate "
        f"(of {sum(load.targets.values())}); {verdict['state']['reason']}"
    )
    assert verdict["state"]["by"] == "canary"
    assert "slow" in verdict["state"]["reason"] or "slo" in verdict["state"]["reason"]
    assert after == 0
    assert percent == 0
    assert restarted == "rolled_back"
    assert after_restart == 0


def test_a_failing_candidate_is_rolled_back(start_gateway: StartGateway, tmp_path: Path) -> None:
    with engine("a", BASE_SCALE) as base, engine("b", BASE_SCALE) as failing:
        httpx.post(f"{failing}/admin/fault", json={"mode": "fail_503"}).raise_for_status()
        with start_gateway(canary_policy(base, failing), health_checks=False, rollout_dir=str(tmp_path)) as url:
            admin = admin_url(url)
            with Load(url).running() as load:
                seconds = watch_until(admin, "rolled_back", timeout=60)
                to_candidate = engine_requests(failing)
            verdict = rollout(admin)
            after = sent_to_candidate_after(url, failing, 40)
    print(
        f"\nfailing (503): rolled back after {seconds:.1f}s, {to_candidate:.0f} requests to the candidate "
        f"(of {sum(load.targets.values())}); {verdict['state']['reason']}"
    )
    assert after == 0
    assert load.statuses.get(503, 0) <= to_candidate  # only the candidate's requests failed


def test_a_healthy_candidate_is_promoted_to_all_the_traffic(start_gateway: StartGateway, tmp_path: Path) -> None:
    with (
        engine("a", BASE_SCALE) as base,
        engine("b", BASE_SCALE) as healthy,
        start_gateway(canary_policy(base, healthy), health_checks=False, rollout_dir=str(tmp_path)) as url,
    ):
        admin = admin_url(url)
        with Load(url).running() as load:
            seconds = watch_until(admin, "promoted", timeout=120)
        history = rollout(admin)["history"]
        baseline_before = engine_requests(base)
        after = sent_to_candidate_after(url, healthy, 20)
        baseline_after = engine_requests(base)
    print(f"\nhealthy: promoted to 100% after {seconds:.1f}s, {sum(load.targets.values())} requests; {history}")
    assert [h["action"] for h in history] == ["promote", "complete"]
    assert after == 20
    assert baseline_after == baseline_before


def test_an_operator_forces_a_rollback_and_a_resume(start_gateway: StartGateway, tmp_path: Path) -> None:
    with (
        engine("a", BASE_SCALE) as base,
        engine("b", BASE_SCALE) as candidate,
        start_gateway(canary_policy(base, candidate), health_checks=False, rollout_dir=str(tmp_path)) as url,
    ):
        admin = admin_url(url)
        headers = {"authorization": f"Bearer {ADMIN_KEY}", "x-operator": "sre-on-call"}
        forced = httpx.post(
            f"{admin}/admin/rollout",
            json={"group": GROUP, "action": "rollback", "reason": "pager"},
            headers=headers,
        )
        after = sent_to_candidate_after(url, candidate, 20)
        wrong = httpx.post(f"{admin}/admin/rollout", json={"group": GROUP, "action": "promote"}, headers=headers)
        unknown = httpx.post(f"{admin}/admin/rollout", json={"group": "nope", "action": "hold"}, headers=headers)
        tenant_key = httpx.get(f"{admin}/admin/rollout", headers={"authorization": f"Bearer {KEY_ACME}"})
        resumed = httpx.post(f"{admin}/admin/rollout", json={"group": GROUP, "action": "resume"}, headers=headers)
        decisions = metric(
            admin, "gateway_rollout_decisions_total", group=GROUP, candidate="v2", action="rollback", by="operator"
        )
    assert forced.status_code == 200, forced.text
    assert forced.json()["state"]["status"] == "rolled_back"
    assert forced.json()["state"]["by"] == "operator:sre-on-call"
    assert after == 0
    assert wrong.status_code == 400
    assert wrong.json()["error"]["param"] == "action"
    assert unknown.status_code == 404
    assert tenant_key.status_code == 403
    assert resumed.json()["state"]["status"] == "progressing"
    assert resumed.json()["candidate_percent"] == STEPS[0]
    assert decisions == 1


def test_two_replicas_share_one_verdict_through_redis() -> None:
    prefix = unique_prefix()
    with ExitStack() as stack:
        base = stack.enter_context(engine("a", BASE_SCALE))
        slow = stack.enter_context(engine("b", 2 * BASE_SCALE))
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        path = folder / "policy.yaml"
        path.write_text(canary_policy(base, slow, state=redis_state(REDIS_URL, prefix)))
        argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--port", "0", "--admin-port", "0"]
        one = stack.enter_context(serve_in_process([*argv, "--log-level", "info"]))
        two = stack.enter_context(serve_in_process([*argv, "--log-level", "info"]))
        stack.callback(drop_keys, REDIS_URL, prefix)
        with Load(one.url, threads=2).running(), Load(two.url, threads=2).running():
            seconds = watch_until(one.admin_url, "rolled_back", timeout=90)
            followed = watch_until(two.admin_url, "rolled_back", timeout=3 * INTERVAL_S + 2)
        judges = {
            name: metric(
                child.admin_url,
                "gateway_rollout_decisions_total",
                group=GROUP,
                candidate="v2",
                action="rollback",
                by="canary",
            )
            for name, child in (("one", one), ("two", two))
        }
        after = sent_to_candidate_after(one.url, slow, 20) + sent_to_candidate_after(two.url, slow, 20)
    print(f"\ntwo replicas: rolled back after {seconds:.1f}s, the other followed {followed:.2f}s later; {judges}")
    assert sum(judges.values()) == 1  # one verdict, taken by the lease holder, on both replicas' counts
    assert after == 0
