"""What a worker is told (``gateway/workers/spec.py``) and the settings that choose the process model."""

from __future__ import annotations

import pytest

from gateway.settings import Settings
from gateway.workers.spec import WorkerSpec, worker_settings


def test_a_worker_gets_its_index_the_sets_port_its_own_loopback_listener_and_a_share_of_the_bounds() -> None:
    settings = Settings(
        policy_path="p.yaml", host="0.0.0.0", port=0, admin_host="0.0.0.0", workers=3, max_connections=10000
    )
    worker = worker_settings(settings, 2, port=8080, admin_port=41000)
    assert (worker.worker_index, worker.workers) == (2, 3)
    assert (worker.host, worker.port) == ("0.0.0.0", 8080)
    assert (worker.admin_host, worker.admin_port) == ("127.0.0.1", 41000)
    assert worker.max_connections == 3334
    assert worker.max_upstream_connections == 334
    assert worker.policy_path == "p.yaml"


def test_the_spec_travels_whole() -> None:
    settings = Settings(policy_path="p.yaml", workers=2, worker_index=1, trace_log_path=None, body_timeout_s=2.5)
    spec = WorkerSpec(settings=settings, api_fd=5, admin_fd=6, lifeline_fd=7)
    assert WorkerSpec.decode(spec.encode()) == spec


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"workers": 0}, "workers must be at least 1, not 0", id="no workers is refused"),
        pytest.param({"workers": 2, "worker_index": 2}, "worker_index must be in 0..1, not 2", id="an index past N"),
        pytest.param({"worker_index": -1}, "worker_index must be in 0..0, not -1", id="a negative index"),
    ],
)
def test_settings_refuse_an_impossible_set(fields: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings(policy_path="p.yaml", **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("env", "flag", "workers"),
    [
        pytest.param(None, None, 1, id="one process by default"),
        pytest.param("4", None, 4, id="GATEWAY_WORKERS sets it"),
        pytest.param("4", 2, 2, id="the flag wins over the variable"),
    ],
)
def test_the_number_of_workers_comes_from_the_flag_or_the_environment(
    monkeypatch: pytest.MonkeyPatch, env: str | None, flag: int | None, workers: int
) -> None:
    if env is None:
        monkeypatch.delenv("GATEWAY_WORKERS", raising=False)
    else:
        monkeypatch.setenv("GATEWAY_WORKERS", env)
    assert Settings.from_env(workers=flag).workers == workers


def test_a_workers_variable_that_is_not_a_number_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_WORKERS", "two")
    with pytest.raises(ValueError, match="GATEWAY_WORKERS='two': not a valid int"):
        Settings.from_env()
