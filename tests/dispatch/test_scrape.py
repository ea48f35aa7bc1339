"""An engine restarted between two health checks: the scraper sees it and its prefix index is voided."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from gateway.clock import MonotonicClock
from gateway.dispatch.backends import BackendPool
from gateway.dispatch.scrape import SaturationScraper, parse_saturation, restarted
from gateway.service import parse_policy
from loadtests.harness.processes import process
from tests.policy_builder import OMIT, backend, build_policy, model
from tests.servers import free_port

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
PAGE = b"""# HELP vllm:prompt_tokens_total Prompt tokens processed.
vllm:prompt_tokens_total{engine="0",model_name="m"} %d
vllm:generation_tokens_total{engine="0",model_name="m"} %d
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} %d
vllm:request_success_created{engine="0",finished_reason="length",model_name="m"} 1.7e+09
"""


def page(prompt: int, generated: int, finished: int, started: float | None = None) -> bytes:
    text = PAGE % (prompt, generated, finished)
    return text if started is None else text + b"process_start_time_seconds %f\n" % started


def test_counters_going_back_mean_a_restart() -> None:
    before = parse_saturation(page(5000, 300, 10))
    assert before.counters == (5000.0, 300.0, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert not restarted(before, parse_saturation(page(5600, 340, 11)))
    assert not restarted(before, parse_saturation(page(5000, 300, 10)))
    assert restarted(before, parse_saturation(page(120, 4, 1)))
    assert restarted(before, parse_saturation(page(5000, 299, 10)))


def test_a_new_process_start_time_means_a_restart_even_with_more_work_done() -> None:
    before = parse_saturation(page(5000, 300, 10, started=1000.0))
    assert before.started_at == 1000.0
    assert not restarted(before, parse_saturation(page(6000, 400, 12, started=1000.0)))
    assert restarted(before, parse_saturation(page(6000, 400, 12, started=1090.5)))


@contextmanager
def sim_process(port: int) -> Iterator[None]:
    argv = [sys.executable, "-m", "gateway", "sim", "--profile", "llama-3.1-8b-h100", "--port", str(port)]
    with process([*argv, "--time-scale", "0.01"], f"http://127.0.0.1:{port}/health"):
        yield


def serve_one(url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there " * 40}], "max_tokens": 4}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10).status_code == 200


def test_a_real_engine_restarted_on_its_port_between_scrapes_is_forgotten() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    text = build_policy(
        version="restart",
        classes={"batch": OMIT},
        models=[model(MODEL, max_prompt_tokens=8192)],
        backends=[backend("engine", url, [MODEL], kind="sim")],
        tenants={"globex": OMIT},
    )
    snapshot = parse_policy(text, "t.yaml")
    forgotten: list[str] = []
    pool = BackendPool(snapshot, on_forget=forgotten.append)

    scraper_client = httpx.AsyncClient()
    scraper = SaturationScraper(pool, scraper_client, MonotonicClock(), lambda: None)
    loop = asyncio.new_event_loop()
    try:
        with sim_process(port):
            serve_one(url)
            loop.run_until_complete(scraper.scrape_once(5.0))
            serve_one(url)
            loop.run_until_complete(scraper.scrape_once(5.0))
            assert forgotten == []  # the same process, doing more work: nothing to forget
        with sim_process(port):  # a new process on the same port, the backend never marked down
            loop.run_until_complete(scraper.scrape_once(5.0))
            assert forgotten == ["engine"]
            serve_one(url)
            loop.run_until_complete(scraper.scrape_once(5.0))
            assert forgotten == ["engine"]  # once per restart
    finally:
        loop.run_until_complete(scraper_client.aclose())
        loop.close()
    assert pool.for_model(MODEL)[0].healthy


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"], ids=["NaN", "plus infinity", "minus infinity"])
def test_a_scraped_value_that_is_not_a_finite_number_reads_as_idle(value: str) -> None:
    page = (
        f'vllm:num_requests_waiting{{model_name="m"}} {value}\n'
        f'vllm:num_requests_running{{model_name="m"}} {value}\n'
        f'vllm:kv_cache_usage_perc{{model_name="m"}} {value}\n'
    ).encode()
    saturation = parse_saturation(page)
    assert (saturation.waiting, saturation.running, saturation.kv_usage) == (0.0, 0.0, 0.0)


# llama-server --metrics (tools/server: gauges and counters without labels, ``# HELP``/``# TYPE`` each).
LLAMACPP_PAGE = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total %d
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total %d
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode counter
llamacpp:n_busy_slots_per_decode 3.5
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing %d
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred %d
"""


def llamacpp_page(prompt: int, predicted: int, processing: int, deferred: int) -> bytes:
    return (LLAMACPP_PAGE % (prompt, predicted, processing, deferred)).encode()


def test_a_llamacpp_page_gives_its_deferred_requests_as_waiting_and_its_busy_slots_as_running() -> None:
    signals = parse_saturation(llamacpp_page(800, 120, processing=4, deferred=46))
    assert (signals.waiting, signals.running, signals.kv_usage) == (46.0, 4.0, 0.0)
    assert 800.0 in signals.counters
    assert 120.0 in signals.counters


def test_a_llamacpp_server_restarted_is_seen_by_its_counters_going_back() -> None:
    before = parse_saturation(llamacpp_page(800, 120, 1, 0))
    assert not restarted(before, parse_saturation(llamacpp_page(900, 130, 2, 0)))
    assert restarted(before, parse_saturation(llamacpp_page(20, 3, 1, 0)))
