"""Cost attribution on a running gateway: real requests through the SDK, real /metrics.

Prices are chosen so the arithmetic is plain: ``a`` costs $3,600 an hour ($1 a second, as two
GPUs at $1,800), ``b`` $2 a second, ``d`` $1 a second and serves a model nobody asks for (idle),
``c`` has no price. Each model has one backend, so a model's dollars are its backend's.
The test closes the interval itself, ten seconds after it began on the gateway's clock
(``CostMeter.close_interval(now)``), so no test waits for the gateway's timer; the timer is
tested on its own with a short interval. It does so from the test thread once the gateway is
quiet (every request recorded, its own timer an hour away), so nothing else touches the meter.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.policy.loader import PolicyError
from gateway.service import Gateway, parse_policy
from gateway.settings import Settings
from gateway.telemetry.token_stats import TokenStats
from gateway.telemetry.tracelog import TraceLog, TraceLogConfig
from tests.conftest import KEY_ACME, KEY_GLOBEX, metric
from tests.fake_backend import FakeBackend
from tests.policy_builder import build_policy, model
from tests.servers import metric_types, samples, serve_gateway_in_thread, serve_in_thread, wait_until

PROMPT_TOKENS = 7  # what the fake backend reports for every prompt
INTERVAL_S = 10.0
PER_SECOND = {"a": 1.0, "b": 2.0, "d": 1.0}


Entry = dict[str, Any] | None
Slo = dict[str, float]
SLO: Slo = {"ttft_ms": 10000, "itl_ms": 10000, "e2e_ms": 60000}


def policy(
    backend_url: str, *, version: str = "cost-1", cost_interval_s: float = 3600, slo: Slo = SLO, **backends: Entry
) -> str:
    """Four models, one backend each; ``backends`` overrides (or, given ``None``, removes) entries."""
    entries: dict[str, Entry] = {
        "a": {"models": ["m/chat"], "price_per_gpu_hour": 1800, "gpus": 2},
        "b": {"models": ["m/other"], "price_per_gpu_hour": 7200},
        "c": {"models": ["m/free"]},
        "d": {"models": ["m/idle"], "price_per_gpu_hour": 3600},
    }
    entries.update(backends)
    served = [m for entry in entries.values() if entry is not None for m in entry["models"]]
    return build_policy(
        version=version,
        classes={"interactive": {"slo": slo}, "batch": {"slo": slo}},
        models=[model(m, max_prompt_tokens=64, max_output_tokens=64) for m in served],
        backends=[
            {"name": name, "url": backend_url, "kind": "vllm", **entry}
            for name, entry in entries.items()
            if entry is not None
        ],
        tenants={"globex": {"models": ["*"]}},
        health_checks={"interval_s": 0.05, "timeout_s": 0.5},
        lifecycle={"watch_interval_s": 0.05},
        telemetry={"cost_interval_s": cost_interval_s},
    )


@contextmanager
def gateway(tmp_path: Path, text: str, **settings: Any) -> Iterator[tuple[str, Gateway, Path]]:
    """A gateway serving ``text`` on loopback: its URL, the ``Gateway`` inside, its policy file."""
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    config = Settings(policy_path=str(path), port=0, admin_port=0, **settings)
    with serve_gateway_in_thread(config, parse_policy(text, str(path))) as built:
        assert built.app.gateway is not None
        yield built.api_url, built.app.gateway, path


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeBackend, str]]:
    backend = FakeBackend()
    with serve_in_thread(backend) as url:
        yield backend, url


def ask(url: str, key: str, model: str, fake: FakeBackend, tokens: int) -> None:
    fake.tokens = tokens
    with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10) as sdk:
        stream = sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=64, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def wait_for_requests(gw: Gateway, count: int) -> None:
    """``Gateway.record`` runs after the last byte: wait until the meter has every request."""
    wait_until(lambda: gw.costs.accountant.pending_requests == count, what=f"{count} requests recorded")


def prices_shown(url: str) -> dict[str, float]:
    """The per-backend prices the gateway's /metrics shows (``gateway_cost_backend_price_dollars_per_hour``)."""
    shown = samples(url, "gateway_cost_backend_price_dollars_per_hour")
    return {dict(labels)["backend"]: value for labels, value in shown.items()}


def test_the_bill_is_split_by_tokens_and_what_nobody_used_is_exported_as_unattributed(
    tmp_path: Path, fake: tuple[FakeBackend, str]
) -> None:
    backend, backend_url = fake
    with gateway(tmp_path, policy(backend_url)) as (url, gw, _):
        ask(url, KEY_ACME, "m/chat", backend, tokens=4)
        ask(url, KEY_GLOBEX, "m/chat", backend, tokens=20)
        ask(url, KEY_ACME, "m/other", backend, tokens=4)
        ask(url, KEY_ACME, "m/free", backend, tokens=4)
        wait_for_requests(gw, 4)
        gw.costs.close_interval(gw.costs.accountant.interval_start + INTERVAL_S)

        def dollars(**labels: str) -> float:
            return metric(url, "gateway_cost_dollars_total", **labels)

        acme_chat, globex_chat = dollars(tenant="acme", model="m/chat"), dollars(tenant="globex", model="m/chat")
        assert acme_chat + globex_chat == pytest.approx(PER_SECOND["a"] * INTERVAL_S)
        small, large = PROMPT_TOKENS + 4, PROMPT_TOKENS + 20
        assert globex_chat / acme_chat == pytest.approx(large / small), "shares follow tokens"
        assert dollars(model="m/other") == pytest.approx(PER_SECOND["b"] * INTERVAL_S)
        assert dollars(model="m/free") == 0.0, "an unpriced backend costs nothing"
        assert metric(url, "gateway_cost_requests_total", model="m/free") == 1.0

        def unattributed(backend: str) -> float:
            return metric(url, "gateway_cost_unattributed_dollars_total", backend=backend)

        assert unattributed("d") == pytest.approx(PER_SECOND["d"] * INTERVAL_S), "the idle backend's bill"
        assert unattributed("a") == unattributed("b") == unattributed("c") == 0.0
        bill = sum(PER_SECOND.values()) * INTERVAL_S
        assert dollars() + metric(url, "gateway_cost_unattributed_dollars_total") == pytest.approx(bill)
        price = metric(url, "gateway_cost_backend_price_dollars_per_hour")
        assert price == pytest.approx(sum(PER_SECOND.values()) * 3600)

        for model, class_name in (("m/chat", "interactive"), ("m/chat", "batch"), ("m/other", "interactive")):
            goodput = metric(url, "gateway_cost_goodput_requests_total", model=model, **{"class": class_name})
            assert goodput == 1.0
            per_goodput = metric(url, "gateway_cost_per_goodput_request_dollars", model=model, **{"class": class_name})
            assert per_goodput == pytest.approx(dollars(model=model, **{"class": class_name}) / goodput)
        assert per_goodput == pytest.approx(PER_SECOND["b"] * INTERVAL_S)


def test_a_request_that_misses_its_slo_pays_but_is_no_goodput(tmp_path: Path, fake: tuple[FakeBackend, str]) -> None:
    backend, backend_url = fake
    text = policy(backend_url, slo={**SLO, "ttft_ms": 0.001})  # no first token is that fast
    with gateway(tmp_path, text) as (url, gw, _):
        ask(url, KEY_ACME, "m/chat", backend, tokens=4)
        wait_for_requests(gw, 1)
        gw.costs.close_interval(gw.costs.accountant.interval_start + INTERVAL_S)
        assert metric(url, "gateway_cost_dollars_total", model="m/chat") == pytest.approx(INTERVAL_S)
        assert metric(url, "gateway_cost_requests_total", model="m/chat") == 1.0
        assert metric(url, "gateway_cost_goodput_requests_total", model="m/chat") == 0.0
        assert samples(url, "gateway_cost_per_goodput_request_dollars") == {}


def test_a_reload_charges_the_old_prices_up_to_it_and_a_removed_backend_stops_costing(
    tmp_path: Path, fake: tuple[FakeBackend, str]
) -> None:
    backend, backend_url = fake
    with gateway(tmp_path, policy(backend_url)) as (url, gw, path):
        meter = gw.costs
        started = meter.accountant.interval_start
        ask(url, KEY_ACME, "m/chat", backend, tokens=4)
        wait_for_requests(gw, 1)
        cheaper_b = {"models": ["m/other"], "price_per_gpu_hour": 3600}
        path.write_text(policy(backend_url, version="cost-2", b=cheaper_b, d=None))
        # The policy's version changes before the listeners run: wait on the meter itself. Its
        # price gauge is the last thing a reprice sets, and /metrics is served on the gateway's
        # loop, so once it shows the new prices the whole reprice has happened.
        new_prices = {"a": 3600.0, "b": 3600.0}
        wait_until(lambda: prices_shown(url) == new_prices, what="the cost meter to follow the reload")

        reloaded = meter.accountant.interval_start
        old_bill = sum(PER_SECOND.values()) * (reloaded - started)
        assert reloaded > started, "the reload closed the running interval"
        total = metric(url, "gateway_cost_dollars_total") + metric(url, "gateway_cost_unattributed_dollars_total")
        assert total == pytest.approx(old_bill), "up to the reload, at the old prices"
        assert metric(url, "gateway_cost_dollars_total", model="m/chat") > 0
        assert dict(meter.accountant.prices) == new_prices

        d_before = metric(url, "gateway_cost_unattributed_dollars_total", backend="d")
        meter.close_interval(reloaded + INTERVAL_S)
        assert metric(url, "gateway_cost_unattributed_dollars_total", backend="d") == d_before, "d is gone"
        assert metric(url, "gateway_cost_unattributed_dollars_total", backend="b") == pytest.approx(
            (PER_SECOND["b"] * (reloaded - started)) + 1.0 * INTERVAL_S
        ), "b at $2/s up to the reload, $1/s after"
        assert metric(url, "gateway_cost_backend_price_dollars_per_hour", backend="d") == 0.0


def test_the_gateway_closes_intervals_on_its_own_timer(tmp_path: Path, fake: tuple[FakeBackend, str]) -> None:
    _, backend_url = fake
    with gateway(tmp_path, policy(backend_url, cost_interval_s=0.02)) as (url, _, _):
        wait_until(
            lambda: metric(url, "gateway_cost_unattributed_dollars_total", backend="d") > 0,
            what="the idle backend charged by the timer",
        )


def test_the_cost_metrics_are_on_metrics_before_any_request(tmp_path: Path, fake: tuple[FakeBackend, str]) -> None:
    _, backend_url = fake
    with gateway(tmp_path, policy(backend_url)) as (url, _, _):
        families = metric_types(url)
        unattributed = samples(url, "gateway_cost_unattributed_dollars_total")
        dropped = samples(url, "gateway_trace_log_dropped_total")
    assert {
        "gateway_cost_dollars": "counter",
        "gateway_cost_requests": "counter",
        "gateway_cost_goodput_requests": "counter",
        "gateway_cost_unattributed_dollars": "counter",
        "gateway_cost_per_goodput_request_dollars": "gauge",
        "gateway_cost_backend_price_dollars_per_hour": "gauge",
        "gateway_trace_log_dropped": "counter",
    }.items() <= families.items()
    assert unattributed.get((("backend", "d"),)) == 0.0
    assert (("backend", "c"),) not in unattributed, "c has no price"
    assert dropped == {(): 0.0}


def test_trace_log_records_refused_by_a_full_buffer_are_counted(tmp_path: Path, fake: tuple[FakeBackend, str]) -> None:
    backend, backend_url = fake
    log = tmp_path / "trace.jsonl"
    with gateway(tmp_path, policy(backend_url), trace_log_path=str(log)) as (url, gw, _):
        running = gw.recorder.trace_log
        assert running is not None
        # A writer that never drains (a stalled disk), with room for two records.
        stalled = gw.recorder.trace_log = TraceLog(TraceLogConfig(path=log, buffer_records=2))
        running.close()
        for _ in range(5):
            ask(url, KEY_ACME, "m/chat", backend, tokens=1)
        wait_until(lambda: metric(url, "gateway_trace_log_dropped_total") == 3.0, what="three records dropped")
        assert stalled.dropped == 3


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"price_per_gpu_hour": -1}, "backends[a].price_per_gpu_hour: must be greater than or equal to 0"),
        ({"gpus": 0}, "backends[a].gpus: must be greater than 0"),
    ],
    ids=["a negative price is refused", "zero GPUs are refused"],
)
def test_bad_prices_are_refused_at_load(entry: dict[str, Any], problem: str) -> None:
    text = policy("http://127.0.0.1:1", a={"models": ["m/chat"], **entry})
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, "p.yaml")
    assert caught.value.problems == [problem]


def test_tokens_are_prompt_plus_completion() -> None:
    def total(usage: dict[str, Any] | None) -> int:
        return TokenStats(0.0, None, (), usage, ()).total_tokens

    assert total({"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}) == 12
    assert total({"prompt_tokens": 7, "completion_tokens": None}) == 7
    assert total(None) == 0
