"""Shadow traffic end to end: copies measured, never answered to a client, never in a real request's way.

The shadow target shares its engine with the primary (the worst case for capacity): the engine
holds four requests, three clients keep three busy, and every request is copied once it has
its own slot: copies use the fourth, and take the slot a client just freed before that client's
next request. Without the rule that a shadow gives its slot
back the moment a real request would wait, clients would queue behind shadows; with it, every
client request is answered in full, at once, and none is refused.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtests.sim import build_engine_app
from tests.conftest import StartGateway
from tests.policy_builder import KEY_ACME, backend, build_policy, model, tenant
from tests.servers import metric, serve_in_thread, wait_until

GROUP = "chat"
MAX_TOKENS = 6
CLIENTS = 3
REQUESTS = 40  # per client


def shadow_policy(engine_url: str, **shadow: Any) -> str:
    return build_policy(
        version="shadow-1",
        models=[
            model("primary", upstream_name="served-a", max_prompt_tokens=4096, max_output_tokens=64),
            model("shadowed", upstream_name="served-a", max_prompt_tokens=4096, max_output_tokens=64),
        ],
        backends=[
            backend(
                "engine", engine_url, ["primary", "shadowed"], kind="sim", capacity={"max_concurrent": CLIENTS + 1}
            ),
        ],
        model_groups=[
            {
                "name": GROUP,
                "targets": [{"model": "primary"}],
                "shadow": {"model": "shadowed", "percent": 100, "max_concurrent": 2, **shadow},
            }
        ],
        tenants=[tenant("acme", KEY_ACME, limits={"rpm": 100_000})],
        retry={"max_retries": 0},
        # No room to wait: a client request made to wait behind a shadow would be a 503 at once.
        classes={"interactive": {"queue": {"max_depth": 0}}},
    )


def stream_once(client: httpx.Client, url: str) -> tuple[int, list[dict[str, Any]], str | None]:
    body = {"model": GROUP, "messages": [{"role": "user", "content": "shadow me"}], "max_tokens": MAX_TOKENS}
    body["stream"] = True
    headers = {"authorization": f"Bearer {KEY_ACME}"}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as answer:
        text = b"".join(answer.iter_bytes())
        target = answer.headers.get("x-gateway-target")
    events = [
        orjson.loads(line[6:]) for line in text.split(b"\n") if line.startswith(b"data: ") and line != b"data: [DONE]"
    ]
    return answer.status_code, events, target


def test_shadows_are_measured_never_answered_and_never_in_the_way(start_gateway: StartGateway, tmp_path: Path) -> None:
    app = build_engine_app("fixed", model="served-a", ttft_ms=5, itl_ms=15)
    with (
        serve_in_thread(app) as engine,
        start_gateway(shadow_policy(engine, scorer="exact"), health_checks=False, rollout_dir=str(tmp_path)) as url,
    ):
        results: list[tuple[int, list[dict[str, Any]], str | None]] = []
        lock = threading.Lock()

        def client_loop() -> None:
            with httpx.Client(timeout=30) as client:
                for _ in range(REQUESTS):
                    result = stream_once(client, url)
                    with lock:
                        results.append(result)

        threads = [threading.Thread(target=client_loop) for _ in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        statuses = Counter(status for status, _, _ in results)
        assert statuses == {200: CLIENTS * REQUESTS}  # no client request refused or failed

        def shadow_outcomes() -> dict[str, float]:
            return {
                outcome: metric(url, "gateway_shadow_requests_total", group=GROUP, target="shadowed", outcome=outcome)
                for outcome in ("completed", "preempted", "no_room", "at_cap", "error")
            }

        wait_until(
            lambda: sum(shadow_outcomes().values()) == CLIENTS * REQUESTS, what="every copy (one per request) to end"
        )
        outcomes = shadow_outcomes()
        ttfts = metric(url, "gateway_shadow_ttft_seconds_count", group=GROUP, target="shadowed")
        scored = metric(url, "gateway_shadow_quality_score_count", group=GROUP, target="shadowed", scorer="exact")
        charged = metric(url, "gateway_requests_total", model="primary", api="chat", status="200", outcome="completed")
    for _, events, target in results:
        content = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
        assert len(content) == MAX_TOKENS  # one answer's tokens: nothing of a shadow's
        assert {e["model"] for e in events} == {GROUP}
        assert target == "primary"
    assert outcomes["completed"] > 0
    assert outcomes["preempted"] + outcomes["no_room"] > 0  # the shadows did compete for the slots
    assert outcomes["error"] == 0
    assert outcomes["completed"] <= ttfts <= outcomes["completed"] + outcomes["preempted"]
    assert scored > 0
    assert charged == CLIENTS * REQUESTS  # the tenant is charged for its own requests only
