"""Injected faults on a real simulated engine over loopback: 503s, stalls, dropped connections.

Each test sets the fault through ``POST /admin/fault`` (as the gateway's fault scenarios do)
and drives the engine with httpx or the official SDK, then reads the engine's own counters.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import openai
import orjson
import pytest

from loadtests.sim import cli
from loadtests.sim.faults import Fault, FaultMode
from loadtests.sim.server import EngineApp
from tests.servers import metric, wait_until

SIM = "sim-model"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
Engine = Callable[..., AbstractContextManager[tuple[str, EngineApp]]]
FAST = {"ttft_ms": 10, "itl_ms": 5}


def set_fault(url: str, mode: str, after_tokens: int = 0) -> httpx.Response:
    return httpx.post(url + "/admin/fault", json={"mode": mode, "after_tokens": after_tokens})


def chat(max_tokens: int, *, model: str = SIM, stream: bool = True) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Hi."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def data_lines(lines: Iterator[str], n: int) -> list[Any]:
    """The next ``n`` SSE data payloads."""
    out: list[Any] = []
    while len(out) < n:
        line = next(lines)
        if line.startswith("data: "):
            out.append(orjson.loads(line[6:]))
    return out


def test_fail_503_answers_every_inference_request_but_health(sim_engine: Engine) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        assert set_fault(url, "fail_503").json() == {"mode": "fail_503", "after_tokens": 0}
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(model=SIM, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        streamed = httpx.post(url + "/v1/chat/completions", json=chat(2))
        health = httpx.get(url + "/health")
        injected = metric(url, "sim:faults_injected_total", mode="fail_503")
        set_fault(url, "none")
        recovered = httpx.post(url + "/v1/chat/completions", json=chat(2, stream=False))
    assert caught.value.status_code == 503
    assert streamed.status_code == 503
    assert streamed.json()["error"] == {
        "message": "The engine is unavailable (injected fault fail_503).",
        "type": "ServiceUnavailableError",
        "param": None,
        "code": 503,
    }
    assert health.status_code == 200
    assert injected == 2
    assert recovered.status_code == 200


@pytest.mark.parametrize(
    ("profile", "options"),
    [("fixed", FAST), ("llama-3.1-8b-h100", {"time_scale": 0.1, "model": SIM})],
    ids=["a fixed engine stalls mid-stream", "a batching engine stalls mid-stream"],
)
def test_stall_keeps_the_slot_until_the_client_gives_up(sim_engine: Engine, profile: str, options: Any) -> None:
    with sim_engine(profile, **options) as (url, _):
        set_fault(url, "stall", 3)
        timeout = httpx.Timeout(5.0, read=0.3)
        with httpx.stream("POST", url + "/v1/chat/completions", json=chat(50), timeout=timeout) as response:
            lines = response.iter_lines()
            role, *tokens = data_lines(lines, 4)
            assert role["choices"][0]["delta"]["role"] == "assistant"
            assert len(tokens) == 3
            assert metric(url, "vllm:num_requests_running") == 1
            assert metric(url, "vllm:kv_cache_usage_perc") > 0
            with pytest.raises(httpx.ReadTimeout):
                data_lines(lines, 1)
        wait_until(lambda: metric(url, "sim:requests_aborted_total") == 1, what="the abort to be counted")
        assert metric(url, "vllm:num_requests_running") == 0
        assert metric(url, "vllm:kv_cache_usage_perc") == 0
        assert metric(url, "sim:faults_injected_total", mode="stall") == 1


def test_stall_with_the_sdk_ends_in_its_timeout_and_an_abort(sim_engine: Engine) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        set_fault(url, "stall", 0)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(**chat(10, stream=False))
        wait_until(lambda: metric(url, "sim:requests_aborted_total") == 1, what="the abort to be counted")
        assert metric(url, "vllm:num_requests_running") == 0


@pytest.mark.parametrize("after", [0, 2], ids=["a close before any token", "a close after two tokens"])
def test_close_mid_stream_drops_the_connection_after_n_tokens(sim_engine: Engine, after: int) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        set_fault(url, "close_mid_stream", after)
        received: list[str] = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=chat(20), timeout=5) as response:
            assert response.status_code == 200
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
                received.extend(line for line in response.iter_lines() if line.startswith("data: "))
        wait_until(lambda: metric(url, "sim:requests_aborted_total") == 1, what="the engine to free the request")
        assert metric(url, "vllm:num_requests_running") == 0
    assert len(received) == (after + 1 if after else 0)  # the role chunk comes with the first token
    assert all(line != "data: [DONE]" for line in received)


def test_close_mid_stream_gives_a_non_streaming_request_no_answer(sim_engine: Engine) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        set_fault(url, "close_mid_stream", 2)
        with pytest.raises(httpx.RemoteProtocolError, match="Server disconnected"):
            httpx.post(url + "/v1/chat/completions", json=chat(20, stream=False), timeout=5)
        wait_until(lambda: metric(url, "sim:requests_aborted_total") == 1, what="the engine to free the request")


def test_a_request_shorter_than_the_fault_is_not_affected(sim_engine: Engine) -> None:
    with sim_engine("fixed", **FAST) as (url, _):
        set_fault(url, "close_mid_stream", 5)
        response = httpx.post(url + "/v1/chat/completions", json=chat(5, stream=False), timeout=5)
        assert response.status_code == 200
        assert metric(url, "sim:faults_injected_total", mode="close_mid_stream") == 0


@pytest.mark.parametrize(
    ("profile", "body", "message"),
    [
        ("fixed", {"mode": "explode"}, "'mode' must be one of"),
        ("fixed", {"mode": "stall", "after_tokens": -1}, "'after_tokens' must be an integer >= 0"),
        ("fixed", {"mode": "stall", "after": 3}, "unknown keys: ['after']"),
        ("instant", {"mode": "stall"}, "fault stall needs an engine"),
    ],
    ids=[
        "an unknown mode is a 400",
        "a negative token count is a 400",
        "an unknown key is a 400",
        "a stall on the instant profile is a 400",
    ],
)
def test_admin_fault_rejects_bad_requests(sim_engine: Engine, profile: str, body: Any, message: str) -> None:
    with sim_engine(profile) as (url, _):
        response = httpx.post(url + "/admin/fault", json=body)
        current = httpx.get(url + "/admin/fault")
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]
    assert current.json() == {"mode": "none", "after_tokens": 0}


def parse_sim_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    return parser.parse_args(["sim", "--profile", "fixed", "--port", "9000", *argv])


@pytest.mark.parametrize(
    ("argv", "faults"),
    [
        ((), {}),
        (("--count", "2", "--fault", "fail_503"), {0: Fault(FaultMode.FAIL_503), 1: Fault(FaultMode.FAIL_503)}),
        (
            ("--count", "3", "--fault", "stall", "--fault-after-tokens", "4", "--fault-engine", "1"),
            {1: Fault(FaultMode.STALL, 4)},
        ),
    ],
    ids=[
        "no flag injects nothing",
        "a fault applies to every engine by default",
        "--fault-engine picks the engines",
    ],
)
def test_cli_fault_flags(argv: tuple[str, ...], faults: dict[int, Fault]) -> None:
    assert cli._faults(parse_sim_args(*argv)) == faults


def test_cli_rejects_a_fault_engine_out_of_range() -> None:
    with pytest.raises(SystemExit, match="--fault-engine must be between 0 and 0"):
        cli._faults(parse_sim_args("--fault", "stall", "--fault-engine", "1"))


def test_cli_rejects_a_stall_on_the_instant_profile() -> None:
    args = parse_sim_args("--fault", "stall")
    args.profile = "instant"
    with pytest.raises(SystemExit, match="--fault stall needs an engine"):
        cli._faults(args)
