"""Hot reload (file change, admin endpoint) and graceful drain on SIGTERM, with real processes."""

from __future__ import annotations

import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import CHAT_MODEL, KEY_ACME, BackendServer, metric
from tests.fake_backend import FakeBackend
from tests.policy_builder import admin_keys, session_policy
from tests.servers import admin_url, serve_gateway_in_thread, serve_in_process, wait_until

ADMIN_KEY = "admin-key-for-tests"

MESSAGES = [{"role": "user", "content": "Hello"}]


def policy(backend_server: BackendServer, **sections: Any) -> str:
    """The session policy with an admin key and a policy file watched every 50 ms, edited by ``sections``."""
    lifecycle = {"watch_interval_s": 0.05, "drain_timeout_s": 20}
    return session_policy(backend_server.url, admin=admin_keys(ADMIN_KEY), lifecycle=lifecycle, **sections)


@pytest.fixture
def policy_path(tmp_path: Path, backend_server: BackendServer) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(policy(backend_server))
    return path


@pytest.fixture
def gateway(policy_path: Path) -> object:
    from gateway.service import load_policy
    from gateway.settings import Settings

    settings = Settings(policy_path=str(policy_path), port=0, admin_port=0)
    with serve_gateway_in_thread(settings, load_policy(policy_path)) as built:
        yield built.api_url


def admin(url: str, method: str, path: str, key: str | None = ADMIN_KEY) -> httpx.Response:
    """``path`` on the operator listener of the gateway serving ``url``."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.request(method, admin_url(url) + path, headers=headers)


def test_an_invalid_policy_written_over_the_live_file_is_refused_and_the_old_one_keeps_serving(
    gateway: str, policy_path: Path, backend: FakeBackend, backend_server: BackendServer
) -> None:
    policy_path.write_text(policy(backend_server, tenants={"acme": {"limits": {"rpm": 0}}}))
    wait_until(lambda: admin(gateway, "GET", "/admin/policy").json()["reloads"]["invalid"] == 1, what="the reload")
    status = admin(gateway, "GET", "/admin/policy").json()
    assert status["version"] == "test-1"
    assert re.search(
        r"policy\.yaml:\d+:\d+: tenants\[acme\]\.limits\.rpm: must be greater than 0", status["last_error"]
    )
    assert metric(gateway, "gateway_policy_reloads", result="invalid") == 1
    reply = httpx.post(
        f"{gateway}/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY_ACME}"},
        json={"model": CHAT_MODEL, "messages": MESSAGES},
    )
    assert reply.status_code == 200
    policy_path.write_text(policy(backend_server, version="test-2"))
    wait_until(lambda: admin(gateway, "GET", "/admin/policy").json()["version"] == "test-2", what="the new policy")


def test_the_policy_status_shows_the_warnings_of_the_policy_in_force(
    gateway: str, policy_path: Path, backend_server: BackendServer
) -> None:
    assert admin(gateway, "GET", "/admin/policy").json()["warnings"] == []
    policy_path.write_text(policy(backend_server, version="test-2", backends={"fake": {"kind": "llamacpp"}}))
    wait_until(lambda: admin(gateway, "GET", "/admin/policy").json()["version"] == "test-2", what="the new policy")
    (warning,) = admin(gateway, "GET", "/admin/policy").json()["warnings"]
    assert re.match(
        r".*policy\.yaml:\d+:\d+: warning: backends\[fake\]: 'fake' \(llamacpp\) cannot salt its prefix cache", warning
    )


def test_the_admin_endpoints_need_an_admin_key(gateway: str) -> None:
    assert admin(gateway, "GET", "/admin/policy", key=None).status_code == 401
    assert admin(gateway, "GET", "/admin/policy", key=KEY_ACME).status_code == 403
    reloaded = admin(gateway, "POST", "/admin/reload")
    assert reloaded.status_code == 200
    assert reloaded.json()["version"] == "test-1"


def test_sigterm_drains_streams_refuses_new_requests_and_exits_zero(policy_path: Path, backend: FakeBackend) -> None:
    serve = [sys.executable, "-m", "gateway", "serve", "--policy", str(policy_path)]
    with serve_in_process([*serve, "--port", "0", "--admin-port", "0", "--log-level", "info"]) as child:
        url, proc = child.url, child.proc
        wait_until(lambda: _ready(url), timeout=30, what="the gateway to be ready")
        gate = threading.Event()
        backend.gate, backend.tokens = gate, 3
        streamed = Streamed()
        streamer = threading.Thread(target=streamed.run, args=(url,), name="streamer")
        streamer.start()
        try:
            wait_until(lambda: bool(streamed.chunks) or streamed.ended, what="the first token")
            assert streamed.chunks, streamed.error
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: _status(url + "/readyz") == 503, what="readiness to fail")
            refused = httpx.post(
                f"{url}/v1/chat/completions",
                headers={"authorization": f"Bearer {KEY_ACME}"},
                json={"model": CHAT_MODEL, "messages": MESSAGES},
            )
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "draining"
            assert proc.poll() is None, f"the gateway must wait for the stream in flight:\n{child.stderr()}"
        finally:
            backend.gate = None
            gate.set()
            streamer.join(30)
        assert not streamer.is_alive(), "the stream did not end"
        assert streamed.error is None
        assert streamed.chunks == [" t0", " t1", " t2"], "the stream in flight was cut"
        assert proc.wait(timeout=30) == 0, child.stderr()
        assert any("drained: no request in flight" in line for line in child.lines), child.stderr()


class Streamed:
    """One streaming request through the SDK, run in a thread: its tokens, and how it failed if it did."""

    def __init__(self) -> None:
        self.chunks: list[str] = []
        self.error: str | None = None
        self.ended = False

    def run(self, url: str) -> None:
        try:
            with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=0, timeout=30) as sdk:
                for chunk in sdk.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, stream=True):  # type: ignore[arg-type]
                    if chunk.choices and chunk.choices[0].delta.content:
                        self.chunks.append(chunk.choices[0].delta.content)
        except openai.OpenAIError as exc:  # reported by the test, not lost in the thread
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ended = True


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _ready(url: str) -> bool:
    return _status(url + "/readyz") == 200
