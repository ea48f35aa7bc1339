"""With the cache-salt secret, a stored response's id says where it lives: two replicas, no Redis asked.

Two gateway processes sharing ``GATEWAY_CACHE_SALT_SECRET`` and a Redis (behind a proxy that can
fall silent), two simulated engines with vLLM's response store. A response created through one
replica is continued through the other on its holder, whole and streamed, with the engine given
its own id back; nothing about responses is written to Redis; another tenant's use of the id is
the 404 of an id nobody issued; and while Redis is silent a follow-up through the other replica
is still served (with the shared map it was a 503 to retry: ``test_responses_fleet.py``).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from gateway.responses.ids import PREFIX, TOKEN_CHARS, ResponseIds
from loadtests.delay_proxy import DelayProxy
from loadtests.sim import build_engine_app
from tests.apis.test_responses import MODEL, policy
from tests.apis.test_responses_fleet import SlowFleet
from tests.limitstore.redis_server import REDIS_URL, drop_keys, shared_client, unique_prefix
from tests.policy_builder import KEY_ACME, KEY_GLOBEX, redis_state
from tests.servers import serve_in_process, serve_in_thread

SECRET_ENV = "GATEWAY_CACHE_SALT_SECRET"


@pytest.fixture(scope="module")
def fleet() -> Iterator[SlowFleet]:
    prefix = unique_prefix()
    with pytest.MonkeyPatch.context() as patch, ExitStack() as stack:
        patch.setenv(SECRET_ENV, "the fleet's secret")  # the children inherit it
        proxy = stack.enter_context(DelayProxy(upstream_port=int(REDIS_URL.rsplit(":", 1)[1].split("/")[0])))
        engines = tuple(
            stack.enter_context(serve_in_thread(build_engine_app("fixed", model="served", ttft_ms=2, itl_ms=5)))
            for _ in range(2)
        )
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        path = folder / "policy.yaml"
        state = {**redis_state(proxy.url, prefix, ping_interval_s=0.5), "request_budget_ms": 1000}
        path.write_text(policy(engines, state=state))  # type: ignore[arg-type]
        argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--port", "0", "--admin-port", "0"]
        one = stack.enter_context(serve_in_process([*argv, "--log-level", "info"]))
        two = stack.enter_context(serve_in_process([*argv, "--log-level", "info"]))
        stack.callback(drop_keys, REDIS_URL, prefix)
        yield SlowFleet(engines, one, two, proxy, prefix)  # type: ignore[arg-type]


def sdk(url: str, key: str = KEY_ACME) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=20)


def follow_up(url: str, previous: str, key: str = KEY_ACME) -> httpx.Response:
    body = {"model": MODEL, "input": "Which?", "previous_response_id": previous, "max_output_tokens": 4}
    return httpx.post(f"{url}/v1/responses", json=body, headers={"authorization": f"Bearer {key}"}, timeout=20)


def engine_id(public: str) -> str:
    return public[len(PREFIX) + TOKEN_CHARS + 1 :]


def test_a_whole_answer_is_continued_through_the_other_replica_on_its_holder_and_redis_holds_nothing(
    fleet: SlowFleet,
) -> None:
    with sdk(fleet.one.url) as one:
        first = one.responses.create(model=MODEL, input="Remember 7.", max_output_tokens=4, store=True)
    before = fleet.served()
    answers = [follow_up(fleet.two.url, first.id) for _ in range(4)]
    after = fleet.served()
    moved = [a - b for a, b in zip(after, before, strict=True)]
    stored = list(shared_client().scan_iter(match=f"{fleet.prefix}*responses*"))
    assert first.id.startswith(PREFIX)
    assert engine_id(first.id).startswith("resp_")
    assert [a.status_code for a in answers] == [200] * 4, answers[0].text
    assert sorted(moved) == [0, 4]  # every follow-up on the one engine that holds the response
    assert all(a.json()["id"].startswith(PREFIX) and a.json()["id"] != first.id for a in answers)
    assert {a.json()["previous_response_id"] for a in answers} == {first.id}  # named back as the client named it
    assert stored == []  # no entry written: the id carries its holder


def test_a_streamed_answer_carries_its_sealed_id_in_every_event_and_is_continued_elsewhere(
    fleet: SlowFleet,
) -> None:
    with sdk(fleet.one.url) as one:
        events = list(one.responses.create(model=MODEL, input="Count.", max_output_tokens=3, stream=True))
    ids = {e.response.id for e in events if hasattr(e, "response")}
    (public,) = ids
    continued = follow_up(fleet.two.url, public)
    with sdk(fleet.two.url) as two:
        streamed = list(
            two.responses.create(
                model=MODEL, input="More.", previous_response_id=public, max_output_tokens=3, stream=True
            )
        )
    named_back = {e.response.previous_response_id for e in streamed if hasattr(e, "response")}
    assert {e.type for e in events if hasattr(e, "response")} >= {"response.created", "response.completed"}
    assert ResponseIds.sealed(public)
    assert continued.status_code == 200, continued.text
    assert named_back == {public}  # every event names the earlier answer as the client did


def test_another_tenants_use_of_an_id_is_the_404_of_an_id_nobody_issued(fleet: SlowFleet) -> None:
    with sdk(fleet.one.url) as one:
        first = one.responses.create(model=MODEL, input="Secret 42.", max_output_tokens=4)
    made_up = PREFIX + "A" * TOKEN_CHARS + "." + engine_id(first.id)
    theirs = follow_up(fleet.two.url, first.id, key=KEY_GLOBEX)
    unknown = follow_up(fleet.two.url, made_up, key=KEY_GLOBEX)
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.json()["error"]["code"] == unknown.json()["error"]["code"] == "previous_response_not_found"
    assert theirs.json()["error"]["message"].replace(first.id[:64], "ID") == unknown.json()["error"]["message"].replace(
        made_up[:64], "ID"
    )


def test_while_redis_is_silent_a_follow_up_through_the_other_replica_is_served(fleet: SlowFleet) -> None:
    with sdk(fleet.one.url) as one:
        first = one.responses.create(model=MODEL, input="Remember 9.", max_output_tokens=4)
    fleet.proxy.pause()
    try:
        during = [follow_up(fleet.two.url, first.id) for _ in range(3)]
    finally:
        fleet.proxy.resume()
    assert [a.status_code for a in during] == [200] * 3, during[0].text
