"""The closed loop end to end: a real simulated engine says what it reused, the router believes it.

The engine keeps a prompt's prefix only while the sequence runs (``--cache-scope running``), so
every later turn finds nothing cached while the gateway's index, built from its own decisions,
predicts a hit. Its answers say so (``usage.prompt_tokens_details``, llama.cpp's way: 0 included), and:

* the cache-truth counters show the prediction and the engine's figure apart;
* with the closed loop on, the first miss makes the index forget what it sent that engine no
  later than the missing block: an older conversation no longer counts as cached there;
* with it off, the index keeps believing.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from loadtests.sim import build_engine_app
from tests.conftest import StartGateway
from tests.policy_builder import OMIT, backend, build_policy, model
from tests.servers import metric, serve_in_thread

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
FIRST = "You answer questions about the tides of the North Sea, briefly and with numbers. " * 10
SECOND = "You help plan meals for a week from what the fridge holds, one line per day. " * 10


def policy(engine_url: str, *, closed_loop: bool) -> str:
    routing = {"strategy": "prefix_affinity", "block_tokens": 16, "index": {"closed_loop": closed_loop}}
    return build_policy(
        version="closed-loop",
        classes={"batch": OMIT},
        models=[model(MODEL, max_prompt_tokens=8192, routing=routing)],
        backends=[backend("engine", engine_url, [MODEL], kind="sim")],
        tenants={"globex": {"models": ["*"], "default_class": "interactive"}},
    )


@pytest.fixture
def running_scope_engine() -> Iterator[str]:
    """An engine that forgets a prompt as soon as its sequence ends, and answers as llama.cpp's server
    (its usage says ``cached_tokens`` even when it is 0; vLLM says nothing then, and a backend
    that never reported a figure is not judged: ``gateway/dispatch/cache_report.py``)."""
    app = build_engine_app("llama-3.1-8b-h100", time_scale=0.01, cache_scope="running", answer_format="llamacpp")
    with serve_in_thread(app) as url:
        yield url


def ask(gateway: str, *turns: str) -> dict[str, object]:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    response = httpx.post(
        f"{gateway}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 2},
        headers={"authorization": "Bearer key-globex"},
        timeout=10,
    )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert isinstance(usage, dict)
    return usage


def decisions(gateway: str, reason: str) -> float:
    return metric(gateway, "gateway_routing_decisions_total", model=MODEL, reason=reason)


def truth(gateway: str, name: str) -> float:
    return metric(gateway, name, backend="engine", model=MODEL)


def conversation_then_a_miss(gateway: str) -> None:
    """Two conversations, then the first one's next turn: the index predicts its prefix on the
    engine, which (running scope) no longer holds it."""
    ask(gateway, FIRST)
    ask(gateway, SECOND)
    assert decisions(gateway, "prefix_match") == 0
    ask(gateway, SECOND, "Monday: soup.", "And Tuesday?")
    assert decisions(gateway, "prefix_match") == 1, "the index predicted the second conversation's prefix"


def test_a_miss_is_counted_and_the_index_forgets_what_the_engine_evicted(
    start_gateway: StartGateway, running_scope_engine: str
) -> None:
    with start_gateway(policy(running_scope_engine, closed_loop=True), health_checks=False) as gateway:
        conversation_then_a_miss(gateway)
        assert truth(gateway, "gateway_prefix_cache_misses_total") == 1
        predicted = truth(gateway, "gateway_predicted_cached_tokens_total")
        assert predicted > 0
        assert truth(gateway, "gateway_predicted_cached_tokens_confirmed_total") == 0, "the engine held none of it"
        assert truth(gateway, "gateway_engine_cached_tokens_total") == 0
        computed = truth(gateway, "gateway_engine_computed_prompt_tokens_total")
        assert computed > predicted, "every prompt was computed whole"
        # The first conversation was sent before the block that went missing: it is forgotten.
        ask(gateway, FIRST, "Low tide?", "And high tide?")
        assert decisions(gateway, "prefix_match") == 1
        assert decisions(gateway, "no_prefix") == 3


def test_with_the_loop_off_the_index_keeps_believing(start_gateway: StartGateway, running_scope_engine: str) -> None:
    with start_gateway(policy(running_scope_engine, closed_loop=False), health_checks=False) as gateway:
        conversation_then_a_miss(gateway)
        assert truth(gateway, "gateway_prefix_cache_misses_total") == 1, "still measured"
        ask(gateway, FIRST, "Low tide?", "And high tide?")
        assert decisions(gateway, "prefix_match") == 2, "the index still predicts the first conversation"


def test_an_engine_that_holds_the_prefix_confirms_the_prediction(start_gateway: StartGateway) -> None:
    with (
        serve_in_thread(build_engine_app("llama-3.1-8b-h100", time_scale=0.01)) as engine,
        start_gateway(policy(engine, closed_loop=True), health_checks=False) as gateway,
    ):
        ask(gateway, FIRST)
        usage = ask(gateway, FIRST, "Low tide?", "And high tide?")
        assert decisions(gateway, "prefix_match") == 1
        assert truth(gateway, "gateway_prefix_cache_misses_total") == 0
        predicted = truth(gateway, "gateway_predicted_cached_tokens_total")
        confirmed = truth(gateway, "gateway_predicted_cached_tokens_confirmed_total")
        cached = truth(gateway, "gateway_engine_cached_tokens_total")
        details = usage["prompt_tokens_details"]
        assert isinstance(details, dict)
        assert cached == details["cached_tokens"] > 0
        assert predicted > 0
        assert confirmed / predicted > 0.8, (predicted, confirmed, cached)
