"""Sealed response ids (``gateway/responses/ids.py``): what an id says, and that nothing else opens;
then a fleet that needs no Redis to find a stored response.

An id opens only for the tenant it was handed to, under the secret that sealed it, before it
expires, while the policy still serves its holder; any other string, including every id with one
character changed, opens to nothing, as an unknown id does.

With the cache-salt secret, a stored response's id says where it lives: two replicas, no Redis
asked. Two gateway processes sharing ``GATEWAY_CACHE_SALT_SECRET`` and a Redis (behind a proxy
that can fall silent), two simulated engines with vLLM's response store. A response created
through one replica is continued through the other on its holder, whole and streamed, with the
engine given its own id back; nothing about responses is written to Redis; another tenant's use of
the id is the 404 of an id nobody issued; and while Redis is silent a follow-up through the other
replica is still served (with the shared map it was a 503 to retry:
``tests/responses/test_sharing.py``).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.responses.ids import MAX_UPSTREAM_ID, PREFIX, TOKEN_CHARS, ResponseIds
from loadtests.harness.delay_proxy import DelayProxy
from loadtests.sim import build_engine_app
from tests.dialects.test_responses import MODEL, policy
from tests.limitstore.redis_server import REDIS_URL, drop_keys, shared_client, unique_prefix
from tests.policy_builder import KEY_ACME, KEY_GLOBEX, redis_state
from tests.responses.test_sharing import SlowFleet
from tests.servers import serve_in_process, serve_in_thread

ENGINE_ID = "resp_4f9c2a7e0b1d4c3a8e6f5d2c1b0a9e8f"


@dataclass(frozen=True)
class Backend:
    name: str


SERVED = {"llama": (Backend("gpu-1"), Backend("gpu-2")), "mistral": (Backend("gpu-3"),)}


class Wall:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def ids(secret: bytes = b"s3cret", wall: Wall | None = None) -> ResponseIds:
    return ResponseIds(secret, ttl_s=3600.0, wall=wall or Wall())


def test_an_id_opens_to_its_holder_and_the_engines_own_id_for_its_tenant() -> None:
    sealed = ids().seal(ENGINE_ID, "acme", "llama", "gpu-2")
    opened = ids().open(sealed, "acme", SERVED)  # another process with the same secret
    assert opened is not None
    assert (opened.backend, opened.model, opened.upstream_id) == ("gpu-2", "llama", ENGINE_ID)
    assert opened.left_s == pytest.approx(3600.0)
    assert sealed.startswith(PREFIX)
    assert sealed.endswith("." + ENGINE_ID)
    assert ResponseIds.sealed(sealed)
    assert not ResponseIds.sealed(ENGINE_ID)
    assert "gpu" not in sealed.removesuffix(ENGINE_ID)
    assert "llama" not in sealed


@pytest.mark.parametrize(
    ("why", "tenant", "secret", "served", "later_s"),
    [
        pytest.param("another tenant", "globex", b"s3cret", SERVED, 0, id="another tenant's id opens to nothing"),
        pytest.param("another secret", "acme", b"other", SERVED, 0, id="another secret's id opens to nothing"),
        pytest.param("holder gone", "acme", b"s3cret", {"llama": (Backend("gpu-1"),)}, 0, id="a holder off the policy"),
        pytest.param("expired", "acme", b"s3cret", SERVED, 3600, id="an id past its ttl"),
    ],
)
def test_an_id_opens_to_nothing_for_anyone_else_or_once_it_cannot_be_served(
    why: str, tenant: str, secret: bytes, served: dict[str, tuple[Backend, ...]], later_s: float
) -> None:
    wall = Wall()
    sealed = ids(wall=wall).seal(ENGINE_ID, "acme", "llama", "gpu-2")
    wall.t += later_s
    assert ids(secret, wall).open(sealed, tenant, served) is None, why


@given(st.data())
def test_an_id_with_any_one_character_changed_opens_to_nothing(data: st.DataObject) -> None:
    sealed = ids().seal(ENGINE_ID, "acme", "llama", "gpu-2")
    at = data.draw(st.integers(0, len(sealed) - 1))
    other = data.draw(st.sampled_from("ABCabc012_-.xyzZ").filter(lambda c: c != sealed[at]))
    changed = sealed[:at] + other + sealed[at + 1 :]
    assert ids().open(changed, "acme", SERVED) is None


@given(st.text(max_size=200))
def test_no_string_a_client_makes_up_opens(made_up: str) -> None:
    assert ids().open(made_up, "acme", SERVED) is None
    assert ids().open(PREFIX + "A" * 39 + "." + made_up, "acme", SERVED) is None


def test_an_engine_id_too_long_to_seal_is_handed_out_as_it_is() -> None:
    long_id = "resp_" + "x" * MAX_UPSTREAM_ID
    assert ids().seal(long_id, "acme", "llama", "gpu-1") == long_id


def test_without_the_secret_there_are_no_sealed_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GATEWAY_TEST_RESPONSE_SECRET", raising=False)
    assert ResponseIds.from_env("GATEWAY_TEST_RESPONSE_SECRET") is None
    monkeypatch.setenv("GATEWAY_TEST_RESPONSE_SECRET", "s3cret")
    made = ResponseIds.from_env("GATEWAY_TEST_RESPONSE_SECRET")
    assert made is not None
    assert made.open(ids().seal(ENGINE_ID, "acme", "llama", "gpu-1"), "acme", SERVED) is not None


# Two replicas sharing the secret: a follow-up through either, no Redis asked


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
