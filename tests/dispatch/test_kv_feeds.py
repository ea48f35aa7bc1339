"""A gateway process subscribes to the KV events of the backends whose policy names an endpoint
(``gateway/dispatch/kv_feeds.py``): a real simulated engine started with ``--kv-events``, the
gateway in a process of its own. The feed goes live and fills the exact index after a request;
an engine killed leaves the feed not live within ``silence_s``, with a WARNING; a reload that
drops ``kv_events`` stops the feed."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from gateway.dispatch.kv_feeds import KvFeeds
from gateway.policy.model import Backend
from gateway.telemetry.metrics import Metrics
from loadtests.sim import SIM_MODEL_NAME
from tests.policy_builder import INTERACTIVE_SLO, KEY_ACME, admin_keys, backend, model, tenant
from tests.servers import ChildServer, free_port, metric, samples, serve_in_process, wait_until
from tests.sim.test_usage_cli import _health

ADMIN_KEY = "admin-key-for-kv-feed-tests"
SILENCE_S = 3.0
"""Long enough that a feed stays live between a request and the checks that follow it (an idle
engine is silent too), short enough for the test."""
LIVE = "gateway_kv_events_feed_live"
BLOCKS = "gateway_kv_events_blocks"


@contextlib.contextmanager
def sim_engine(pub: str, replay: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``python -m gateway sim --kv-events pub --kv-events-replay replay``; killed on exit."""
    port = free_port()
    argv = [sys.executable, "-m", "gateway", "sim", "--profile", "fixed", "--ttft-ms", "1", "--itl-ms", "1"]
    argv += ["--port", str(port), "--kv-events", pub, "--kv-events-replay", replay]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _health(url) or proc.poll() is not None, 30, what="the simulator to answer")
        assert proc.poll() is None, f"the simulator exited {proc.returncode}"
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def policy(engine_url: str, kv_events: dict[str, Any] | None) -> str:
    fields: dict[str, Any] = {} if kv_events is None else {"kv_events": kv_events}
    document = {
        "version": "kv-feeds-1" if kv_events else "kv-feeds-2",
        "classes": {"interactive": {"rank": 0, "slo": INTERACTIVE_SLO}},
        "models": [model(SIM_MODEL_NAME, max_prompt_tokens=4096, max_output_tokens=32)],
        "backends": [backend("sim0", engine_url, [SIM_MODEL_NAME], **fields)],
        "tenants": [tenant("acme", KEY_ACME)],
        "admin": admin_keys(ADMIN_KEY),
        "health_checks": {"interval_s": 0.2, "timeout_s": 1.0},
    }
    return yaml.safe_dump(document)


@contextlib.contextmanager
def gateway(text: str) -> Iterator[tuple[ChildServer, Path]]:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "policy.yaml"
        path.write_text(text)
        serve = [sys.executable, "-m", "gateway", "serve", "--policy", str(path)]
        with serve_in_process([*serve, "--port", "0", "--admin-port", "0", "--log-level", "info"]) as child:
            yield child, path


def feed(child: ChildServer) -> dict[str, Any] | None:
    """``kv_events`` of backend sim0 in ``GET /admin/backends``."""
    answer = httpx.get(child.admin_url + "/admin/backends", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert answer.status_code == 200, answer.text
    (entry,) = [b for b in answer.json()["backends"] if b["name"] == "sim0"]
    status: dict[str, Any] | None = entry["kv_events"]
    return status


def complete(child: ChildServer, prompt: list[int]) -> None:
    body = {"model": SIM_MODEL_NAME, "prompt": prompt, "max_tokens": 2}
    answer = httpx.post(child.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY_ACME}"})
    assert answer.status_code == 200, answer.text


def live_with_blocks(child: ChildServer) -> bool:
    status = feed(child)
    return (
        metric(child.admin_url, LIVE, backend="sim0") == 1
        and metric(child.admin_url, BLOCKS, backend="sim0") > 0
        and status is not None
        and status["live"] is True
        and status["blocks"] > 0
    )


def endpoints() -> dict[str, Any]:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    return {"endpoint": pub, "replay_endpoint": replay, "silence_s": SILENCE_S}


def test_a_request_fills_the_index_and_a_killed_engine_leaves_the_feed_not_live_within_silence_s() -> None:
    events = endpoints()
    with (
        sim_engine(events["endpoint"], events["replay_endpoint"]) as (engine_url, engine),
        gateway(policy(engine_url, events)) as (child, _),
    ):
        assert feed(child) == {
            "endpoint": events["endpoint"],
            "replay_endpoint": events["replay_endpoint"],
            "live": False,
            "blocks": 0,
            "routing": "estimate",  # no kv_events.hashing: the feed is read, routing keeps the estimate
        }
        complete(child, list(range(1000, 1100)))  # 6 full blocks of 16
        wait_until(lambda: live_with_blocks(child), 10, what="the feed live with the prompt's blocks")
        assert metric(child.admin_url, "gateway_kv_events_batches_total", backend="sim0") >= 1
        engine.kill()
        killed = time.monotonic()
        wait_until(lambda: metric(child.admin_url, LIVE, backend="sim0") == 0, SILENCE_S + 5, what="not live")
        assert time.monotonic() - killed <= SILENCE_S + 1.0
        status = feed(child)
        assert status is not None
        assert status["live"] is False
        assert metric(child.admin_url, "gateway_kv_events_feed_lost_total", backend="sim0", reason="silent") == 1
        wait_until(lambda: "kv events of sim0: not live (silent)" in child.stderr(400), 5, what="the WARNING")
        (line,) = [ln for ln in child.lines if "kv events of sim0: not live" in ln]
        assert "WARNING" in line, line


def test_a_reload_without_kv_events_stops_the_feed() -> None:
    events = endpoints()
    with (
        sim_engine(events["endpoint"], events["replay_endpoint"]) as (engine_url, _),
        gateway(policy(engine_url, events)) as (child, path),
    ):
        complete(child, list(range(2000, 2100)))
        wait_until(lambda: live_with_blocks(child), 10, what="the feed live with the prompt's blocks")
        path.write_text(policy(engine_url, None))
        reloaded = httpx.post(child.admin_url + "/admin/reload", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert reloaded.status_code == 200, reloaded.text
        assert feed(child) is None
        assert samples(child.admin_url, LIVE) == {}
        assert samples(child.admin_url, BLOCKS) == {}
        wait_until(lambda: "kv events of sim0: feed stopped" in child.stderr(400), 5, what="the stop logged")
        complete(child, list(range(3000, 3100)))  # new blocks published: nobody listens any more
        assert samples(child.admin_url, "gateway_kv_events_batches_total") == {}
        assert feed(child) is None


def _backends(b_topic: str) -> list[Backend]:
    """Two backends with a feed (b's topic given) and one without."""
    feeds: list[tuple[str, dict[str, Any] | None]] = [
        ("a", {"endpoint": "tcp://127.0.0.1:1"}),
        ("b", {"endpoint": "tcp://127.0.0.1:2", "topic": b_topic}),
        ("c", None),
    ]
    return [Backend.model_validate(backend(n, "http://127.0.0.1:1", ["m"], kv_events=e)) for n, e in feeds]


async def test_a_reload_rebuilds_only_the_feeds_whose_kv_events_changed() -> None:
    feeds = KvFeeds(Metrics())
    feeds.adopt(_backends("kv"))
    feeds.start()
    try:
        before = feeds.subscribers()
        assert sorted(before) == ["a", "b"]
        feeds.adopt(_backends("other"))
        after = feeds.subscribers()
        assert after["a"] is before["a"]  # unchanged: the same subscriber, still running
        assert after["b"] is not before["b"]
        assert after["b"].feed.topic == "other"
        assert feeds.running() == {"a", "b"}
        feeds.adopt(_backends("other")[:1])
        assert sorted(feeds.subscribers()) == ["a"]
        assert feeds.status("b") is None
    finally:
        await feeds.aclose()
    assert feeds.running() == set()
