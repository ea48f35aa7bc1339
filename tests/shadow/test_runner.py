"""Shadow copies against real engines: they reach the shadow target, are measured, and never get in the way.

Real parts throughout: simulated engines (``loadtests/sim``, the ``fixed`` profile) and the
recording fake backend (``tests/fake_backend.py``) on loopback ports 19700-19799, the gateway's
own ``BackendPool``, ``Dispatcher``, ``UpstreamClient``, ``Metrics`` and runtime, built from a
policy of ``tests/policy_builder.py`` whose group ``chat`` serves ``pub`` (engine model
``org/primary``) and shadows it to ``cand`` (engine model ``org/candidate``) on a backend of
its own. Tests wait on conditions with a deadline, never on a bare sleep.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from gateway.admission.build import build_request
from gateway.clock import MonotonicClock
from gateway.dialects.base import Dialect
from gateway.dialects.chat import CHAT
from gateway.dialects.embeddings import EMBEDDINGS
from gateway.dispatch.backends import BackendPool, BackendState
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.observers import DispatchObserver, Observers
from gateway.pipeline.context import RequestContext
from gateway.policy.groups import ModelGroup
from gateway.policy.model import Tenant
from gateway.policy.snapshot import PolicySnapshot
from gateway.request.tokens import CharRatioEstimator
from gateway.routing.isolation import tenant_scope
from gateway.routing.least_load import LeastLoadRouter
from gateway.routing.targets import TargetChoice
from gateway.runtime import Runtime, RuntimeBuilder
from gateway.service import parse_policy
from gateway.shadow.runner import ShadowHandle, ShadowRunner
from gateway.telemetry.cost_meter import CostMeter
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tracing import INERT_REQUEST
from gateway.types import InferenceRequest
from gateway.upstream.client import UpstreamClient
from loadtests.sim import build_engine_app
from tests.fake_backend import FakeBackend
from tests.fake_clock import FakeClock
from tests.policy_builder import NOWHERE, build_policy, model, tenant
from tests.policy_builder import backend as backend_entry
from tests.servers import metric, serve_in_thread

PRIMARY_PORT, CANDIDATE_PORT, RECORDER_PORT = 19700, 19701, 19702
GROUP, PRIMARY, CANDIDATE = "chat", "pub", "cand"
LONG = 4000
"""Output tokens of a copy that must still be running when the test acts (2 ms each: 8 s)."""


# --- the engines ----------------------------------------------------------------------------------


@dataclass
class Engines:
    primary: str
    candidate: str
    recorder: str
    fake: FakeBackend


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    """Two simulated engines (first token after 5 ms, then one every 2 ms) and the recording fake."""
    primary = build_engine_app("fixed", model="org/primary", ttft_ms=5, itl_ms=2)
    candidate = build_engine_app("fixed", model="org/candidate", ttft_ms=5, itl_ms=2)
    fake = FakeBackend()
    with (
        serve_in_thread(primary, PRIMARY_PORT) as primary_url,
        serve_in_thread(candidate, CANDIDATE_PORT) as candidate_url,
        serve_in_thread(fake, RECORDER_PORT) as recorder_url,
    ):
        yield Engines(primary_url, candidate_url, recorder_url, fake)


@pytest.fixture
def fake(engines: Engines) -> FakeBackend:
    """The recording fake, well-behaved and with an empty record."""
    engines.fake.status, engines.fake.tokens = 200, 4
    engines.fake.received.clear()
    return engines.fake


# --- the policy and the gateway's parts -------------------------------------------------------------


def shadow_policy(
    engines: Engines,
    *,
    shadow_url: str | None = None,
    shadow_kind: str = "sim",
    slots: int = 8,
    percent: float = 100,
    max_concurrent: int = 4,
    scorer: str | None = None,
    shared: bool = False,
    tokens: int | None = None,
) -> str:
    """Group ``chat``: target ``pub`` on backend ``primary``, shadow ``cand`` on backend ``shadow``
    (``slots`` requests at most) at ``shadow_url`` (the candidate engine by default). ``shared``:
    one backend ``solo`` with ``slots`` serves both models instead (the same weights under two
    names, both served as ``org/candidate``); ``tokens`` bounds its tokens in flight."""
    shadow: dict[str, Any] = {"model": CANDIDATE, "percent": percent, "max_concurrent": max_concurrent}
    if scorer is not None:
        shadow["scorer"] = scorer
    capacity = {"max_concurrent": slots, **({"max_tokens_in_flight": tokens} if tokens else {})}
    if shared:
        models = [
            model(PRIMARY, upstream_name="org/candidate", max_output_tokens=LONG),
            model(CANDIDATE, upstream_name="org/candidate", max_output_tokens=LONG),
        ]
        backends = [backend_entry("solo", engines.candidate, [PRIMARY, CANDIDATE], kind="sim", capacity=capacity)]
    else:
        models = [
            model(PRIMARY, upstream_name="org/primary", max_output_tokens=LONG),
            model(CANDIDATE, upstream_name="org/candidate", max_output_tokens=LONG),
        ]
        backends = [
            backend_entry("primary", engines.primary, [PRIMARY], kind="sim"),
            backend_entry("shadow", shadow_url or engines.candidate, [CANDIDATE], kind=shadow_kind, capacity=capacity),
        ]
    return build_policy(
        NOWHERE,
        version="shadow-test",
        classes={
            "interactive": {"queue": {"max_depth": 8, "max_wait_s": 5}},
            "batch": {"queue": {"max_depth": 8, "max_wait_s": 5}},
        },
        models=models,
        model_groups=[{"name": GROUP, "targets": [{"model": PRIMARY}], "shadow": shadow}],
        backends=backends,
        tenants=[
            tenant("acme", "key-acme", models=[GROUP]),
            tenant("globex", "key-globex", models=[GROUP]),
        ],
    )


@dataclass
class Rig:
    """The gateway's parts a shadow runner works with, from one policy."""

    snapshot: PolicySnapshot
    runtime: Runtime
    dispatcher: Dispatcher
    metrics: Metrics
    runner: ShadowRunner
    clock: MonotonicClock
    costs: CostMeter

    @property
    def group(self) -> ModelGroup:
        return self.snapshot.groups[GROUP]

    def tenant(self, name: str = "acme") -> Tenant:
        return next(t for t in self.snapshot.policy.tenants if t.name == name)

    def context(
        self,
        content: str = "Hello there, shadow.",
        *,
        max_tokens: int = 8,
        tenant: str = "acme",
        api: Dialect = CHAT,
        model: str = PRIMARY,
    ) -> RequestContext:
        """A validated request to the group, as the pipeline builds it (interactive class)."""
        if api is EMBEDDINGS:
            body: dict[str, Any] = {"model": GROUP, "input": content}
        else:
            body = {"model": GROUP, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
        target = self.snapshot.models[model]
        request = build_request(
            api=api,
            body=body,
            raw_body=orjson.dumps(body),
            request_id=f"req-{time.monotonic_ns()}",
            arrival=self.clock.now(),
            model_policy=target,
            limits=self.snapshot.policy.limits,
            estimator=CharRatioEstimator(),
        )
        route = TargetChoice(GROUP, self.snapshot.models[PRIMARY], group=self.group)
        interactive = self.snapshot.policy.classes["interactive"]
        deadline = self.clock.now() + 30
        who = self.tenant(tenant)
        return RequestContext(request, who, "interactive", interactive, deadline, self.runtime, INERT_REQUEST, route)

    def count(self, outcome: str) -> float:
        labels = {"group": GROUP, "target": CANDIDATE, "outcome": outcome}
        return self.metrics.registry.get_sample_value("gateway_shadow_requests_total", labels) or 0.0

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, {"group": GROUP, "target": CANDIDATE, **labels}) or 0.0

    def slots_held(self) -> int:
        return sum(state.in_flight for state in self.dispatcher.pool.all())


@asynccontextmanager
async def rig(policy: str, rng: random.Random | None = None) -> AsyncIterator[Rig]:
    snapshot = parse_policy(policy, "shadow.yaml")
    clock = MonotonicClock()
    runtime = RuntimeBuilder(clock, epoch_offset=0.0, telemetry=False, on_spans_dropped=lambda _: None).first(snapshot)
    pool = BackendPool(snapshot)
    observers = Observers()
    dispatcher = Dispatcher(pool, runtime.router, clock, snapshot, observer=observers)
    upstream = UpstreamClient({b.name: b for b in snapshot.policy.backends})
    metrics = Metrics()
    costs = CostMeter(metrics, snapshot.policy.backends, clock)
    runner = ShadowRunner(clock, dispatcher, upstream, metrics, rng or random.Random(7), costs=costs)
    observers.add(runner)
    try:
        yield Rig(snapshot, runtime, dispatcher, metrics, runner, clock, costs)
    finally:
        await runner.aclose()
        await upstream.aclose()
        runtime.tracing.shutdown()


async def eventually(condition: Callable[[], bool], within_s: float = 10.0, what: str = "condition") -> None:
    """Wait until ``condition`` holds, giving the event loop its turns; fail after ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within_s}s waiting for {what}")
        await asyncio.sleep(0.005)


def running(engine: str) -> float:
    """Requests the engine holds now (running or waiting)."""
    return metric(engine, "vllm:num_requests_running") + metric(engine, "vllm:num_requests_waiting")


def shadow_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == "shadow" and not t.done()]


# --- what a copy is -------------------------------------------------------------------------------


async def test_a_copy_reaches_the_shadow_engine_and_is_measured_while_the_primary_engine_sees_nothing(
    engines: Engines,
) -> None:
    before = {url: metric(url, "vllm:request_success_total") for url in (engines.primary, engines.candidate)}
    generated = metric(engines.candidate, "vllm:generation_tokens_total")
    async with rig(shadow_policy(engines)) as r:
        handle = r.runner.copy(r.context(max_tokens=8), r.group)
        assert handle is not None
        assert r.runner.in_flight == 1
        await eventually(lambda: r.runner.in_flight == 0, what="the copy to end")
        assert r.count("completed") == 1
        assert r.sample("gateway_shadow_ttft_seconds_count") == 1
        assert r.sample("gateway_shadow_itl_seconds_count") == 7  # eight output events, seven gaps
        assert r.sample("gateway_shadow_output_tokens_total") == 8
        assert r.slots_held() == 0
    assert metric(engines.candidate, "vllm:request_success_total") == before[engines.candidate] + 1
    assert metric(engines.candidate, "vllm:generation_tokens_total") == generated + 8
    assert metric(engines.primary, "vllm:request_success_total") == before[engines.primary]


async def test_the_copy_carries_the_tenant_s_cache_salt_a_stream_with_usage_and_the_shadow_s_served_name(
    engines: Engines, fake: FakeBackend
) -> None:
    policy = shadow_policy(engines, shadow_url=engines.recorder, shadow_kind="vllm")
    async with rig(policy) as r:
        for name in ("acme", "globex"):
            assert r.runner.copy(r.context(tenant=name, max_tokens=5), r.group) is not None
            await eventually(lambda: r.runner.in_flight == 0, what="the copy to end")
        assert r.count("completed") == 2
        salter = r.runtime.salter
        acme, globex = (salter.salt(tenant_scope(r.tenant(name))) for name in ("acme", "globex"))
    assert acme != globex
    received = [(got.path, got.body) for got in fake.received]
    assert [path for path, _ in received] == ["/v1/chat/completions"] * 2
    for (_, body), salt in zip(received, (acme, globex), strict=True):
        assert body["cache_salt"] == salt
        assert body["model"] == "org/candidate"
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == 5
        assert body["messages"] == [{"role": "user", "content": "Hello there, shadow."}]


async def test_a_request_of_an_api_that_does_not_stream_is_not_copied(engines: Engines) -> None:
    async with rig(shadow_policy(engines)) as r:
        assert r.runner.copy(r.context(api=EMBEDDINGS), r.group) is None
        assert r.runner.in_flight == 0
        assert r.metrics.registry.get_sample_value("gateway_shadow_requests_total", {}) is None
        assert r.slots_held() == 0


@pytest.mark.parametrize(
    ("status", "tokens"),
    [(200, 7 + 5), (503, 0)],
    ids=["a completed copy weighs the tokens the engine reported", "a failed copy weighs none, as a request"],
)
async def test_a_copy_that_held_a_slot_is_charged_to_its_group_not_to_its_tenant(
    engines: Engines, fake: FakeBackend, status: int, tokens: int
) -> None:
    fake.status, fake.tokens = status, 5
    policy = shadow_policy(engines, shadow_url=engines.recorder, shadow_kind="vllm")
    async with rig(policy) as r:
        assert r.runner.copy(r.context(), r.group) is not None
        await eventually(lambda: r.runner.in_flight == 0, what="the copy to end")
        assert r.costs.accountant.pending_requests == 1
        deltas = r.costs.close_interval()
    (key,) = deltas
    assert (key.tenant, key.model, key.class_name) == (f"~shadow:{GROUP}", CANDIDATE, "batch")
    assert (deltas[key].requests, deltas[key].goodput_requests, deltas[key].tokens) == (1, 0, tokens)


async def test_a_failing_shadow_target_is_counted_as_an_error_and_never_scored(
    engines: Engines, fake: FakeBackend
) -> None:
    fake.status = 503
    policy = shadow_policy(engines, shadow_url=engines.recorder, shadow_kind="vllm", scorer="exact")
    async with rig(policy) as r:
        handle = r.runner.copy(r.context(), r.group)
        assert handle is not None
        await eventually(lambda: r.runner.in_flight == 0, what="the copy to fail")
        handle.primary_answered(" t0 t1 t2 t3")
        assert r.count("error") == 1
        assert r.slots_held() == 0
        assert r.sample("gateway_shadow_quality_score_count", scorer="exact") == 0


# --- scoring ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("primary_first", [True, False], ids=["primary ends first", "shadow ends first"])
@pytest.mark.parametrize(
    ("scorer", "primary_text", "score"),
    [
        pytest.param("exact", " t0 t1 t2 t3", 1.0, id="an equal answer scores one"),
        pytest.param("exact", "something else", 0.0, id="another answer scores zero"),
        pytest.param("jaccard", "t0 t1 t2 t3 t4 t5 t6 t7", 0.5, id="jaccard scores half the words shared"),
    ],
)
async def test_a_scored_copy_is_compared_with_the_primary_once_both_are_in(
    engines: Engines, fake: FakeBackend, scorer: str, primary_text: str, score: float, primary_first: bool
) -> None:
    policy = shadow_policy(engines, shadow_url=engines.recorder, shadow_kind="vllm", scorer=scorer)
    async with rig(policy) as r:
        handle = r.runner.copy(r.context(), r.group)
        assert handle is not None
        assert handle.wants_primary_text
        if primary_first:
            handle.primary_answered(primary_text)
            assert r.sample("gateway_shadow_quality_score_count", scorer=scorer) == 0
        await eventually(lambda: r.runner.in_flight == 0, what="the copy to end")
        if not primary_first:
            assert r.sample("gateway_shadow_quality_score_count", scorer=scorer) == 0
            handle.primary_answered(primary_text)
        handle.primary_answered("said twice: ignored")
        assert r.sample("gateway_shadow_quality_score_count", scorer=scorer) == 1
        assert r.sample("gateway_shadow_quality_score_sum", scorer=scorer) == pytest.approx(score)


async def test_without_a_scorer_the_handle_keeps_no_text(engines: Engines) -> None:
    async with rig(shadow_policy(engines)) as r:
        handle = r.runner.copy(r.context(), r.group)
        assert handle is not None
        assert not handle.wants_primary_text
        handle.primary_answered("the primary's answer")
        assert all(getattr(handle, slot) is None for slot in ("_primary", "_shadow", "_judge"))


# --- no path to the client --------------------------------------------------------------------------


def test_the_runner_and_its_handle_offer_no_path_to_a_client() -> None:
    """The handle only takes the primary's text; the runner only copies, hears the dispatcher (it
    preempts its copies when a request waits) and closes. Neither takes, holds nor returns a
    response, a send callable or an answer."""
    public = {name for name in dir(ShadowHandle) if not name.startswith("_")}
    assert public == {"primary_answered", "wants_primary_text"}
    assert set(ShadowHandle.__slots__) == {"_judge", "_primary", "_primary_known", "_shadow", "_shadow_known"}
    public = {name for name in dir(ShadowRunner) if not name.startswith("_")}
    hears = {name for name in dir(DispatchObserver) if not name.startswith("_")}
    assert hears == {"request_waits", "demand_changed", "routed", "cache_missed"}
    assert public == {"copy", "aclose", "in_flight"} | hears
    assert list(inspect.signature(ShadowRunner.copy).parameters) == ["self", "ctx", "group"]
    assert inspect.signature(ShadowRunner.copy).return_annotation == "ShadowHandle | None"
    assert inspect.signature(ShadowHandle.primary_answered).return_annotation == "None"


# --- how many -------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_percent_30_copies_about_30_of_400_requests_in_a_hundred(engines: Engines, seed: int) -> None:
    """Every decision to copy is counted under one outcome (here ``at_cap`` once one copy runs), so
    the counts add up to the copies decided: within four standard deviations of 30% of 400."""
    n, p = 400, 0.30
    async with rig(shadow_policy(engines, percent=30, max_concurrent=1), random.Random(seed)) as r:
        for _ in range(n):
            r.runner.copy(r.context(max_tokens=LONG), r.group)
        assert r.runner.in_flight == 1
        decided = r.count("at_cap") + 1
    assert r.count("cancelled") == 1  # closed before it started: its slot is back all the same
    assert r.slots_held() == 0
    assert abs(decided - n * p) <= 4 * math.sqrt(n * p * (1 - p)), decided


async def test_past_max_concurrent_a_copy_is_dropped_as_at_cap(engines: Engines) -> None:
    async with rig(shadow_policy(engines, max_concurrent=2)) as r:
        handles = [r.runner.copy(r.context(max_tokens=LONG), r.group) for _ in range(3)]
        assert [h is not None for h in handles] == [True, True, False]
        assert r.count("at_cap") == 1
        assert r.runner.in_flight == 2
        assert r.slots_held() == 2


async def test_without_room_on_the_shadow_backend_a_copy_is_dropped_as_no_room(engines: Engines) -> None:
    async with rig(shadow_policy(engines, slots=1)) as r:
        handles = [r.runner.copy(r.context(max_tokens=LONG), r.group) for _ in range(2)]
        assert [h is not None for h in handles] == [True, False]
        assert r.count("no_room") == 1
        assert r.runner.in_flight == 1


async def test_a_copy_never_takes_a_backend_a_real_request_waits_for(engines: Engines) -> None:
    """Backend ``solo`` serves both models, two requests and 100 tokens at once: a real request
    of about 60 tokens holds it, another waits for it (it does not fit beside the first); a copy
    of a dozen tokens would fit, but is refused rather than placed in front of the waiting request."""
    async with rig(shadow_policy(engines, slots=2, tokens=100, shared=True)) as r:
        ctx = r.context(max_tokens=55)
        interactive = r.snapshot.policy.classes["interactive"]

        def acquire() -> Any:
            return r.dispatcher.acquire(ctx.request, ctx.tenant, "interactive", interactive, ctx.deadline)

        holder = await acquire()
        waiter = asyncio.create_task(acquire())
        await eventually(lambda: r.dispatcher.depth(PRIMARY, interactive.rank) == 1, what="the request to wait")
        assert r.runner.copy(r.context(max_tokens=1), r.group) is None
        assert r.count("no_room") == 1
        r.dispatcher.give_back(PRIMARY, holder)  # the slot goes to the waiting request at once
        r.dispatcher.give_back(PRIMARY, await asyncio.wait_for(waiter, 5))
        assert r.runner.copy(r.context(max_tokens=1), r.group) is not None  # nobody waits: placed
        await eventually(lambda: r.runner.in_flight == 0, what="the copy to end")
        assert r.count("completed") == 1
        assert r.slots_held() == 0


# --- preemption and shutdown --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "real_model",
    [PRIMARY, CANDIDATE],
    ids=["a request of the group's target on the shared backend", "a request of the shadow model itself"],
)
async def test_a_copy_holding_the_only_slot_gives_way_to_a_real_request_that_must_wait(
    engines: Engines, real_model: str
) -> None:
    aborted = metric(engines.candidate, "sim:requests_aborted_total")
    async with rig(shadow_policy(engines, slots=1, shared=True)) as r:
        assert r.runner.copy(r.context(max_tokens=LONG), r.group) is not None
        await eventually(lambda: running(engines.candidate) >= 1, what="the copy to reach the engine")
        ctx = r.context(max_tokens=4, model=real_model)
        interactive = r.snapshot.policy.classes["interactive"]
        grant = await asyncio.wait_for(
            r.dispatcher.acquire(ctx.request, ctx.tenant, "interactive", interactive, ctx.deadline), 5
        )
        assert grant.state.name == "solo"
        assert grant.queued_s > 0  # it waited, and got the slot the copy gave back
        assert r.count("preempted") == 1
        assert r.runner.in_flight == 0
        assert r.slots_held() == 1
        r.dispatcher.give_back(real_model, grant)
        assert r.slots_held() == 0
    await eventually(
        lambda: metric(engines.candidate, "sim:requests_aborted_total") == aborted + 1,
        what="the engine to abort the preempted copy",
    )


async def test_aclose_cancels_every_copy_gives_every_slot_back_and_leaves_no_task(engines: Engines) -> None:
    aborted = metric(engines.candidate, "sim:requests_aborted_total")
    async with rig(shadow_policy(engines, max_concurrent=3)) as r:
        for _ in range(3):
            assert r.runner.copy(r.context(max_tokens=LONG), r.group) is not None
        await eventually(lambda: running(engines.candidate) >= 3, what="the copies to reach the engine")
        assert len(shadow_tasks()) == 3
        await r.runner.aclose()
        assert shadow_tasks() == []
        assert r.runner.in_flight == 0
        assert r.slots_held() == 0
        assert r.count("cancelled") == 3
        assert r.runner.copy(r.context(), r.group) is None  # closed: no more copies
    await eventually(
        lambda: metric(engines.candidate, "sim:requests_aborted_total") >= aborted + 1,
        what="the engine to abort the cancelled copies",
    )


# --- the dispatcher's part: place_now and request_waits -------------------------------------------------------


def placing_dispatcher(observer: DispatchObserver | None = None, **capacity: Any) -> tuple[Dispatcher, PolicySnapshot]:
    """Model ``m`` on backend ``b`` (``capacity``); batch may hold half of it; no engine needed."""
    text = build_policy(
        NOWHERE,
        classes={"batch": {"max_share": 0.5}},
        models=[model("m")],
        backends=[backend_entry("b", NOWHERE, ["m"], kind="sim", capacity=capacity)],
        tenants=[tenant("acme", "key-acme")],
    )
    snapshot = parse_policy(text, "t.yaml")
    router = LeastLoadRouter()
    return Dispatcher(BackendPool(snapshot), lambda _: router, FakeClock(), snapshot, observer=observer), snapshot


def small_request() -> InferenceRequest:
    return InferenceRequest("id", CHAT, "m", {}, b"", True, False, 5, 5, 0.0)


def test_place_now_keeps_to_the_class_s_share_and_its_grant_is_given_back_like_any_other() -> None:
    dispatcher, snapshot = placing_dispatcher(max_concurrent=4)
    acme, batch = snapshot.policy.tenants[0], snapshot.policy.classes["batch"]
    grants = [dispatcher.place_now(small_request(), acme, batch) for _ in range(3)]
    assert [g is not None for g in grants] == [True, True, False]  # half of four slots
    (state,) = dispatcher.pool.all()
    assert (state.in_flight, state.in_flight_tokens) == (2, 20)
    for grant in grants[:2]:
        assert grant is not None
        dispatcher.give_back("m", grant)
    assert (state.in_flight, state.in_flight_tokens) == (0, 0)


def test_place_now_answers_none_instead_of_raising_without_a_healthy_backend_or_while_draining() -> None:
    dispatcher, snapshot = placing_dispatcher()
    acme, batch = snapshot.policy.tenants[0], snapshot.policy.classes["batch"]
    (state,) = dispatcher.pool.all()
    state.healthy = False
    assert dispatcher.place_now(small_request(), acme, batch) is None
    state.healthy = True
    dispatcher.draining = True
    assert dispatcher.place_now(small_request(), acme, batch) is None
    unknown = InferenceRequest("id", CHAT, "nowhere", {}, b"", True, False, 5, 5, 0.0)
    dispatcher.draining = False
    assert dispatcher.place_now(unknown, acme, batch) is None
    assert state.in_flight == 0


class SeesWaits(DispatchObserver):
    """Notes the backends each waiting request is told to wait for, and the queue's depth then."""

    def __init__(self) -> None:
        self.dispatcher: Dispatcher | None = None
        self.seen: list[tuple[list[str], int]] = []

    def request_waits(self, states: Sequence[BackendState]) -> int:
        assert self.dispatcher is not None
        self.seen.append(([s.name for s in states], self.dispatcher.depth("m", 0)))
        return 0


async def test_the_observer_is_told_the_lane_s_backends_before_the_waiting_request_is_judged() -> None:
    observer = SeesWaits()
    dispatcher, snapshot = placing_dispatcher(observer, max_concurrent=1)
    observer.dispatcher = dispatcher
    acme, interactive = snapshot.policy.tenants[0], snapshot.policy.classes["interactive"]
    seen = observer.seen
    holder = await dispatcher.acquire(small_request(), acme, "interactive", interactive, 1e9)
    assert seen == []  # the fast path never calls it
    waiter = asyncio.create_task(dispatcher.acquire(small_request(), acme, "interactive", interactive, 1e9))
    await eventually(lambda: bool(seen), what="the request to wait")
    assert seen == [(["b"], 0)]  # before its ticket is queued: the queue bound may not refuse it
    dispatcher.give_back("m", holder)
    dispatcher.give_back("m", await asyncio.wait_for(waiter, 5))
