"""Each kind's limits reader against a loopback server answering in that engine's own format."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from gateway.dispatch.engine_limits import READERS, EngineLimits, auto_capacity_problems, read_engine_limits
from gateway.policy.model import Backend, BackendKind
from gateway.service import POLICY_LOADER
from loadtests.sim import build_engine_app
from loadtests.sim.profiles import BLOCK_SIZE
from tests.conftest import CHAT_MODEL, OTHER_MODEL, closed_port_url
from tests.policy_builder import NOWHERE, build_policy
from tests.policy_builder import backend as policy_backend
from tests.servers import serve_in_thread

# A vLLM V1 page with two data-parallel engines (PrometheusStatLogger: the info gauge's labels are
# every CacheConfig field as str(value), then ``engine``; prometheus_client sorts them on output).
VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",\
enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",\
num_cpu_blocks="None",num_gpu_blocks="2048",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",\
sliding_window="None",swap_space="4"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",\
enable_prefix_caching="True",engine="1",gpu_memory_utilization="0.9",is_attention_free="False",\
num_cpu_blocks="None",num_gpu_blocks="1024",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",\
sliding_window="None",swap_space="4"} 1.0
"""
VLLM_UNPROFILED = 'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="None"} 1.0\n'

# SGLang's GET /server_info: its server args, the scheduler's info, one internal state per DP rank.
SGLANG_INFO: dict[str, Any] = {
    "model_path": "Qwen/Qwen3-8B",
    "max_running_requests": None,
    "max_total_tokens": None,
    "dp_size": 2,
    "max_total_num_tokens": 20480,
    "max_req_input_len": 20474,
    "internal_states": [
        {
            "last_gen_throughput": 129.3,
            "memory_usage": {"weight": 0.98, "kvcache": 0.23, "token_capacity": 20480, "graph": 0},
            "effective_max_running_requests_per_dp": 128,
        },
        {
            "last_gen_throughput": 120.1,
            "memory_usage": {"weight": 0.98, "kvcache": 0.23, "token_capacity": 20480, "graph": 0},
            "effective_max_running_requests_per_dp": 128,
        },
    ],
    "version": "0.5.4",
}
# An older SGLang: no internal state figures, the top-level ones only.
SGLANG_OLD_INFO: dict[str, Any] = {"max_running_requests": 64, "max_total_num_tokens": 163840, "internal_states": [{}]}

# llama.cpp's GET /props (tools/server: n_ctx is one slot's context).
LLAMACPP_PROPS: dict[str, Any] = {
    "default_generation_settings": {"params": {"n_predict": -1, "temperature": 0.8}, "n_ctx": 8192},
    "total_slots": 4,
    "model_alias": "qwen",
    "model_path": "/models/qwen.gguf",
    "modalities": {"vision": False, "audio": False},
    "chat_template": "{{ messages }}",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "build_info": "b6000-abcdef",
}


def engine(routes: Mapping[str, Response]) -> Starlette:
    """An app answering each path with its canned response, 404 elsewhere."""

    def answer(body: Response) -> Any:
        async def endpoint(request: Request) -> Response:
            return body

        return endpoint

    return Starlette(routes=[Route(path, answer(body)) for path, body in routes.items()])


def as_json(value: Any) -> Response:
    return Response(json.dumps(value), media_type="application/json")


@contextmanager
def serving(routes: Mapping[str, Response]) -> Iterator[str]:
    with serve_in_thread(engine(routes)) as url:
        yield url


def backend(url: str, kind: str) -> Backend:
    return Backend(name="b", url=url, kind=kind, models=["m"])  # type: ignore[arg-type]


async def read(url: str, kind: str) -> EngineLimits:
    async with httpx.AsyncClient() as client:
        return await read_engine_limits(client, backend(url, kind), timeout_s=5.0)


async def test_vllm_kv_tokens_are_blocks_times_block_size_summed_over_engines() -> None:
    with serving({"/metrics": PlainTextResponse(VLLM_PAGE)}) as url:
        limits = await read(url, "vllm")
    assert limits == EngineLimits(None, (2048 + 1024) * 16, "vllm:cache_config_info on /metrics")


async def test_vllm_before_its_blocks_are_profiled_reports_no_kv_figure() -> None:
    with serving({"/metrics": PlainTextResponse(VLLM_UNPROFILED)}) as url:
        limits = await read(url, "vllm")
    assert (limits.max_concurrent, limits.kv_cache_tokens) == (None, None)


async def test_the_simulator_publishes_its_cache_config_as_vllm_does() -> None:
    app = build_engine_app("fixed")
    assert app.engine is not None
    with serve_in_thread(app) as url:
        limits = await read(url, "sim")
    assert limits.kv_cache_tokens == app.profile.num_kv_blocks * BLOCK_SIZE
    assert limits.max_concurrent is None  # vLLM does not publish max_num_seqs, nor does the simulator


async def test_sglang_sums_its_data_parallel_ranks() -> None:
    with serving({"/server_info": as_json(SGLANG_INFO)}) as url:
        limits = await read(url, "sglang")
    assert limits == EngineLimits(256, 40960, "GET /server_info")


async def test_sglang_before_the_rename_answers_on_get_server_info_with_top_level_figures() -> None:
    with serving({"/get_server_info": as_json(SGLANG_OLD_INFO)}) as url:
        limits = await read(url, "sglang")
    assert limits == EngineLimits(64, 163840, "GET /get_server_info")


async def test_llamacpp_slots_and_their_contexts() -> None:
    with serving({"/props": as_json(LLAMACPP_PROPS)}) as url:
        limits = await read(url, "llamacpp")
    assert limits == EngineLimits(4, 4 * 8192, "GET /props")


async def test_a_generic_openai_server_is_unknown_without_being_asked() -> None:
    limits = await read(closed_port_url(), "openai")  # nothing listens: no request was made
    assert (limits.max_concurrent, limits.kv_cache_tokens) == (None, None)
    assert limits.source.startswith("unknown")


async def test_an_engine_that_cannot_be_read_says_why() -> None:
    down = await read(closed_port_url(), "llamacpp")
    assert (down.max_concurrent, down.kv_cache_tokens) == (None, None)
    assert down.source.startswith("unreadable: ConnectError")
    with serving({"/props": PlainTextResponse("not json")}) as url:
        garbled = await read(url, "llamacpp")
    assert garbled.source.startswith("unreadable: JSONDecodeError")


@pytest.mark.parametrize(
    ("kind", "refused"),
    [
        pytest.param("vllm", ["max_concurrent"], id="vLLM gives its KV cache, not its --max-num-seqs"),
        pytest.param("sim", ["max_concurrent"], id="the simulator answers as vLLM"),
        pytest.param("sglang", [], id="SGLang gives both"),
        pytest.param("llamacpp", [], id="llama.cpp gives both"),
        pytest.param("openai", ["kv_cache_tokens", "max_concurrent"], id="an OpenAI-compatible server gives neither"),
    ],
)
def test_capacity_auto_is_refused_for_each_figure_the_kind_never_publishes(kind: str, refused: list[str]) -> None:
    text = build_policy(backends=[policy_backend("e", NOWHERE, [CHAT_MODEL, OTHER_MODEL], kind=kind, capacity="auto")])
    policy = POLICY_LOADER.parse(text, "policy.yaml").policy  # the loader alone: auto_capacity_problems is the check
    problems = auto_capacity_problems(policy)
    assert [p.path for p in problems] == [f"backends[e].capacity.{field}" for field in refused]
    assert all(f"an engine of kind {kind} does not publish it" in p.message for p in problems)
    assert READERS[BackendKind(kind)].publishes == {"max_concurrent", "kv_cache_tokens"} - set(refused)
