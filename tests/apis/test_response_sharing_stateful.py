"""Random interleavings of two replicas sharing stored responses through a Redis that goes silent.

Two replicas (``ResponseAffinity``) remember and forget responses, each through the real Redis
behind a proxy that holds every reply 30 ms (the issue's case, with the default 50 ms budget)
and that the machine silences and brings back at random. A third replica, which never creates
anything, asks after every step, as a follow-up through another replica would:

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
import time
from collections.abc import Coroutine
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from gateway.errors import Overloaded
from gateway.responses.affinity import ResponseAffinity
from loadtests.delay_proxy import DelayProxy
from tests.fake_clock import FakeClock
from tests.limitstore.redis_server import REDIS_URL, drop_keys, unique_prefix

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
