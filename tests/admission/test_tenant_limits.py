"""Tenant limits (``gateway/admission/tenant_limits.py``: rpm, tpm, concurrency), their headers and
settlement (debts included), refused requests charged; priority class resolution; and what a
tenant pays, seen by a client.

Seen by a client: refused requests cost a request, and usage above the reservation costs tokens. A
gateway of its own per test (its limits are small on purpose), the session's fake backend behind
it. The fake backend ignores ``max_tokens``: it answers ``tokens`` completion tokens and 7 prompt
tokens, whatever it was asked, like a backend that overruns its reservation.
"""

from __future__ import annotations

import httpx
import pytest

from gateway.admission.tenant_limits import (
    SLOT_REFUSAL_MEMORY_S,
    TenantLimiter,
    charged_tokens,
    format_duration,
    resolve_class,
)
from gateway.dialects.chat import CHAT
from gateway.errors import InvalidRequest, Overloaded
from gateway.limitstore.memory import MemoryLimitStore
from gateway.policy.model import Tenant
from gateway.policy.snapshot import PolicySnapshot
from gateway.service import parse_policy
from gateway.types import InferenceRequest
from tests.conftest import CHAT_MODEL, KEY_ACME, BackendServer, StartGateway
from tests.fake_backend import FakeBackend
from tests.fake_clock import FakeClock
from tests.policy_builder import NOWHERE, backend, build_policy, model, session_policy, tenant


def policy(**limits: int) -> PolicySnapshot:
    """One tenant ``t`` of class ``standard`` (between ``interactive`` and ``batch``) with ``limits``."""
    text = build_policy(
        version="t",
        classes={
            "standard": {"rank": 1, "slo": {"ttft_ms": 2000, "itl_ms": 100, "e2e_ms": 60000}},
            "batch": {"rank": 2, "slo": {"ttft_ms": 9000, "itl_ms": 100, "e2e_ms": 60000}},
        },
        models=[model("m")],
        backends=[backend("b", NOWHERE, ["m"], kind="sim")],
        tenants=[tenant("t", "k", default_class="standard", limits=limits)],
    )
    return parse_policy(text, "t.yaml")


def request(prompt: int = 10, max_tokens: int = 90, n: int | None = None) -> InferenceRequest:
    body = {} if n is None else {"n": n}
    return InferenceRequest("id", CHAT, "m", body, b"", False, False, prompt, max_tokens, 0.0)


def limiter() -> tuple[TenantLimiter, FakeClock]:
    clock = FakeClock()
    return TenantLimiter(MemoryLimitStore(clock), clock), clock


def tenant_of(snapshot: PolicySnapshot) -> Tenant:
    return snapshot.policy.tenants[0]


async def test_requests_per_minute_refuse_with_429_and_a_retry_after_from_the_refill() -> None:
    tenant = tenant_of(policy(rpm=2))
    limits, _ = limiter()
    for _ in range(2):
        await limits.admit(tenant, request())
    with pytest.raises(Overloaded) as refused:
        await limits.admit(tenant, request())
    error = refused.value
    assert (error.status, error.code) == (429, "tenant_rate_limited")
    assert error.headers["retry-after"] == "30"  # one request refills in 60/2 s
    assert error.headers["x-ratelimit-remaining-requests"] == "0"
    assert "2 requests per minute" in error.message


async def test_tokens_are_reserved_then_settled_with_real_usage() -> None:
    tenant = tenant_of(policy(tpm=1000))
    limits, _ = limiter()
    first = await limits.admit(tenant, request(10, 490))
    assert dict(first.headers)[b"x-ratelimit-remaining-tokens"] == b"500"
    await limits.settle(first, used_tokens=100)  # 400 unused come back
    second = await limits.admit(tenant, request(10, 490))
    assert dict(second.headers)[b"x-ratelimit-remaining-tokens"] == b"400"
    with pytest.raises(Overloaded) as refused:
        await limits.admit(tenant, request(10, 490))
    assert refused.value.code == "tenant_token_limited"


async def test_a_request_larger_than_the_minute_is_refused_without_retry() -> None:
    tenant = tenant_of(policy(tpm=100))
    limits, _ = limiter()
    with pytest.raises(Overloaded) as refused:
        await limits.admit(tenant, request(10, 500))
    assert refused.value.headers["x-should-retry"] == "false"


async def test_a_request_the_system_refused_gives_everything_back() -> None:
    tenant = tenant_of(policy(rpm=1, tpm=1000, max_concurrent=1))
    limits, _ = limiter()
    admission = await limits.admit(tenant, request())
    await limits.settle(admission, used_tokens=None)
    again = await limits.admit(tenant, request())
    assert dict(again.headers)[b"x-ratelimit-remaining-requests"] == b"0"
    assert dict(again.headers)[b"x-ratelimit-remaining-tokens"] == b"900"


async def test_concurrency_is_limited_and_freed_at_settlement() -> None:
    tenant = tenant_of(policy(max_concurrent=1))
    limits, _ = limiter()
    held = await limits.admit(tenant, request())
    with pytest.raises(Overloaded) as refused:
        await limits.admit(tenant, request())
    assert refused.value.code == "tenant_concurrency_limited"
    await limits.settle(held, used_tokens=50)
    await limits.admit(tenant, request())


async def test_the_bucket_refills_with_time() -> None:
    tenant = tenant_of(policy(rpm=60))
    limits, clock = limiter()
    for _ in range(60):
        await limits.admit(tenant, request())
    with pytest.raises(Overloaded):
        await limits.admit(tenant, request())
    clock.advance(1.0)
    await limits.admit(tenant, request())


async def test_usage_above_the_reservation_puts_the_tenant_in_debt_until_the_refill_pays_it() -> None:
    tenant = tenant_of(policy(tpm=600))  # 10 tokens a second
    limits, clock = limiter()
    admission = await limits.admit(tenant, request(10, 90))  # reserves 100
    await limits.settle(admission, used_tokens=700)  # the backend produced far more than reserved
    with pytest.raises(Overloaded) as refused:
        await limits.admit(tenant, request(10, 90))
    error = refused.value
    assert error.code == "tenant_token_limited"
    assert "in debt" in error.message
    assert error.headers["retry-after"] == "20"  # from -100 to 100 at 10 per second
    assert error.headers["x-ratelimit-remaining-tokens"] == "0"
    clock.advance(19.9)
    with pytest.raises(Overloaded):
        await limits.admit(tenant, request(10, 90))
    clock.advance(0.2)
    await limits.admit(tenant, request(10, 90))


async def test_a_tenant_that_overruns_every_reservation_cannot_exceed_its_minute() -> None:
    """The issue's case: tpm 5,000, requests reserving 100 and using 2,000; settlement used to only refund."""
    tenant = tenant_of(policy(tpm=5000))
    limits, clock = limiter()
    consumed = 0
    for _ in range(57):
        try:
            admission = await limits.admit(tenant, request(10, 90))
        except Overloaded:
            clock.advance(1.0)
            continue
        await limits.settle(admission, used_tokens=2000)
        consumed += 2000
        clock.advance(1.0)
    # The bucket's capacity, its refill over 57 s, and the one overrun charged after its admission.
    assert consumed <= 5000 + 5000 / 60 * 57 + 2000
    with pytest.raises(Overloaded) as refused:
        await limits.admit(tenant, request(10, 90))
    assert refused.value.headers["x-ratelimit-remaining-tokens"] == "0", "the bucket must not read full"


async def test_the_reservation_covers_every_choice_of_n() -> None:
    tenant = tenant_of(policy(tpm=1000))
    limits, _ = limiter()
    admission = await limits.admit(tenant, request(10, 90, n=3))
    assert admission.reserved_tokens == 280
    assert dict(admission.headers)[b"x-ratelimit-remaining-tokens"] == b"720"


async def test_a_request_refused_before_admission_costs_one_request_per_minute() -> None:
    tenant = tenant_of(policy(rpm=3))
    limits, clock = limiter()
    await limits.charge_rejected(tenant)
    await limits.charge_rejected(tenant)
    limits.precheck(tenant)  # one request left
    await limits.admit(tenant, request())
    await limits.charge_rejected(tenant)  # nothing left to take: the tenant is now known to be out
    with pytest.raises(Overloaded) as refused:
        limits.precheck(tenant)
    assert refused.value.code == "tenant_rate_limited"
    assert refused.value.headers["retry-after"] == "20"
    clock.advance(20.0)
    limits.precheck(tenant)


async def test_a_tenant_refused_for_its_rate_is_refused_before_its_body_is_read() -> None:
    tenant = tenant_of(policy(rpm=1))
    limits, clock = limiter()
    await limits.admit(tenant, request())
    with pytest.raises(Overloaded):
        await limits.admit(tenant, request())
    with pytest.raises(Overloaded) as early:
        limits.precheck(tenant)
    assert early.value.headers["retry-after"] == "60"
    clock.advance(60.0)
    limits.precheck(tenant)
    await limits.admit(tenant, request())


async def test_a_concurrency_refusal_refuses_the_next_requests_before_their_body_for_a_moment() -> None:
    """Remembered, not charged: no store call, no body read, and not one request of its rpm."""
    tenant = tenant_of(policy(max_concurrent=1, rpm=10))
    limits, clock = limiter()
    held = await limits.admit(tenant, request())
    with pytest.raises(Overloaded):
        await limits.admit(tenant, request())
    with pytest.raises(Overloaded) as early:
        limits.precheck(tenant)
    assert (early.value.status, early.value.code) == (429, "tenant_concurrency_limited")
    assert early.value.headers["retry-after"] == "1"
    clock.advance(SLOT_REFUSAL_MEMORY_S)
    limits.precheck(tenant)  # a slot may have been freed elsewhere: the store is asked again
    await limits.settle(held, used_tokens=50)
    admitted = await limits.admit(tenant, request())
    assert admitted.headers[1] == (b"x-ratelimit-remaining-requests", b"8"), "refusals must not spend rpm"


async def test_a_slot_released_in_this_process_ends_the_remembered_refusal_at_once() -> None:
    tenant = tenant_of(policy(max_concurrent=1))
    limits, _ = limiter()
    held = await limits.admit(tenant, request())
    with pytest.raises(Overloaded):
        await limits.admit(tenant, request())
    await limits.settle(held, used_tokens=50)
    limits.precheck(tenant)
    await limits.admit(tenant, request())


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        pytest.param({"usage": {"total_tokens": 321}}, 321, id="the backend's usage when it gave one"),
        pytest.param({"usage": {"prompt_tokens": 20, "completion_tokens": 5}}, 25, id="prompt plus completion"),
        pytest.param({"reached_backend": False}, None, id="never reached a backend: everything back"),
        pytest.param({"completed": True}, 500, id="completed without usage: the reservation"),
        pytest.param({}, 107, id="cut short: the prompt estimate plus the chunks sent"),
    ],
)
def test_what_a_finished_request_is_charged(outcome: dict[str, object], expected: int | None) -> None:
    facts: dict[str, object] = {"usage": None, "reached_backend": True, "completed": False}
    facts.update(outcome)
    charged = charged_tokens(reserved=500, prompt_estimate=100, outputs_sent=7, **facts)  # type: ignore[arg-type]
    assert charged == expected


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        pytest.param(None, "standard", id="no header keeps the tenant default"),
        pytest.param(b"batch", "batch", id="a client may lower its class"),
        pytest.param(b"interactive", "standard", id="a client may not raise its class"),
        pytest.param(b"standard", "standard", id="naming the default changes nothing"),
    ],
)
def test_priority_class_resolution(header: bytes | None, expected: str) -> None:
    snapshot = policy()
    assert resolve_class(tenant_of(snapshot), header, snapshot)[0] == expected


def test_an_unknown_priority_class_is_a_400() -> None:
    snapshot = policy()
    with pytest.raises(InvalidRequest) as refused:
        resolve_class(tenant_of(snapshot), b"urgent", snapshot)
    assert refused.value.code == "invalid_priority"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.02, "20ms"), (1.5, "1.5s"), (360, "6m0s"), (0, "0ms")],
    ids=["milliseconds", "seconds", "minutes", "zero"],
)
def test_reset_durations_use_openai_format(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


# What a tenant pays, seen by a client


AUTH = {"authorization": f"Bearer {KEY_ACME}"}
VALID = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
INVALID = {"model": CHAT_MODEL, "messages": "not a list"}


def test_invalid_requests_spend_the_tenants_requests_per_minute(
    backend_server: BackendServer, backend: FakeBackend, start_gateway: StartGateway
) -> None:
    text = session_policy(backend_server.url, tenants={"acme": {"limits": {"rpm": 3}}})
    with start_gateway(text, health_checks=False) as url, httpx.Client(base_url=url, headers=AUTH) as http:
        statuses = [http.post("/v1/chat/completions", json=INVALID).status_code for _ in range(3)]
        assert statuses == [400, 400, 400]
        refused = http.post("/v1/chat/completions", json=VALID)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "tenant_rate_limited"
        early = http.post("/v1/chat/completions", content=b"{" * 100_000)  # not even parsed now
        assert early.status_code == 429
        assert int(early.headers["retry-after"]) >= 1
    assert backend.received == []


def test_a_body_refused_for_its_size_or_its_structure_costs_a_request_too(
    backend_server: BackendServer, backend: FakeBackend, start_gateway: StartGateway
) -> None:
    text = session_policy(backend_server.url, tenants={"acme": {"limits": {"rpm": 2}}})
    huge = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "x" * 70_000}]}
    many = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "x"}] * 1000}
    with start_gateway(text, health_checks=False) as url, httpx.Client(base_url=url, headers=AUTH) as http:
        too_large = http.post("/v1/chat/completions", json=huge)
        assert (too_large.status_code, too_large.json()["error"]["code"]) == (413, "request_too_large")
        too_many = http.post("/v1/chat/completions", json=many)
        assert (too_many.status_code, too_many.json()["error"]["code"]) == (400, "too_many_messages")
        assert http.post("/v1/chat/completions", json=VALID).status_code == 429


def test_usage_above_the_reservation_is_charged_to_the_tenants_tokens(
    backend_server: BackendServer, backend: FakeBackend, start_gateway: StartGateway
) -> None:
    backend.tokens = 60  # asked for 1 token, answers 60 (and 7 prompt tokens)
    text = session_policy(backend_server.url, tenants={"acme": {"limits": {"tpm": 600}}})  # 10 a second
    with start_gateway(text, health_checks=False) as url, httpx.Client(base_url=url, headers=AUTH) as http:
        first = http.post("/v1/chat/completions", json=VALID)
        assert first.status_code == 200, first.text
        reserved = 600 - int(first.headers["x-ratelimit-remaining-tokens"])
        assert reserved < 10  # the prompt estimate plus max_tokens 1
        second = http.post("/v1/chat/completions", json=VALID)
        remaining = int(second.headers["x-ratelimit-remaining-tokens"])
        # 67 used by the first (not the few it reserved), the second's reservation, a little refill.
        assert remaining <= 600 - 67 - reserved + 20, remaining
        for _ in range(12):
            last = http.post("/v1/chat/completions", json=VALID)
            if last.status_code == 429:
                break
        assert last.status_code == 429, "ten overruns of 67 tokens must exhaust 600 tokens a minute"
        assert last.json()["error"]["code"] == "tenant_token_limited"
