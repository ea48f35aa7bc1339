"""The map of stored responses: one per tenant, bounded per tenant and in all, expiring; in Redis too.

Another tenant's id must take the very path of an unknown id (the issue measured it 0.35 ms
faster: an existence oracle), so these tests assert on structure, the Redis commands a lookup
sends, never on time. The end-to-end test floods one tenant through the official SDK and the
simulated engine, and checks that the other tenant's conversation goes on.

With Redis behind a proxy that delays each reply 30 ms, or drops everything (``DelayProxy``,
on a thread of its own): a lookup is one round trip within its budget, even on a new
connection; a lookup Redis does not answer is a 503 to retry, never "unknown"; a write that
timed out lands once Redis answers again; a reply that waited while the event loop was busy is
not a slow Redis.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis

from gateway.errors import Overloaded
from gateway.responses.affinity import ResponseAffinity
from loadtests.harness.delay_proxy import DelayProxy
from loadtests.sim import build_engine_app
from tests.conftest import StartGateway
from tests.fake_clock import FakeClock
from tests.limitstore.redis_server import REDIS_URL, drop_keys, eventually, shared_client, unique_prefix
from tests.policy_builder import KEY_ACME, KEY_GLOBEX, backend, build_policy, model, tenant
from tests.servers import free_port, metric, serve_in_thread, server_in_thread, wait_until

MODEL = "llama"


async def test_only_the_creating_tenant_finds_a_response_and_only_until_it_expires() -> None:
    clock = FakeClock(0.0)
    affinity = ResponseAffinity(clock, ttl_s=60)
    affinity.remember("resp_1", "acme", "engine-0", "llama")
    held = await affinity.holder("resp_1", "acme")
    assert held is not None
    assert (held.backend, held.model) == ("engine-0", "llama")
    assert await affinity.holder("resp_1", "globex") is None
    assert await affinity.holder("resp_2", "acme") is None
    clock.t = 61.0
    assert await affinity.holder("resp_1", "acme") is None
    assert len(affinity) == 0


async def test_a_tenant_past_its_bound_loses_its_own_least_recently_used_never_anothers() -> None:
    affinity = ResponseAffinity(FakeClock(0.0), per_tenant=2)
    affinity.remember("b", "globex", "b0", "m")
    affinity.remember("a1", "acme", "b0", "m")
    affinity.remember("a2", "acme", "b0", "m")
    assert await affinity.holder("a1", "acme") is not None  # "a1" is now acme's most recent
    for i in range(3, 50):
        affinity.remember(f"a{i}", "acme", "b0", "m")
    assert await affinity.holder("b", "globex") is not None
    assert await affinity.holder("a1", "acme") is None
    assert await affinity.holder("a49", "acme") is not None
    assert (affinity.held_by("acme"), affinity.held_by("globex"), len(affinity)) == (2, 1, 3)


async def test_past_the_total_bound_the_tenant_holding_the_most_loses_its_oldest() -> None:
    affinity = ResponseAffinity(FakeClock(0.0), per_tenant=10, max_entries=6)
    affinity.remember("g1", "globex", "b0", "m")
    affinity.remember("i1", "initech", "b0", "m")
    for i in range(20):  # acme floods: within its own bound, past the total
        affinity.remember(f"a{i}", "acme", "b0", "m")
    affinity.remember("i2", "initech", "b0", "m")  # a tenant within its share adds: acme pays
    assert len(affinity) == 6
    assert await affinity.holder("g1", "globex") is not None
    assert await affinity.holder("i1", "initech") is not None
    assert await affinity.holder("i2", "initech") is not None
    assert affinity.held_by("acme") == 3
    assert await affinity.holder("a19", "acme") is not None
    assert await affinity.holder("a16", "acme") is None


# With Redis: what every replica shares


class RecordingConnection(aioredis.Connection):
    """A real Redis connection that notes the name of every command it sends (its handshake too);
    with ``stall_s``, it holds the event loop that long right after sending an ``EVALSHA``, as a
    busy process would while Redis answers."""

    commands: list[str]
    stall_s = 0.0

    async def send_command(self, *args: Any, **kwargs: Any) -> None:
        self.commands.append(str(args[0]))
        await super().send_command(*args, **kwargs)
        if args[0] == "EVALSHA" and self.stall_s:
            time.sleep(self.stall_s)  # noqa: ASYNC251 (the point: the loop held while Redis answers)


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    prefix = unique_prefix()
    yield prefix
    drop_keys(REDIS_URL, prefix)


@pytest.fixture
def proxy() -> Iterator[DelayProxy]:
    """The test Redis behind a proxy on a thread of its own, 30 ms per reply (the issue's case)."""
    with DelayProxy(upstream_port=int(REDIS_URL.rsplit(":", 1)[1].split("/")[0]), delay_s=0.03) as running:
        yield running


def replica(prefix: str, *, url: str = REDIS_URL, timeout_s: float = 2.0, **bounds: int) -> ResponseAffinity:
    """A replica's map, sharing the Redis at ``url`` under ``prefix``; each of its commands is noted."""
    commands: list[str] = []
    recording = type("Recording", (RecordingConnection,), {"commands": commands})
    client = aioredis.Redis.from_url(url, connection_class=recording)
    return ResponseAffinity(
        FakeClock(0.0), shared=client, key_prefix=prefix, timeout_s=timeout_s, owns_client=True, **bounds
    )


def sent(affinity: ResponseAffinity) -> list[str]:
    assert affinity.shared is not None
    kind = affinity.shared.connection_pool.connection_class
    assert issubclass(kind, RecordingConnection)
    commands = list(kind.commands)
    kind.commands.clear()
    return commands


def stored(prefix: str, tenant: str) -> list[bytes]:
    """The id hashes in ``tenant``'s map in Redis, read directly."""
    with shared_client() as redis:
        return list(redis.hkeys(f"{prefix}{{{tenant}}}:responses"))


def field(response_id: str) -> bytes:
    return hashlib.sha256(response_id.encode()).hexdigest().encode()


async def _async(value: bool) -> bool:
    """``value`` as an async condition, for ``eventually``."""
    return value


async def test_another_tenants_id_takes_the_path_of_an_unknown_id(prefix: str) -> None:
    one = replica(prefix)
    one.remember("resp_acme", "acme", "engine-0", "llama")
    await one.shared_now()
    await one.holder("resp_warm", "globex")  # the script is loaded once per Redis
    sent(one)
    other_tenant = await one.holder("resp_acme", "globex")
    other_commands = sent(one)
    unknown = await one.holder("resp_none", "globex")
    unknown_commands = sent(one)
    found = await one.holder("resp_acme", "acme")
    await one.aclose()
    assert other_tenant is None
    assert unknown is None
    assert other_commands == unknown_commands == ["EVALSHA"]  # one round trip, the same one
    assert found is not None
    assert found.backend == "engine-0"


async def test_the_bound_per_tenant_holds_in_redis_for_every_replica(prefix: str) -> None:
    one, two = replica(prefix, per_tenant=3), replica(prefix, per_tenant=3)
    one.remember("resp_globex", "globex", "engine-1", "llama")
    for i in range(6):  # each written before the next: the order Redis sees is the order of creation
        one.remember(f"resp_acme_{i}", "acme", "engine-0", "llama")
        await one.shared_now()
    found = {i: await two.holder(f"resp_acme_{i}", "acme") is not None for i in range(6)}
    globex = await two.holder("resp_globex", "globex")
    with shared_client() as redis:
        stored = redis.hkeys(f"{prefix}{{acme}}:responses")
        ranked = redis.zcard(f"{prefix}{{acme}}:responses:expiry")
        ttl_ms = redis.pttl(f"{prefix}{{acme}}:responses")
    await one.aclose()
    await two.aclose()
    assert found == {0: False, 1: False, 2: False, 3: True, 4: True, 5: True}
    assert globex is not None
    assert globex.backend == "engine-1"
    assert 3_590_000 < globex.expires_at * 1000 <= 3_600_000  # what Redis said was left
    assert sorted(stored) == sorted(hashlib.sha256(f"resp_acme_{i}".encode()).hexdigest().encode() for i in (3, 4, 5))
    assert ranked == 3
    assert 0 < ttl_ms <= 3_600_000


async def test_a_lookup_is_one_round_trip_within_its_budget_even_on_a_new_connection(
    prefix: str, proxy: DelayProxy
) -> None:
    one = replica(prefix)
    one.remember("resp_1", "acme", "engine-0", "llama")
    await one.shared_now()
    two = replica(prefix, url=proxy.url, timeout_s=0.05)  # 30 ms a reply, 50 ms allowed: the case
    found = await two.holder("resp_1", "acme")
    handshake = sent(two)
    again = await two.holder("resp_1", "acme")  # now in two's own map: no Redis at all
    await one.aclose()
    await two.aclose()
    assert found is not None
    assert found.backend == "engine-0"
    assert handshake[-1:] == ["EVALSHA"]  # the lookup itself, after the connection's own handshake
    assert again == found
    assert sent(two) == []


async def test_a_lookup_redis_does_not_answer_is_a_503_to_retry_never_an_unknown_id(
    prefix: str, proxy: DelayProxy
) -> None:
    one = replica(prefix)
    one.remember("resp_1", "acme", "engine-0", "llama")
    await one.shared_now()
    two = replica(prefix, url=proxy.url, timeout_s=0.05)
    assert await two.holder("resp_warm", "acme") is None  # a connection opened, an unknown id
    proxy.pause()
    answers = []
    for response_id in ("resp_1", "resp_unknown"):  # one that exists, one that does not: the same answer
        with pytest.raises(Overloaded) as refused:
            await two.holder(response_id, "acme")
        answers.append((refused.value.status, refused.value.code, refused.value.headers.get("retry-after")))
    proxy.resume()
    found = await two.holder("resp_1", "acme")
    await one.aclose()
    await two.aclose()
    assert answers == [(503, "response_lookup_unavailable", "1")] * 2
    assert found is not None


async def test_a_write_that_timed_out_reaches_redis_once_it_answers_again(prefix: str, proxy: DelayProxy) -> None:
    one = replica(prefix, url=proxy.url, timeout_s=0.05)
    assert await one.holder("resp_warm", "acme") is None  # a connection opened
    proxy.pause()
    one.remember("resp_1", "acme", "engine-0", "llama")
    await one.shared_now()  # the first write timed out: the answer is sent anyway
    during = stored(prefix, "acme")
    proxy.resume()
    await eventually(lambda: _async(field("resp_1") in stored(prefix, "acme")), what="the write to land")
    assert one.sharing is not None
    await eventually(lambda: _async(not one.sharing.pending), what="nothing left to write")
    two = replica(prefix)
    found = await two.holder("resp_1", "acme")
    with shared_client() as redis:
        ttl_ms = redis.pttl(f"{prefix}{{acme}}:responses")
    await one.aclose()
    await two.aclose()
    assert during == []
    assert found is not None
    assert 3_590_000 < found.expires_at * 1000 <= 3_600_000  # the expiry it had, not a new one
    assert 0 < ttl_ms <= 3_600_000


async def test_the_writes_waiting_for_redis_are_bounded_the_oldest_given_up_first(
    prefix: str, proxy: DelayProxy
) -> None:
    one = replica(prefix, url=proxy.url, timeout_s=0.05)
    assert one.sharing is not None
    one.sharing.max_pending = 2
    proxy.pause()
    for i in range(4):  # one after the other: "oldest" is the order in which writes failed, and
        # four writes in flight at once fail in the order their connections were opened, not
        # the order they were remembered (seen under load: resp_1 kept, resp_2 given up)
        one.remember(f"resp_{i}", "acme", "engine-0", "llama")
        await one.shared_now()
    waiting = sorted(response_id for _, response_id in one.sharing.pending)
    proxy.resume()
    await eventually(lambda: _async(not one.sharing.pending), what="the waiting writes to land")
    await one.aclose()
    assert waiting == ["resp_2", "resp_3"]
    assert sorted(stored(prefix, "acme")) == sorted([field("resp_2"), field("resp_3")])


async def test_a_forgotten_response_is_not_written_after_all(prefix: str, proxy: DelayProxy) -> None:
    one = replica(prefix, url=proxy.url, timeout_s=0.05)
    proxy.pause()
    one.remember("resp_lost", "acme", "engine-0", "llama")
    one.remember("resp_kept", "acme", "engine-0", "llama")
    await one.shared_now()
    one.forget("resp_lost", "acme")  # its engine said it lost it before Redis came back
    proxy.resume()
    await eventually(lambda: _async(field("resp_kept") in stored(prefix, "acme")), what="the kept one to land")
    await one.aclose()
    assert stored(prefix, "acme") == [field("resp_kept")]


async def test_a_reply_that_waited_while_the_event_loop_was_busy_is_not_a_slow_redis(prefix: str) -> None:
    one = replica(prefix)
    one.remember("resp_1", "acme", "engine-0", "llama")
    await one.shared_now()
    two = replica(prefix, timeout_s=0.02)
    assert await two.holder("resp_warm", "acme") is None  # a connection opened and the script loaded
    assert two.shared is not None
    two.shared.connection_pool.connection_class.stall_s = 0.1  # 5 x the budget, right after the send
    found = await two.holder("resp_1", "acme")
    await one.aclose()
    await two.aclose()
    assert found is not None


async def test_a_forgotten_response_is_unknown_to_every_replica(prefix: str) -> None:
    one, two = replica(prefix), replica(prefix)
    one.remember("resp_lost", "acme", "engine-0", "llama")
    await one.shared_now()
    one.forget("resp_lost", "acme")
    await one.shared_now()
    assert await one.holder("resp_lost", "acme") is None
    assert await two.holder("resp_lost", "acme") is None
    await one.aclose()
    await two.aclose()


# End to end: the official SDK, the gateway, a simulated engine


@pytest.fixture
def engine() -> Iterator[str]:
    with serve_in_thread(build_engine_app("fixed", model="served", ttft_ms=2, itl_ms=5)) as url:
        yield url


def policy(url: str) -> str:
    return build_policy(
        version="response-bounds",
        models=[model(MODEL, upstream_name="served", max_prompt_tokens=4096, max_output_tokens=64)],
        backends=[backend("engine-0", url, [MODEL], kind="sim")],
        tenants=[tenant("acme", KEY_ACME), tenant("globex", KEY_GLOBEX)],
    )


def follow_up(client: openai.OpenAI, previous: str) -> str:
    """The status of a turn that continues ``previous`` (200, or the error's code)."""
    return follow_up_error(client, previous)[0]


def follow_up_error(client: openai.OpenAI, previous: str) -> tuple[str, str]:
    """The status of a turn that continues ``previous`` (200, or the error's code), and the message."""
    try:
        client.responses.create(model=MODEL, input="And then?", previous_response_id=previous, max_output_tokens=2)
    except openai.NotFoundError as error:
        return str(error.code), error.message
    return "200", ""


def test_a_tenant_flooding_stored_responses_forgets_its_own_oldest_never_another_tenants_conversation(
    start_gateway: StartGateway, engine: str, tmp_path: Path
) -> None:
    with (
        start_gateway(policy(engine), health_checks=False, rollout_dir=str(tmp_path), responses_per_tenant=3) as url,
        ExitStack() as stack,
    ):
        acme = stack.enter_context(openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=0, timeout=20))
        globex = stack.enter_context(openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_GLOBEX, max_retries=0, timeout=20))
        kept = globex.responses.create(model=MODEL, input="Remember 7.", max_output_tokens=2, store=True)
        flood = [acme.responses.create(model=MODEL, input=f"Turn {i}.", max_output_tokens=2) for i in range(4)]
        statuses = {
            "globex's conversation": follow_up(globex, kept.id),
            "acme's oldest": follow_up(acme, flood[0].id),
            "acme's latest": follow_up(acme, flood[-1].id),
        }
    assert statuses == {
        "globex's conversation": "200",
        "acme's oldest": "previous_response_not_found",
        "acme's latest": "200",
    }


def _comparable(answer: httpx.Response, previous: str) -> tuple[int, dict[str, str], bytes]:
    """Status, headers but the per-request ones, and the body with the id it names masked."""
    headers = {k: v for k, v in answer.headers.items() if k not in ("date", "x-request-id")}
    return answer.status_code, headers, answer.content.replace(previous.encode(), b"<id>")


def test_another_tenants_id_gets_the_very_404_of_an_unknown_id(
    start_gateway: StartGateway, engine: str, tmp_path: Path
) -> None:
    def turn(key: str, previous: str) -> httpx.Response:
        body = {"model": MODEL, "input": "Which?", "previous_response_id": previous, "max_output_tokens": 2}
        return httpx.post(f"{url}/v1/responses", json=body, headers={"authorization": f"Bearer {key}"})

    with start_gateway(policy(engine), health_checks=False, rollout_dir=str(tmp_path)) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=0, timeout=20) as acme:
            stored = acme.responses.create(model=MODEL, input="Remember 7.", max_output_tokens=2).id
        unknown = "resp_" + "0" * (len(stored) - len("resp_"))
        answers = [turn(KEY_GLOBEX, stored), turn(KEY_GLOBEX, unknown)]
    seen = [_comparable(answer, id) for answer, id in zip(answers, (stored, unknown), strict=True)]
    assert seen[0] == seen[1]
    assert seen[0][0] == 404
    assert b"previous_response_not_found" in seen[0][2]


def test_a_response_its_engine_lost_is_forgotten_at_the_engines_first_404(
    start_gateway: StartGateway, tmp_path: Path
) -> None:
    port = free_port()
    with ExitStack() as stack:
        holder = stack.enter_context(server_in_thread(build_engine_app("fixed", model="served", ttft_ms=1), port))
        url = stack.enter_context(start_gateway(policy(holder.url), rollout_dir=str(tmp_path)))
        client = stack.enter_context(openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=0, timeout=20))
        first = client.responses.create(model=MODEL, input="Remember 7.", max_output_tokens=2)
        holder.stop_listening()
        wait_until(lambda: metric(url, "gateway_model_healthy_backends", model=MODEL) == 0, what="the engine down")
        stack.enter_context(serve_in_thread(build_engine_app("fixed", model="served", ttft_ms=1), port))
        wait_until(lambda: metric(url, "gateway_model_healthy_backends", model=MODEL) == 1, what="it back, empty")
        lost = follow_up_error(client, first.id)
        after = follow_up_error(client, first.id)
    assert lost[0] == after[0] == "previous_response_not_found"
    assert "start the conversation again" in lost[1]  # the engine said so
    assert "not known to this gateway" in after[1]  # then the gateway's own: the engine is not asked again
