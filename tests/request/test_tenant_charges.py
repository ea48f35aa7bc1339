"""What a tenant pays, seen by a client: refused requests cost a request, and usage above the
reservation costs tokens.

A gateway of its own per test (its limits are small on purpose), the session's fake backend
behind it. The fake backend ignores ``max_tokens``: it answers ``tokens`` completion tokens and
7 prompt tokens, whatever it was asked, like a backend that overruns its reservation.
"""

from __future__ import annotations

import httpx

from tests.conftest import CHAT_MODEL, KEY_ACME, BackendServer, StartGateway
from tests.fake_backend import FakeBackend
from tests.policy_builder import session_policy

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
