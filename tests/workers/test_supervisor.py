"""The supervisor of ``serve --workers N`` (``gateway/workers/supervisor.py``): its restart rule, and
real processes (a supervisor, two workers) behaving as one gateway.

The processes: each test starts ``python -m gateway serve --workers 2`` as a child process against
the session's fake backend, drives it with the official SDK and raw HTTP, and finds the workers
through ``/proc``. One set serves the tests that leave it running; those that stop, kill or break
a process start their own. Every wait is a condition with a deadline.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.workers.supervisor import MAX_RESTART_DELAY_S, restart_delay
from loadtests.harness.processes import labelled, metrics
from tests.conftest import CHAT_MODEL, KEY_ACME, BackendServer
from tests.deploy.conftest import binary
from tests.fake_backend import FakeBackend
from tests.policy_builder import admin_keys, session_policy
from tests.server.test_lifecycle import Streamed
from tests.servers import ChildServer, metric, process_runs, serve_in_process, wait_until

# The restart rule


@pytest.mark.parametrize(
    ("quick_exits", "delay"),
    [
        pytest.param(1, 0.0, id="the first exit is restarted at once"),
        pytest.param(2, 1.0, id="the second quick exit waits a second"),
        pytest.param(3, 2.0, id="then twice as long"),
        pytest.param(6, 16.0, id="and so on"),
        pytest.param(7, MAX_RESTART_DELAY_S, id="up to the bound"),
        pytest.param(50, MAX_RESTART_DELAY_S, id="however often it died"),
    ],
)
def test_a_worker_that_keeps_dying_waits_longer_each_time(quick_exits: int, delay: float) -> None:
    assert restart_delay(quick_exits) == delay


# serve --workers 2: real processes behaving as one gateway


ADMIN_KEY = "admin-key-for-workers"
MESSAGES = [{"role": "user", "content": "Hello"}]
FREE_PORTS = ["--port", "0", "--admin-port", "0", "--log-level", "info"]
START_S = 60.0
"""Two interpreters importing the gateway on a loaded 2-core machine."""


PRICE_PER_HOUR = 2.5


def policy(backend_server: BackendServer, **sections: Any) -> str:
    """The session policy with an admin key and a priced backend; the file is not watched
    (SIGHUP and /admin/reload only)."""
    lifecycle = {"watch_interval_s": 0, "drain_timeout_s": 20}
    backends = {"fake": {"price_per_gpu_hour": PRICE_PER_HOUR, "gpus": 1}, **sections.pop("backends", {})}
    return session_policy(
        backend_server.url, admin=admin_keys(ADMIN_KEY), lifecycle=lifecycle, backends=backends, **sections
    )


@dataclass
class Workers:
    """A running set: the supervisor (``child``) and its workers' pids by index."""

    child: ChildServer
    policy_path: Path

    @property
    def url(self) -> str:
        return self.child.url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def admin(self) -> str:
        return self.child.admin_url

    def pids(self) -> dict[int, int]:
        """Worker index -> pid of the supervisor's live children, from ``/proc``."""
        return worker_pids(self.child.proc.pid)

    def admin_get(self, path: str, key: str | None = ADMIN_KEY) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.admin + path, headers=headers, timeout=15)

    def versions(self) -> list[str]:
        """The policy version each worker holds, from the supervisor's /admin/policy."""
        return [w["response"]["version"] for w in self.admin_get("/admin/policy").json()["workers"]]


def worker_pids(supervisor: int) -> dict[int, int]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == supervisor and fields[0] != "Z" and b"gateway.workers.child" in argv:
            found[int(argv[argv.index(b"gateway.workers.child") + 1])] = int(entry.name)
    return found


@contextmanager
def serve_workers(path: Path, *extra: str, workers: int = 2) -> Iterator[Workers]:
    """``serve --workers N`` on free ports until the block ends; every worker gone after it."""
    argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--workers", str(workers)]
    pids: set[int] = set()
    try:
        with serve_in_process([*argv, *FREE_PORTS, *extra], START_S) as child:
            running_set = Workers(child, path)
            wait_until(lambda: len(running_set.pids()) == workers, what="the workers in /proc")
            pids.update(running_set.pids().values())
            try:
                yield running_set
            finally:
                pids.update(running_set.pids().values())
    finally:
        wait_until(lambda: not any(process_runs(pid) for pid in pids), timeout=30, what="every worker to exit")


def ask(url: str) -> httpx.Response:
    """One chat completion on a new connection (so that the kernel hashes it to a worker afresh)."""
    return httpx.post(
        f"{url}/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY_ACME}"},
        json={"model": CHAT_MODEL, "messages": MESSAGES, "max_tokens": 4},
        timeout=30,
    )


def served(admin: str, worker: str) -> float:
    return metric(admin, "gateway_requests_total", worker=worker, status="200")


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory, backend_server: BackendServer) -> Path:
    path = tmp_path_factory.mktemp("workers") / "policy.yaml"
    path.write_text(policy(backend_server))
    return path


@pytest.fixture(scope="module")
def workers(policy_file: Path, backend_credential: str) -> Iterator[Workers]:
    with serve_workers(policy_file) as running_set:
        yield running_set


def test_requests_are_spread_over_both_workers_and_counted_by_worker(workers: Workers, backend: FakeBackend) -> None:
    before = {w: served(workers.admin, w) for w in ("0", "1")}
    for _ in range(40):
        reply = ask(workers.url)
        assert reply.status_code == 200
        assert not any("worker" in name or "worker" in value for name, value in reply.headers.items())
    after = {w: served(workers.admin, w) for w in ("0", "1")}
    gained = {w: after[w] - before[w] for w in after}
    assert sum(gained.values()) == 40
    assert all(n > 0 for n in gained.values()), f"one worker served everything: {gained}"
    salts = {r.body.get("cache_salt") for r in backend.received if r.path == "/v1/chat/completions"}
    assert len(salts) == 1, "the workers salt one tenant's prompts alike: the set shares the engine's cache"
    assert None not in salts


def test_the_merged_metrics_are_one_valid_exposition_with_each_family_once(workers: Workers) -> None:
    ask(workers.url)
    text = httpx.get(workers.admin + "/metrics", timeout=15).text
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))
    type_lines = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(type_lines) == len(set(type_lines))
    by_name = {f.name: f for f in families}
    worker_samples = [s for f in families if not f.name.startswith("gateway_worker") for s in f.samples]
    assert worker_samples
    assert all(s.labels["worker"] in ("0", "1") for s in worker_samples)
    assert {s.labels["worker"] for s in by_name["gateway_policy_info"].samples} == {"0", "1"}
    assert by_name["gateway_workers_alive"].samples[0].value == 2
    assert {s.labels["worker"]: s.value for s in by_name["gateway_worker_up"].samples} == {"0": 1.0, "1": 1.0}
    checked = subprocess.run(
        [binary("promtool"), "check", "metrics"], input=text, capture_output=True, text=True, timeout=30, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize(
    ("path", "key", "status", "code"),
    [
        pytest.param("/admin/policy", None, 401, "invalid_api_key", id="no admin key is refused by the set as by one"),
        pytest.param("/admin/policy", KEY_ACME, 403, "not_admin", id="a tenant key is refused by the set as by one"),
    ],
)
def test_the_admin_endpoints_check_the_admin_key_and_say_nothing_more(
    workers: Workers, path: str, key: str | None, status: int, code: str
) -> None:
    reply = workers.admin_get(path, key)
    assert reply.status_code == status
    assert reply.json()["error"]["code"] == code
    assert "workers" not in reply.json()


def test_sighup_and_admin_reload_apply_the_policy_file_in_every_worker(
    workers: Workers, backend_server: BackendServer
) -> None:
    original = workers.policy_path.read_text()
    try:
        assert workers.versions() == ["test-1", "test-1"]
        workers.policy_path.write_text(policy(backend_server, version="test-2"))
        workers.child.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: workers.versions() == ["test-2", "test-2"], what="both workers to reload on SIGHUP")
        workers.policy_path.write_text(policy(backend_server, version="test-3"))
        reloaded = admin_post(workers, "/admin/reload")
        assert reloaded.status_code == 200, reloaded.text
        assert [w["response"]["version"] for w in reloaded.json()["workers"]] == ["test-3", "test-3"]
        workers.policy_path.write_text("version: [not a policy")
        refused = admin_post(workers, "/admin/reload")
        assert refused.status_code == 422
        assert [(w["status"], w["response"]["version"]) for w in refused.json()["workers"]] == [(422, "test-3")] * 2
        assert workers.versions() == ["test-3", "test-3"]
        assert ask(workers.url).status_code == 200
    finally:
        workers.policy_path.write_text(original)
        admin_post(workers, "/admin/reload")


def admin_post(workers: Workers, path: str) -> httpx.Response:
    return httpx.post(workers.admin + path, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)


def test_the_set_exports_each_backends_price_once_not_once_per_worker(workers: Workers) -> None:
    prices = {
        dict(labels)["worker"]: value
        for labels, value in labelled(metrics(workers.admin), "gateway_cost_backend_price_dollars_per_hour").items()
    }
    assert prices == {"0": PRICE_PER_HOUR / 2, "1": PRICE_PER_HOUR / 2}


def test_the_probes_answer_for_every_worker(workers: Workers) -> None:
    assert workers.admin_get("/healthz", None).text == "ok"
    ready = workers.admin_get("/readyz", None)
    assert ready.status_code == 200
    assert [w["status"] for w in ready.json()["workers"]] == [200, 200]


def test_a_killed_worker_is_restarted_and_connections_queued_for_it_are_served(
    policy_file: Path, backend: FakeBackend, backend_credential: str
) -> None:
    with serve_workers(policy_file) as fresh:
        victim = fresh.pids()[0]
        os.kill(victim, signal.SIGSTOP)  # it accepts nothing more: connections hashed to it queue
        with ThreadPoolExecutor(12) as pool:
            replies = [pool.submit(ask, fresh.url) for _ in range(12)]
            wait_until(lambda: max(accept_queues(fresh.port)) > 0, what="connections queued for the stopped worker")
            os.kill(victim, signal.SIGKILL)
            statuses = [reply.result(timeout=60).status_code for reply in replies]
        assert statuses == [200] * 12, "a connection queued for the dead worker was not served by its replacement"
        wait_until(lambda: fresh.pids().get(0, victim) != victim, what="worker 0 to be restarted")
        assert metric(fresh.admin, "gateway_worker_restarts_total", worker="0") == 1
        assert metric(fresh.admin, "gateway_worker_restarts_total", worker="1") == 0
        wait_until(lambda: fresh.admin_get("/readyz", None).status_code == 200, what="the set to be ready again")
        assert served(fresh.admin, "0") > 0, "the replacement served what was queued for worker 0"
        logged = "worker 0 was killed by SIGKILL; restarting it in 0s (restart 1)"
        assert any(logged in line for line in fresh.child.lines)


def accept_queues(port: int) -> list[int]:
    """The accept queue's length of each socket listening on ``port`` (``/proc/net/tcp``)."""
    lengths = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        _, local, _, state, queues = line.split()[:5]
        if state == "0A" and int(local.split(":")[1], 16) == port:
            lengths.append(int(queues.split(":")[1], 16))
    return lengths or [0]


def test_a_worker_sent_sigterm_alone_drains_and_is_replaced_while_the_set_serves(
    policy_file: Path, backend: FakeBackend, backend_credential: str
) -> None:
    with serve_workers(policy_file) as fresh:
        leaving = fresh.pids()[1]
        os.kill(leaving, signal.SIGTERM)
        wait_until(lambda: fresh.pids().get(1, leaving) != leaving, what="worker 1 to be replaced")
        assert not process_runs(leaving)
        assert any("worker 1 drained on its own: releasing it" in line for line in fresh.child.lines)
        assert metric(fresh.admin, "gateway_worker_restarts_total", worker="1") == 1
        wait_until(lambda: fresh.admin_get("/readyz", None).status_code == 200, what="the set to be ready again")
        assert [ask(fresh.url).status_code for _ in range(8)] == [200] * 8
        assert fresh.child.proc.poll() is None


def test_sigterm_drains_a_stream_in_flight_in_every_worker_then_exits_zero(
    policy_file: Path, backend: FakeBackend, backend_credential: str
) -> None:
    with serve_workers(policy_file) as fresh:
        gate = threading.Event()
        backend.gate, backend.tokens = gate, 3
        streamed = Streamed()
        streamer = threading.Thread(target=streamed.run, args=(fresh.url,), name="streamer")
        streamer.start()
        try:
            wait_until(lambda: bool(streamed.chunks) or streamed.ended, what="the first token")
            assert streamed.chunks, streamed.error
            fresh.child.proc.send_signal(signal.SIGTERM)
            assert fresh.admin_get("/readyz", None).json() == {"ready": False, "reason": "draining"}
            wait_until(
                lambda: sum("gateway.server.lifecycle draining" in line for line in fresh.child.lines) == 2,
                what="both workers to drain",
            )
            wait_until(
                lambda: sum("waiting for the other workers" in line for line in fresh.child.lines) == 1,
                what="the idle worker to wait for the other",
            )
            # New connections reach both workers' sockets: every one is answered, none refused or reset.
            refused = [ask(fresh.url) for _ in range(12)]
            assert {(r.status_code, r.json()["error"]["code"]) for r in refused} == {(503, "draining")}
            assert fresh.child.proc.poll() is None, "the set must wait for the stream in flight"
        finally:
            backend.gate = None
            gate.set()
            streamer.join(30)
        assert streamed.error is None
        assert streamed.chunks == [" t0", " t1", " t2"], "the stream in flight was cut"
        assert fresh.child.proc.wait(timeout=30) == 0, fresh.child.stderr()
        assert any("every worker has exited" in line for line in fresh.child.lines)


def test_workers_whose_supervisor_is_killed_drain_and_exit(policy_file: Path, backend_credential: str) -> None:
    with serve_workers(policy_file) as fresh:
        pids = fresh.pids()
        fresh.child.proc.kill()
        wait_until(lambda: not any(process_runs(pid) for pid in pids.values()), timeout=30, what="the orphans to exit")


def test_a_set_whose_workers_cannot_start_exits_one(
    tmp_path: Path, backend_server: BackendServer, backend_credential: str
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy(backend_server, backends={"fake": {"credential_env": "GATEWAY_TEST_UNSET_CREDENTIAL"}}))
    argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--workers", "2"]
    result = subprocess.run([*argv, *FREE_PORTS], capture_output=True, text=True, timeout=START_S)
    assert result.returncode == 1, result.stderr
    assert "a worker could not start: stopping the others" in result.stderr
    assert "GATEWAY_TEST_UNSET_CREDENTIAL" in result.stderr


@pytest.mark.parametrize(
    ("argv", "env", "children"),
    [
        pytest.param(
            ["--workers", "1"],
            {"GATEWAY_WORKERS": "2"},
            0,
            id="workers 1 is one process, whatever GATEWAY_WORKERS says",
        ),
        pytest.param([], {"GATEWAY_WORKERS": "2"}, 2, id="GATEWAY_WORKERS starts a supervisor and its workers"),
    ],
)
def test_the_number_of_workers_decides_the_process_model(
    policy_file: Path, backend_credential: str, argv: list[str], env: dict[str, str], children: int
) -> None:
    serve = [sys.executable, "-m", "gateway", "serve", "--policy", str(policy_file), *argv]
    with _environment(env), serve_in_process([*serve, *FREE_PORTS]) as child:
        wait_until(lambda: len(worker_pids(child.proc.pid)) == children, what=f"{children} workers")
        assert ask(child.url).status_code == 200
        text = httpx.get(child.admin_url + "/metrics", timeout=15).text
        assert ('worker="0"' in text) == (children > 0)
        assert any("[supervisor]" in line for line in child.lines) == (children > 0)
        assert any(" of 2 serving: API on" in line for line in child.lines) == (children > 0)
        pids = worker_pids(child.proc.pid)
        child.proc.send_signal(signal.SIGTERM)
        assert child.proc.wait(timeout=30) == 0
        wait_until(lambda: not any(process_runs(pid) for pid in pids.values()), what="every worker to exit")


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in values.items():
            patch.setenv(name, value)
        yield


def test_the_api_port_is_the_sets_while_it_runs(workers: Workers) -> None:
    with socket.socket() as intruder, pytest.raises(OSError, match="Address already in use"):
        intruder.bind(("127.0.0.1", workers.port))
