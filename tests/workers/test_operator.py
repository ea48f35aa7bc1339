"""``/admin/rollout`` under ``serve --workers 2``: GET shows every worker, POST is one decision.

A real set (a supervisor and two workers) in front of two simulated engines, a model group with
a canary rollout, its state shared by the workers through the rollout directory's files or
through Redis. The runbook rolls a candidate back through the operator listener; under
``--workers`` that listener is the supervisor's, which used to answer 404.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.groups.test_canary import ADMIN_KEY, BASE_SCALE, GROUP, canary_policy, engine
from tests.limitstore.redis_server import REDIS_URL, drop_keys, unique_prefix
from tests.policy_builder import KEY_ACME, redis_state
from tests.servers import ChildServer, metric, serve_in_process, wait_until

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
START_S = 60.0


@pytest.fixture(params=["files", "redis"], ids=["state in the rollout directory", "state in Redis"])
def workers(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ChildServer]:
    """``serve --workers 2`` with a rollout in progress (its candidate at the first step)."""
    prefix = unique_prefix()
    state: dict[str, Any] = {"state": redis_state(REDIS_URL, prefix)} if request.param == "redis" else {}
    monkeypatch.setenv("GATEWAY_ROLLOUT_DIR", str(tmp_path / "rollouts"))
    with engine("a", BASE_SCALE) as base, engine("b", BASE_SCALE) as candidate:
        path = tmp_path / "policy.yaml"
        path.write_text(canary_policy(base, candidate, **state))
        argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--workers", "2"]
        try:
            with serve_in_process([*argv, "--port", "0", "--admin-port", "0", "--log-level", "info"], START_S) as set_:
                wait_until(lambda: len(views(set_)) == 2, START_S, what="both workers to show the rollout")
                yield set_
        finally:
            drop_keys(REDIS_URL, prefix)


def views(set_: ChildServer) -> list[str]:
    """Each answering worker's status of the rollout, from the supervisor's ``GET /admin/rollout``."""
    answer = httpx.get(f"{set_.admin_url}/admin/rollout", headers=ADMIN, timeout=15)
    assert answer.status_code in (200, 503), answer.text  # 503: a worker still starting
    if answer.status_code != 200:
        return []
    return [w["response"]["rollouts"][0]["state"]["status"] for w in answer.json()["workers"] if w["status"] == 200]


def order(set_: ChildServer, action: str, headers: Any = None, **fields: str) -> httpx.Response:
    body = {"group": GROUP, "action": action, "reason": "the runbook", **fields}
    sent = headers if headers is not None else {**ADMIN, "x-operator": "sre-on-call"}
    return httpx.post(f"{set_.admin_url}/admin/rollout", json=body, headers=sent, timeout=15)


def test_a_rollback_through_the_supervisor_is_one_decision_every_worker_follows(workers: ChildServer) -> None:
    before = views(workers)
    forced = order(workers, "rollback")
    wait_until(lambda: views(workers) == ["rolled_back", "rolled_back"], what="every worker to follow the rollback")
    decisions = metric(
        workers.admin_url, "gateway_rollout_decisions_total", group=GROUP, action="rollback", by="operator"
    )
    wrong = order(workers, "promote")
    assert before == ["progressing", "progressing"]
    assert forced.status_code == 200, forced.text
    assert forced.json()["state"]["status"] == "rolled_back"  # a single gateway's answer, as it came
    assert forced.json()["state"]["by"] == "operator:sre-on-call"
    assert decisions == 1, "the verdict must be taken once, by one worker"
    assert wrong.status_code == 400  # nothing to promote once rolled back: the worker's refusal, as it came
    assert wrong.json()["error"]["param"] == "action"


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({}, 401, "invalid_api_key"),  # a single gateway's answer to a missing admin key
        ({"authorization": f"Bearer {KEY_ACME}"}, 403, "not_admin"),
        ([("authorization", f"Bearer {ADMIN_KEY}"), ("authorization", f"Bearer {ADMIN_KEY}")], 400, "duplicate_header"),
    ],
    ids=["without a key", "with a tenant's key", "with two authorization headers"],
)
def test_an_order_the_worker_refuses_changes_nothing(
    workers: ChildServer, headers: Any, status: int, code: str
) -> None:
    refused = order(workers, "rollback", headers=headers)
    tenant_view = httpx.get(f"{workers.admin_url}/admin/rollout", headers={"authorization": f"Bearer {KEY_ACME}"})
    assert (refused.status_code, refused.json()["error"]["code"]) == (status, code)
    assert tenant_view.status_code == 403
    assert views(workers) == ["progressing", "progressing"]
