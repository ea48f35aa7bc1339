"""A shadow copy pays its share of a priced backend's bill under its group, never another tenant.

Real parts: a gateway on loopback (``serve_gateway_in_thread``), the recording fake backend
(``tests/fake_backend.py``, 7 prompt tokens and ``tokens`` completion tokens a request) behind
every backend, the official SDK as client, /metrics as the dashboard reads it. Backend ``shared``
costs $1 a second and serves the group's shadow model ``cand`` and globex's plain model
``plain``; the group ``chat`` (acme's) answers from ``pub`` on the unpriced backend ``primary``
and copies every request to ``cand``. The test closes the cost interval itself, ten seconds after
it began on the gateway's clock (``CostMeter.close_interval``), once every request and copy is
recorded, as ``tests/telemetry/test_cost_meter.py`` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from gateway.service import Gateway, parse_policy
from gateway.settings import Settings
from tests.conftest import KEY_ACME, KEY_GLOBEX, metric
from tests.fake_backend import FakeBackend
from tests.policy_builder import backend, build_policy, model, tenant
from tests.servers import serve_gateway_in_thread, serve_in_thread, wait_until

GROUP, PRIMARY, CANDIDATE, PLAIN = "chat", "pub", "cand", "plain"
SHADOW_TENANT = f"~shadow:{GROUP}"
"""The tenant label the group's copies are charged under (``gateway/telemetry/cost_meter.py``)."""
PER_SECOND = 1.0
INTERVAL_S = 10.0
PROMPT_TOKENS = 7  # what the fake backend reports for every prompt
COPIES, COPY_OUTPUT = 3, 20
PLAIN_REQUESTS, PLAIN_OUTPUT = 2, 4


def billing_policy(url: str) -> str:
    return build_policy(
        version="shadow-billing",
        models=[model(name, max_prompt_tokens=64, max_output_tokens=64) for name in (PRIMARY, CANDIDATE, PLAIN)],
        model_groups=[
            {
                "name": GROUP,
                "targets": [{"model": PRIMARY}],
                "shadow": {"model": CANDIDATE, "percent": 100, "max_concurrent": 8},
            }
        ],
        backends=[
            backend("primary", url, [PRIMARY]),
            backend("shared", url, [CANDIDATE, PLAIN], price_per_gpu_hour=PER_SECOND * 3600),
        ],
        tenants=[tenant("acme", KEY_ACME, models=[GROUP]), tenant("globex", KEY_GLOBEX, models=[PLAIN])],
        health_checks={"interval_s": 0.05, "timeout_s": 0.5},
        telemetry={"cost_interval_s": 3600},
    )


@pytest.fixture
def fake() -> Iterator[tuple[FakeBackend, str]]:
    server = FakeBackend()
    with serve_in_thread(server) as url:
        yield server, url


@contextmanager
def gateway(tmp_path: Path, backend_url: str) -> Iterator[tuple[str, Gateway]]:
    path = tmp_path / "policy.yaml"
    text = billing_policy(backend_url)
    path.write_text(text)
    settings = Settings(policy_path=str(path), port=0, admin_port=0)
    with serve_gateway_in_thread(settings, parse_policy(text, str(path))) as built:
        assert built.app.gateway is not None
        yield built.api_url, built.app.gateway


def ask(url: str, key: str, model_name: str) -> None:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10) as sdk:
        answer = sdk.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=32
        )
        assert answer.choices[0].message.content


def test_the_shadows_engine_time_is_its_groups_not_the_other_tenants_of_its_backend(
    tmp_path: Path, fake: tuple[FakeBackend, str]
) -> None:
    server, backend_url = fake
    with gateway(tmp_path, backend_url) as (url, gw):
        server.tokens = COPY_OUTPUT
        for _ in range(COPIES):
            ask(url, KEY_ACME, GROUP)
        wait_until(
            lambda: metric(url, "gateway_shadow_requests_total", group=GROUP, outcome="completed") == COPIES,
            what="every copy completed",
        )
        server.tokens = PLAIN_OUTPUT
        for _ in range(PLAIN_REQUESTS):
            ask(url, KEY_GLOBEX, PLAIN)
        wait_until(
            lambda: metric(url, "gateway_requests_total") == COPIES + PLAIN_REQUESTS, what="every request recorded"
        )
        gw.costs.close_interval(gw.costs.accountant.interval_start + INTERVAL_S)

        def dollars(**labels: str) -> float:
            return metric(url, "gateway_cost_dollars_total", **labels)

        bill = PER_SECOND * INTERVAL_S
        copy_tokens = COPIES * (PROMPT_TOKENS + COPY_OUTPUT)
        plain_tokens = PLAIN_REQUESTS * (PROMPT_TOKENS + PLAIN_OUTPUT)
        globex, shadow = dollars(tenant="globex"), dollars(tenant=SHADOW_TENANT)
        assert globex == pytest.approx(bill * plain_tokens / (plain_tokens + copy_tokens)), "its own tokens' share"
        assert shadow == pytest.approx(bill * copy_tokens / (plain_tokens + copy_tokens)), "the copies' share"
        assert globex / plain_tokens == pytest.approx(shadow / copy_tokens), "one price per token, whoever sent it"
        assert dollars(tenant=SHADOW_TENANT, model=CANDIDATE, **{"class": "batch"}) == shadow
        assert dollars(tenant="acme") == 0.0, "acme's own requests ran on the unpriced backend: no copy is acme's"
        shadow_requests = metric(url, "gateway_cost_requests_total", tenant=SHADOW_TENANT)
        shadow_goodput = metric(url, "gateway_cost_goodput_requests_total", tenant=SHADOW_TENANT)
        assert (shadow_requests, shadow_goodput) == (COPIES, 0), "copies count as requests, never as goodput"
        unattributed = metric(url, "gateway_cost_unattributed_dollars_total")
        assert (dollars(), unattributed) == (pytest.approx(bill), 0.0), "the totals still add up to the bill"
