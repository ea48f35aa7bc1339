"""The room rule (``gateway/dispatch/capacity.py``): a table of backend states against ``has_room``, then
the token budget end to end (a request waits until tokens in flight end, then proceeds).

The table builds real ``BackendState`` objects the way the gateway does: requests in flight
through ``reserve`` (and ``prefilled`` once their first token came), the scraped signals as
the scraper writes them, a real ``CircuitBreaker`` tripped by a failure.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.dispatch.backends import BackendState
from gateway.dispatch.breaker import CircuitBreaker
from gateway.dispatch.capacity import Held, has_room, held
from gateway.policy.model import Backend, BackendKind, BreakerPolicy, Capacity, PriorityClass, Slo
from tests.conftest import CHAT_MODEL, KEY_ACME, BackendServer, StartGateway, metric
from tests.dispatch.fake_llamacpp import LLAMA, FakeLlamacpp, llamacpp_policy
from tests.fake_backend import FakeBackend
from tests.fake_clock import FakeClock
from tests.policy_builder import session_policy
from tests.servers import serve_in_thread, wait_until

NOW = 1000.0
FRESH_S = 3.0  # a scrape older than this says nothing (the dispatcher's 3 scrape intervals)
CAPACITY = Capacity(max_concurrent=4, max_tokens_in_flight=100, max_waiting=2, max_kv_usage=0.9)
BACKEND = Backend(name="b", url="http://127.0.0.1:1", kind=BackendKind.VLLM, models=["m"], capacity=CAPACITY)
SLO = Slo(ttft_ms=500, itl_ms=50, e2e_ms=60_000)
INTERACTIVE = PriorityClass(rank=0, slo=SLO)
BATCH = PriorityClass(rank=1, slo=SLO, max_share=0.5)  # at most 2 requests and 50 tokens of each backend
PACED = PriorityClass(rank=1, slo=SLO, max_prefilling=1)


@dataclass(frozen=True)
class Case:
    """A backend state, a request of ``priority_class`` costing ``tokens``, and whether it has room."""

    priority_class: PriorityClass
    tokens: int
    room: bool
    decoding: tuple[tuple[int, int], ...] = ()  # (rank, tokens) in flight, past their first token
    prefilling: tuple[tuple[int, int], ...] = ()  # (rank, tokens) in flight, no first token yet
    healthy: bool = True
    breaker_open: bool = False
    scraped_s_ago: float | None = None  # None: never scraped
    waiting: float = 0.0
    kv_usage: float = 0.0


def backend_state(case: Case) -> BackendState:
    breaker = CircuitBreaker("b", BreakerPolicy(consecutive_failures=1), FakeClock(NOW))
    if case.breaker_open:
        breaker.on_failure()
    state = BackendState(BACKEND, breaker)
    state.healthy = case.healthy
    for rank, tokens in case.decoding:
        state.reserve(rank, tokens)
        state.prefilled(rank)
    for rank, tokens in case.prefilling:
        state.reserve(rank, tokens)
    if case.scraped_s_ago is not None:
        state.waiting, state.kv_usage, state.scraped_at = case.waiting, case.kv_usage, NOW - case.scraped_s_ago
    return state


ONE = ((0, 1),)  # one small interactive request in flight: the backend is not idle
CASES = [
    pytest.param(Case(INTERACTIVE, 10, True), id="an idle healthy backend has room"),
    pytest.param(Case(INTERACTIVE, 500, True), id="an idle backend takes a request bigger than its whole token budget"),
    pytest.param(Case(INTERACTIVE, 10, False, healthy=False), id="an unhealthy backend has no room even when idle"),
    pytest.param(Case(INTERACTIVE, 10, False, breaker_open=True), id="an open breaker leaves no room even when idle"),
    # Requests in flight.
    pytest.param(Case(INTERACTIVE, 1, True, decoding=ONE * 3), id="three of four requests in flight leave room"),
    pytest.param(Case(INTERACTIVE, 1, False, decoding=ONE * 4), id="max_concurrent requests in flight leave none"),
    # The token budget.
    pytest.param(Case(INTERACTIVE, 40, True, decoding=((0, 60),)), id="a request that fills the token budget fits"),
    pytest.param(Case(INTERACTIVE, 41, False, decoding=((0, 60),)), id="one token over the budget does not fit"),
    pytest.param(Case(INTERACTIVE, 1, True, decoding=((0, 98),)), id="a small request fits where a large one does not"),
    # A class's share (batch: half of each budget).
    pytest.param(Case(BATCH, 1, True, decoding=((1, 1),)), id="batch below its share of requests has room"),
    pytest.param(Case(BATCH, 1, False, decoding=((1, 1),) * 2), id="batch at its share of requests has no room"),
    pytest.param(
        Case(INTERACTIVE, 1, True, decoding=((1, 1),) * 2), id="interactive has room where batch is at its share"
    ),
    pytest.param(Case(BATCH, 20, True, decoding=((1, 30),)), id="batch filling its share of tokens exactly fits"),
    pytest.param(Case(BATCH, 21, False, decoding=((1, 30),)), id="batch over its share of tokens does not fit"),
    pytest.param(
        Case(INTERACTIVE, 21, True, decoding=((1, 30),)), id="interactive fits where batch is over its token share"
    ),
    pytest.param(
        Case(BATCH, 1, True, decoding=((0, 1),) * 2), id="interactive requests in flight do not count in batch's share"
    ),
    # The backend's own saturation signals.
    pytest.param(
        Case(INTERACTIVE, 1, False, decoding=ONE, scraped_s_ago=1, waiting=3),
        id="a fresh engine queue above max_waiting stops new work",
    ),
    pytest.param(
        Case(INTERACTIVE, 1, True, decoding=ONE, scraped_s_ago=1, waiting=2),
        id="an engine queue at max_waiting still takes work",
    ),
    pytest.param(
        Case(INTERACTIVE, 1, False, decoding=ONE, scraped_s_ago=1, kv_usage=0.95),
        id="a fresh kv cache usage above max_kv_usage stops new work",
    ),
    pytest.param(
        Case(INTERACTIVE, 1, True, decoding=ONE, scraped_s_ago=1, kv_usage=0.9),
        id="a kv cache usage at max_kv_usage still takes work",
    ),
    pytest.param(
        Case(INTERACTIVE, 1, True, decoding=ONE, scraped_s_ago=FRESH_S + 1, waiting=50, kv_usage=1.0),
        id="stale saturation signals are ignored",
    ),
    pytest.param(
        Case(INTERACTIVE, 1, False, scraped_s_ago=0, waiting=3),
        id="an engine queueing its own requests gets none even with nothing of the gateway's in flight",
    ),
    pytest.param(
        Case(INTERACTIVE, 1, True, scraped_s_ago=0, kv_usage=1.0),
        id="a full kv cache with nothing in flight from us still gets work",
    ),
    # Paced prefills.
    pytest.param(Case(PACED, 1, False, prefilling=((1, 1),)), id="a paced class waits while at its max_prefilling"),
    pytest.param(Case(PACED, 1, True, decoding=((1, 1),)), id="a paced class starts once that prefill has a token"),
    pytest.param(Case(PACED, 1, False, prefilling=ONE), id="a paced class yields to a higher class that is prefilling"),
    pytest.param(
        Case(INTERACTIVE, 1, True, prefilling=((1, 1),)), id="an unpaced class does not wait on a lower class's prefill"
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_has_room(case: Case) -> None:
    assert has_room(backend_state(case), case.priority_class, case.tokens, NOW, FRESH_S) is case.room


def state_of(capacity: object, waiting: float = 0.0, scraped_s_ago: float | None = 0.0) -> BackendState:
    """An idle healthy backend of ``capacity`` (a policy's form: ``"auto"`` too) whose engine reports
    ``waiting`` requests in its own queue, scraped ``scraped_s_ago`` (None: never)."""
    backend = Backend.model_validate({**BACKEND.model_dump(), "kind": "llamacpp", "capacity": capacity})
    state = BackendState(backend)
    if scraped_s_ago is not None:
        state.waiting, state.scraped_at = waiting, NOW - scraped_s_ago
    return state


AUTO_READ = Capacity.model_validate("auto").with_engine(4, 16_384)
HELD = [
    pytest.param(state_of({}, waiting=1), Held.ENGINE_QUEUE, id="by default one request in the engine's queue holds"),
    pytest.param(state_of({}, waiting=0), None, id="by default an engine with an empty queue is not held"),
    pytest.param(
        state_of({"max_waiting": 4}, waiting=4), None, id="max_waiting opts out up to that many in the engine's queue"
    ),
    pytest.param(state_of({"max_waiting": 4}, waiting=5), Held.ENGINE_QUEUE, id="and holds above it"),
    pytest.param(
        state_of({}, waiting=9, scraped_s_ago=FRESH_S + 0.01), None, id="a scrape older than fresh_s holds nothing"
    ),
    pytest.param(state_of({}, waiting=9, scraped_s_ago=FRESH_S), Held.ENGINE_QUEUE, id="one exactly fresh_s old holds"),
    pytest.param(state_of({}, waiting=9, scraped_s_ago=None), None, id="a backend never scraped is not held"),
    pytest.param(
        state_of("auto"), Held.ENGINE_LIMITS_UNREAD, id="capacity auto holds until the engine's limits are read"
    ),
    pytest.param(
        state_of({"max_concurrent": 8, "kv_cache_tokens": "auto"}),
        Held.ENGINE_LIMITS_UNREAD,
        id="one auto figure unread is enough to hold",
    ),
    pytest.param(
        state_of(AUTO_READ.model_dump()), Held.ENGINE_LIMITS_UNREAD, id="a read capacity dumps as the policy's: unread"
    ),
]


@pytest.mark.parametrize(("state", "reason"), HELD)
def test_held(state: BackendState, reason: Held | None) -> None:
    assert held(state, NOW, FRESH_S) is reason
    if reason is not None:
        assert not has_room(state, INTERACTIVE, 1, NOW, FRESH_S), "held: no room, even idle"


def test_each_request_ended_there_since_the_scrape_takes_one_off_the_engine_s_queue() -> None:
    state = state_of({}, waiting=0)
    for _ in range(3):
        state.reserve(0, 1)
    state.waiting = 2  # the scrape: the engine queues 2 requests (its slots are full)
    state.finished_since_scrape = 0
    assert held(state, NOW, FRESH_S) is Held.ENGINE_QUEUE
    state.unreserve(0, 1, prefilling=True)
    assert held(state, NOW, FRESH_S) is Held.ENGINE_QUEUE, "one slot freed: one of the 2 queued runs"
    state.unreserve(0, 1, prefilling=True)
    assert held(state, NOW, FRESH_S) is None, "two freed: the engine's queue is drained, no scrape needed"


def test_a_capacity_read_from_the_engine_has_the_engines_room() -> None:
    state = state_of("auto")
    state.backend = state.backend.model_copy(update={"capacity": AUTO_READ})
    assert held(state, NOW, FRESH_S) is None
    for _ in range(3):
        assert has_room(state, INTERACTIVE, 1, NOW, FRESH_S)
        state.reserve(0, 1)
    assert has_room(state, INTERACTIVE, 1, NOW, FRESH_S), "the engine's 4 slots: a fourth request fits"
    state.reserve(0, 1)
    assert not has_room(state, INTERACTIVE, 1, NOW, FRESH_S), "no fifth"


def test_a_request_released_leaves_the_backend_as_idle_as_before() -> None:
    state = backend_state(Case(INTERACTIVE, 1, True))
    state.reserve(1, 30)
    state.unreserve(1, 30, prefilling=True)
    assert (state.in_flight, state.in_flight_tokens) == (0, 0)
    assert set(state.class_in_flight.values()) == set(state.class_tokens.values()) == {0}
    assert set(state.class_prefilling.values()) == {0}
    assert has_room(state, INTERACTIVE, 500, NOW, FRESH_S), "idle again: even a request over the budget goes"


# End to end: a gateway in front of the fake backend, whose one backend holds 50 tokens in flight:
# room for a request of max_tokens 30 and one of 1 at once, not for two of 30.
BUDGET = 50
TOKEN_BUDGET = {"fake": {"capacity": {"max_tokens_in_flight": BUDGET}}}
LONG_WAIT = {"interactive": {"queue": {"max_wait_s": 30}}}
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]
AT_REST = (
    "gateway_backend_in_flight_requests",
    "gateway_backend_in_flight_tokens",
    "gateway_class_in_flight_requests",
    "gateway_queue_depth",
)


def post_chat(url: str, max_tokens: int) -> httpx.Response:
    body = {"model": CHAT_MODEL, "messages": MESSAGES, "max_tokens": max_tokens}
    headers = {"authorization": f"Bearer {KEY_ACME}"}
    return httpx.post(f"{url}/v1/chat/completions", headers=headers, json=body, timeout=30)


def test_the_token_budget_holds_a_request_until_tokens_in_flight_end_then_lets_it_through(
    start_gateway: StartGateway, backend: FakeBackend, backend_server: BackendServer
) -> None:
    text = session_policy(backend_server.url, backends=TOKEN_BUDGET, classes=LONG_WAIT)
    with start_gateway(text, health_checks=False) as url:
        gate = threading.Event()
        backend.gate, backend.tokens = gate, 3
        first = threading.Event()

        def held_stream() -> list[str]:
            with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=0, timeout=30) as sdk:
                stream = sdk.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, max_tokens=30, stream=True)
                tokens = []
                for chunk in stream:
                    first.set()
                    if chunk.choices and chunk.choices[0].delta.content:
                        tokens.append(chunk.choices[0].delta.content)
                return tokens

        with ThreadPoolExecutor(2) as pool:
            held = pool.submit(held_stream)
            wait_until(first.is_set, what="the held stream's first chunk")
            held_tokens = metric(url, "gateway_backend_in_flight_tokens")  # its prompt estimate plus 30
            prompt = held_tokens - 30
            assert held_tokens + prompt + 1 <= BUDGET < held_tokens + prompt + 30, "the sizes this test relies on"

            small = post_chat(url, max_tokens=1)
            assert small.status_code == 200, "a request that fits the tokens left goes at once"
            large = pool.submit(post_chat, url, 30)
            wait_until(lambda: metric(url, "gateway_queue_depth") == 1, what="the large request to queue")
            assert len(backend.received) == 2, "the queued request must not reach the backend yet"
            assert not large.done()

            backend.gate = None
            gate.set()
            assert held.result(timeout=10) == [" t0", " t1", " t2"]
            reply = large.result(timeout=10)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
        assert len(backend.received) == 3
        assert metric(url, "gateway_queue_wait_seconds_count") >= 1
        wait_until(lambda: all(metric(url, name) == 0 for name in AT_REST), what="every gauge back to 0")


# End to end: a gateway in front of a llama.cpp server (``fake_llamacpp.py``) whose own queue the gateway
# reads on its /metrics: scrapes every 50 ms, so a page is fresh for a second (scrape.fresh_s).
ENGINE_QUEUE = {"backend": LLAMA, "reason": "engine_queue"}


def ask(url: str) -> str:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=0, timeout=30) as sdk:
        reply = sdk.chat.completions.create(model=CHAT_MODEL, messages=MESSAGES, max_tokens=4)
    return reply.choices[0].message.content or ""


def test_an_engine_that_defers_requests_gets_none_from_the_gateway_until_it_drains(start_gateway: StartGateway) -> None:
    engine = FakeLlamacpp(slots=4, deferred=3)  # busy with traffic the gateway does not see
    with serve_in_thread(engine) as engine_url, start_gateway(llamacpp_policy(engine_url)) as url:
        wait_until(lambda: metric(url, "gateway_backend_held", **ENGINE_QUEUE) == 1, what="the engine's queue seen")
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(ask, url)
            wait_until(lambda: metric(url, "gateway_queue_depth") == 1, what="the request to wait in the gateway")
            assert engine.chats == [], "held: the gateway has room for 4, yet sends nothing to a queueing engine"
            assert metric(url, "gateway_backend_in_flight_requests", backend=LLAMA) == 0
            engine.deferred = 0  # it drains
            assert reply.result(timeout=10) == "hi"
        assert len(engine.chats) == 1
        assert metric(url, "gateway_backend_held", **ENGINE_QUEUE) == 0
        assert metric(url, "gateway_queue_wait_seconds_count") == 1


def test_a_scrape_gone_stale_does_not_hold_a_backend_for_ever(start_gateway: StartGateway) -> None:
    engine = FakeLlamacpp(deferred=3)
    with serve_in_thread(engine) as engine_url, start_gateway(llamacpp_policy(engine_url)) as url:
        wait_until(lambda: metric(url, "gateway_backend_held", **ENGINE_QUEUE) == 1, what="the engine's queue seen")
        engine.metrics_status = 500  # its page fails from now on: the last one (3 deferred) grows old
        assert ask(url) == "hi", "served once the last page is older than scrape.fresh_s"
        assert engine.deferred == 3
        assert len(engine.chats) == 1


def test_when_every_backend_is_held_the_queue_timeout_applies(start_gateway: StartGateway) -> None:
    engine = FakeLlamacpp(deferred=1)
    with serve_in_thread(engine) as engine_url, start_gateway(llamacpp_policy(engine_url, max_wait_s=0.3)) as url:
        wait_until(lambda: metric(url, "gateway_backend_held", **ENGINE_QUEUE) == 1, what="the engine's queue seen")
        with pytest.raises(openai.APIStatusError) as refused:
            ask(url)
    assert refused.value.status_code == 503
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["code"] == "queue_timeout"
    assert engine.chats == []
