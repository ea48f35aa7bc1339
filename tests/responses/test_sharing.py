"""Where stored responses live, shared in Redis (``gateway/responses/sharing.py``): found through any
replica, and never lost while Redis is slow or silent.

End to end, a stored response is found through any replica: two gateway processes share where it
lives in Redis. Then with Redis behind a proxy on a thread of its own (``DelayProxy``) that holds
each reply 30 ms, the issue's case with the default 50 ms budget, or drops everything (a silent
Redis): a follow-up through the other replica still reaches the holder; while Redis is silent it
is a 503 to retry, never the 404 that says the conversation is gone; and a response created while
Redis was silent is in Redis once it answers again, so its follow-up goes through either replica.

Then random interleavings of two replicas sharing stored responses through a Redis that goes
silent. Two replicas (``ResponseAffinity``) remember and forget responses, each through the real
Redis behind a proxy that holds every reply 30 ms (the issue's case, with the default 50 ms
budget) and that the machine silences and brings back at random. A third replica, which never
creates anything, asks after every step, as a follow-up through another replica would:

* while Redis is silent, every lookup it cannot answer from its own map is a 503 to retry
  (``response_lookup_unavailable``), never "unknown", whatever the id;
* once Redis answers and the writes held back have landed, every response remembered and not
  forgotten is found, on the backend that holds it, and an id nobody created is unknown. (A
  forgotten one may come back: a write that timed out on the client may have landed, be
  forgotten through the other replica, and be written again by its retrier; the next follow-up
  through it meets the engine's 404 and forgets it again.)
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import tempfile
import time
from collections.abc import Coroutine, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from gateway.errors import Overloaded
from gateway.responses.affinity import ResponseAffinity
from loadtests.harness.delay_proxy import DelayProxy
from loadtests.sim import build_engine_app
from tests.dialects.test_responses import MODEL, policy
from tests.fake_clock import FakeClock
from tests.limitstore.redis_server import REDIS_URL, drop_keys, shared_client, unique_prefix
from tests.policy_builder import KEY_ACME, KEY_GLOBEX, redis_state
from tests.servers import ChildServer, metric, serve_in_process, serve_in_thread, wait_until


def test_a_follow_up_through_another_replica_reaches_the_holder() -> None:
    prefix = unique_prefix()
    with ExitStack() as stack:
        engines = tuple(
            stack.enter_context(serve_in_thread(build_engine_app("fixed", model="served", ttft_ms=2, itl_ms=5)))
            for _ in range(2)
        )
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        path = folder / "policy.yaml"
        path.write_text(policy(engines, state=redis_state(REDIS_URL, prefix)))  # type: ignore[arg-type]
        argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--port", "0", "--admin-port", "0"]
        one = stack.enter_context(serve_in_process([*argv, "--log-level", "info"]))
        two = stack.enter_context(serve_in_process([*argv, "--log-level", "info"]))
        stack.callback(drop_keys, REDIS_URL, prefix)
        client_one = stack.enter_context(openai.OpenAI(base_url=f"{one.url}/v1", api_key=KEY_ACME, max_retries=0))
        client_two = stack.enter_context(openai.OpenAI(base_url=f"{two.url}/v1", api_key=KEY_ACME, max_retries=0))
        globex = stack.enter_context(openai.OpenAI(base_url=f"{two.url}/v1", api_key=KEY_GLOBEX, max_retries=0))
        first = client_one.responses.create(model=MODEL, input="Remember 7.", max_output_tokens=4, store=True)
        served = [metric(e, "vllm:request_success_total", finished_reason="length") for e in engines]
        follow_ups = [
            client_two.responses.create(model=MODEL, input="Which?", previous_response_id=first.id, max_output_tokens=4)
            for _ in range(4)
        ]
        after = [metric(e, "vllm:request_success_total", finished_reason="length") for e in engines]
        try:
            globex.responses.create(model=MODEL, input="Which?", previous_response_id=first.id)
            other_tenant = 200
        except openai.NotFoundError as error:
            other_tenant = error.status_code
        stored_keys = [key.decode() for key in shared_client().scan_iter(match=f"{prefix}*responses*")]
        stored_fields = [field.decode() for field in shared_client().hkeys(f"{prefix}{{acme}}:responses")]
    holder = served.index(1)
    assert after[holder] == 5  # every follow-up through replica two went to the holder
    assert sum(after) == 5
    assert all(f.status == "completed" or f.status == "incomplete" for f in follow_ups)
    assert other_tenant == 404
    ids = [first.id, *(f.id for f in follow_ups)]
    assert sorted(stored_keys) == [f"{prefix}{{acme}}:responses", f"{prefix}{{acme}}:responses:expiry"]
    assert sorted(stored_fields) == sorted(hashlib.sha256(i.encode()).hexdigest() for i in ids)
    assert not any(i in key for i in ids for key in stored_keys + stored_fields)  # never an id a tenant could present


# Redis answering in 30 ms, or not at all


@dataclass
class SlowFleet:
    """Two engines, two gateway processes, and the Redis they share behind ``proxy``."""

    engines: tuple[str, str]
    one: ChildServer
    two: ChildServer
    proxy: DelayProxy
    prefix: str

    def served(self) -> list[float]:
        return [metric(e, "vllm:request_success_total", finished_reason="length") for e in self.engines]

    def in_redis(self, response_id: str) -> bool:
        field = hashlib.sha256(response_id.encode()).hexdigest().encode()
        return field in shared_client().hkeys(f"{self.prefix}{{acme}}:responses")


@pytest.fixture(scope="module")
def slow() -> Iterator[SlowFleet]:
    prefix = unique_prefix()
    with ExitStack() as stack:
        proxy = stack.enter_context(
            DelayProxy(upstream_port=int(REDIS_URL.rsplit(":", 1)[1].split("/")[0]), delay_s=0.03)
        )
        engines = tuple(
            stack.enter_context(serve_in_thread(build_engine_app("fixed", model="served", ttft_ms=2, itl_ms=5)))
            for _ in range(2)
        )
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        path = folder / "policy.yaml"
        # The responses' budget is the policy's state.timeout_ms, the default 50 ms; the tenant
        # limits get a roomy request budget, so that they stay out of this test's way.
        state = {**redis_state(proxy.url, prefix, timeout_ms=50, ping_interval_s=0.5), "request_budget_ms": 1000}
        path.write_text(policy(engines, state=state))  # type: ignore[arg-type]
        argv = [sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--port", "0", "--admin-port", "0"]
        one = stack.enter_context(serve_in_process([*argv, "--log-level", "info"]))
        two = stack.enter_context(serve_in_process([*argv, "--log-level", "info"]))
        stack.callback(drop_keys, REDIS_URL, prefix)
        yield SlowFleet(engines, one, two, proxy, prefix)  # type: ignore[arg-type]


def create(url: str) -> str:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=0, timeout=20) as client:
        return client.responses.create(model=MODEL, input="Remember 7.", max_output_tokens=4, store=True).id


def follow_up(url: str, previous: str) -> httpx.Response:
    body = {"model": MODEL, "input": "Which?", "previous_response_id": previous, "max_output_tokens": 4}
    return httpx.post(f"{url}/v1/responses", json=body, headers={"authorization": f"Bearer {KEY_ACME}"}, timeout=20)


def test_a_follow_up_through_another_replica_reaches_the_holder_while_redis_answers_in_30ms(slow: SlowFleet) -> None:
    first = create(slow.one.url)
    served = slow.served()
    answers = [follow_up(slow.two.url, first).status_code for _ in range(4)]
    after = slow.served()
    holder = max(range(2), key=lambda i: after[i] - served[i])
    assert answers == [200] * 4
    assert after[holder] - served[holder] == 4  # every follow-up through replica two went to the holder
    assert sum(after) - sum(served) == 4


def test_while_redis_is_silent_a_follow_up_through_another_replica_is_a_503_to_retry_never_a_404(
    slow: SlowFleet,
) -> None:
    first = create(slow.one.url)
    slow.proxy.pause()
    try:
        silent = [follow_up(slow.two.url, first) for _ in range(3)]
    finally:
        slow.proxy.resume()
    back = follow_up(slow.two.url, first)
    assert [a.status_code for a in silent] == [503] * 3
    assert {a.json()["error"]["code"] for a in silent} == {"response_lookup_unavailable"}
    assert all(a.headers.get("retry-after") == "1" for a in silent)
    assert back.status_code == 200, back.text


def test_a_response_created_while_redis_is_silent_is_in_redis_once_it_answers_again(slow: SlowFleet) -> None:
    slow.proxy.pause()
    try:
        created = create(slow.one.url)  # its entry's first write times out: the answer comes all the same
        during = slow.in_redis(created)
    finally:
        slow.proxy.resume()
    wait_until(lambda: slow.in_redis(created), what="the held-back write to reach Redis")
    through_two = follow_up(slow.two.url, created)
    assert not during
    assert through_two.status_code == 200, through_two.text


# Random interleavings of two replicas through a Redis that goes silent


IDS = [f"resp_{i}" for i in range(4)]
SETTLE_S = 10.0


class Replicas(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.proxy = DelayProxy(upstream_port=int(REDIS_URL.rsplit(":", 1)[1].split("/")[0]), delay_s=0.03).start()
        self.prefix = unique_prefix()
        self.replicas = [self._replica() for _ in range(2)]
        self.asker = self._replica()
        self.created: dict[str, str] = {}
        """Id -> the backend that holds it, for every response remembered and not forgotten."""
        self.forgotten: set[str] = set()
        self.silent = False
        self.asked = 0

    def _replica(self) -> ResponseAffinity:
        client = aioredis.Redis.from_url(self.proxy.url)
        return ResponseAffinity(FakeClock(0.0), shared=client, key_prefix=self.prefix, timeout_s=0.05, owns_client=True)

    def run(self, step: Coroutine[Any, Any, Any]) -> Any:
        return self.loop.run_until_complete(step)

    @rule(replica=st.integers(0, 1), response_id=st.sampled_from(IDS), backend=st.sampled_from(["e0", "e1"]))
    def remember(self, replica: int, response_id: str, backend: str) -> None:
        if response_id in self.created or response_id in self.forgotten:
            return  # an id is created once
        self.run(self._answered(self.replicas[replica], response_id, backend))
        self.created[response_id] = backend

    @rule(replica=st.integers(0, 1), response_id=st.sampled_from(IDS))
    def forget(self, replica: int, response_id: str) -> None:
        """The engine said it lost the response, to one replica (the other may still know it)."""
        if self.created.pop(response_id, None) is not None:
            self.forgotten.add(response_id)
            self.run(self._forgot(self.replicas[replica], response_id))

    @precondition(lambda self: not self.silent)
    @rule()
    def silence(self) -> None:
        self.proxy.pause()
        self.silent = True

    @precondition(lambda self: self.silent)
    @rule()
    def answer_again(self) -> None:
        self.proxy.resume()
        self.silent = False

    @invariant()
    def a_silent_redis_is_never_an_unknown_id(self) -> None:
        if not self.silent:
            return
        self.asked += 1
        response_id = IDS[self.asked % len(IDS)]  # one id a step: each costs a timeout
        with pytest.raises(Overloaded) as refused:  # not None (a 404), nor a holder (a guess)
            self.run(self.asker.holder(response_id, "acme"))
        assert (refused.value.status, refused.value.code) == (503, "response_lookup_unavailable")

    def teardown(self) -> None:
        try:
            if self.silent:
                self.answer_again()
            self.run(self._settled())
            for response_id in IDS:
                if response_id in self.forgotten:
                    continue  # either way (module docstring)
                found = self.run(self._fresh_lookup(response_id))
                expected = self.created.get(response_id)
                assert (found.backend if found is not None else None) == expected, response_id
        finally:
            for affinity in (*self.replicas, self.asker):
                self.run(affinity.aclose())
            self.loop.close()
            self.proxy.stop()
            drop_keys(REDIS_URL, self.prefix)

    @staticmethod
    async def _answered(replica: ResponseAffinity, response_id: str, backend: str) -> None:
        """A whole answer: remembered, then sent once its first write is done (or failed)."""
        replica.remember(response_id, "acme", backend, "llama")
        await replica.shared_now()

    @staticmethod
    async def _forgot(replica: ResponseAffinity, response_id: str) -> None:
        replica.forget(response_id, "acme")  # its write to Redis starts in the background
        await asyncio.sleep(0)

    async def _settled(self) -> None:
        """Every write held back has landed (or was dropped: forgotten)."""
        deadline = time.monotonic() + SETTLE_S
        while any(r.sharing is not None and r.sharing.pending for r in self.replicas):
            assert time.monotonic() < deadline, "writes held back never landed"
            await asyncio.sleep(0.02)
        for replica in self.replicas:
            await replica.shared_now()

    async def _fresh_lookup(self, response_id: str) -> Any:
        """What a replica that never saw the id finds in Redis."""
        fresh = self._replica()
        try:
            return await fresh.holder(response_id, "acme")
        finally:
            await fresh.aclose()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_replicas_through_a_redis_that_goes_silent_never_lose_a_response() -> None:
    run_state_machine_as_test(
        Replicas,
        settings=settings(
            max_examples=10, stateful_step_count=8, deadline=None, suppress_health_check=[HealthCheck.too_slow]
        ),
    )
