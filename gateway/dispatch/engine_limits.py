"""What each engine says its own limits are: how many requests it runs at once, how many KV tokens it holds.

The policy declares a backend's capacity (``Capacity.max_concurrent``, ``kv_cache_tokens``); the
engine was started with its own (vLLM's ``--max-num-seqs`` and the KV blocks it profiled, SGLang's
``--max-running-requests`` and its token pool, llama.cpp's ``--parallel`` slots and ``--ctx-size``).
When the two disagree, the gateway either lets the engine queue out of its sight or leaves GPUs idle
(``capacity_check.py`` compares). Each kind tells its limits in its own place, read from its source:

==========  =======================================  ===========================================
kind        running requests                         KV-cache tokens
==========  =======================================  ===========================================
vLLM, sim   not exposed (``max_num_seqs`` is in the  ``vllm:cache_config_info`` on ``/metrics``:
            scheduler config, which vLLM does not    an "info" gauge whose labels are every
            publish)                                 ``CacheConfig`` field; ``num_gpu_blocks`` ×
                                                     ``block_size``, summed over its ``engine``
                                                     label (one per data-parallel engine)
SGLang      ``GET /server_info`` (``/get_server_info``  ``memory_usage.token_capacity`` summed over
            before it was renamed):                  ``internal_states``, else the top-level
            ``internal_states[*].effective_max_      ``max_total_num_tokens`` (the scheduler's
            running_requests_per_dp`` summed (one    token pool)
            state per data-parallel rank), else the
            top-level ``max_running_requests``
llama.cpp   ``GET /props``: ``total_slots``          ``default_generation_settings.n_ctx`` (the
            (``--parallel``)                         context of one slot) × ``total_slots``; under
                                                     ``--kv-unified`` the slots share one context
                                                     and this overstates it ``total_slots`` times
openai      unknown                                  unknown
==========  =======================================  ===========================================

A figure the engine does not give is None, never a guess; a page that cannot be read gives
``EngineLimits`` with both None and a ``source`` saying why. Each reader states which figures its
kind publishes at all (``LimitsReader.publishes``): a policy asking a kind for one it never gives
(``capacity: {max_concurrent: auto}`` on vLLM) is refused at load (``auto_capacity_problems``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import httpx

from gateway.policy.model import ENGINE_FIELDS, Backend, BackendKind, EngineField, Policy
from gateway.policy.problems import Problem


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """One engine's own limits; None: the engine does not say."""

    max_concurrent: int | None
    """Requests it runs at once (slots, ``max_running_requests``)."""
    kv_cache_tokens: int | None
    """Tokens its KV cache holds."""
    source: str
    """Where the figures came from (``GET /props``, ...) or why there are none."""


class LimitsReader(Protocol):
    """Reads one kind's limits from a backend's base URL."""

    publishes: frozenset[EngineField]
    """The figures this kind gives at all (the module docstring's table); any other is always None."""

    async def read(self, client: httpx.AsyncClient, url: str, timeout_s: float) -> EngineLimits: ...


def _positive_int(value: Any) -> int | None:
    """``value`` as a positive int (JSON numbers, or label strings such as ``"2048"``); None otherwise
    (``"None"`` before vLLM profiled its blocks, a null, a bool, a fraction)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        value = int(value) if value.isdigit() else None
    return value if isinstance(value, int) and value > 0 else None


async def _get_json(client: httpx.AsyncClient, url: str, timeout_s: float) -> Any:
    response = await client.get(url, timeout=timeout_s)
    response.raise_for_status()
    return json.loads(response.content)


# --- vLLM (and the simulator): the cache_config_info gauge -------------------------------------

CACHE_CONFIG_INFO = "vllm:cache_config_info"
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_cache_config(page: str) -> int | None:
    """KV-cache tokens from a ``/metrics`` page: ``num_gpu_blocks × block_size`` of each
    ``vllm:cache_config_info`` sample, summed over engines; None when no sample has both."""
    total = 0
    for line in page.splitlines():
        if not line.startswith(CACHE_CONFIG_INFO + "{"):
            continue
        labels = dict(_LABEL.findall(line[len(CACHE_CONFIG_INFO) : line.rfind("}") + 1]))
        blocks, block_size = _positive_int(labels.get("num_gpu_blocks")), _positive_int(labels.get("block_size"))
        if blocks is not None and block_size is not None:
            total += blocks * block_size
    return total or None


class VllmLimits:
    """vLLM publishes its KV cache on ``/metrics``, not its ``max_num_seqs`` (module docstring)."""

    publishes: frozenset[EngineField] = frozenset({"kv_cache_tokens"})

    async def read(self, client: httpx.AsyncClient, url: str, timeout_s: float) -> EngineLimits:
        response = await client.get(url + "/metrics", timeout=timeout_s)
        response.raise_for_status()
        return EngineLimits(None, parse_cache_config(response.text), f"{CACHE_CONFIG_INFO} on /metrics")


# --- SGLang: its server info -------------------------------------------------------------------

SGLANG_INFO_PATHS = ("/server_info", "/get_server_info")
"""The newer name first; ``/get_server_info`` is what releases before the rename answer (and newer
ones still do, deprecated)."""


def parse_sglang_info(info: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """``(max_concurrent, kv_cache_tokens)`` from SGLang's server info (module docstring)."""
    states = [s for s in info.get("internal_states") or () if isinstance(s, Mapping)]
    running = _sum_all(_positive_int(s.get("effective_max_running_requests_per_dp")) for s in states)
    tokens = _sum_all(_positive_int(_nested(s, "memory_usage", "token_capacity")) for s in states)
    return (
        running or _positive_int(info.get("max_running_requests")),
        tokens or _positive_int(info.get("max_total_num_tokens")),
    )


def _nested(mapping: Mapping[str, Any], outer: str, inner: str) -> Any:
    """``mapping[outer][inner]``, or None when either is missing or not a mapping."""
    value = mapping.get(outer)
    return value.get(inner) if isinstance(value, Mapping) else None


def _sum_all(values: Iterable[int | None]) -> int | None:
    """The sum when every value is known (and there is one); None otherwise: a partial sum would
    understate the engine."""
    known = list(values)
    if not known or any(v is None for v in known):
        return None
    return sum(v for v in known if v is not None)


class SglangLimits:
    publishes: frozenset[EngineField] = frozenset(ENGINE_FIELDS)

    async def read(self, client: httpx.AsyncClient, url: str, timeout_s: float) -> EngineLimits:
        for path in SGLANG_INFO_PATHS:
            response = await client.get(url + path, timeout=timeout_s)
            if response.status_code == 404:
                continue
            response.raise_for_status()
            info = json.loads(response.content)
            if not isinstance(info, Mapping):
                raise ValueError(f"GET {path} answered no JSON object")
            running, tokens = parse_sglang_info(info)
            return EngineLimits(running, tokens, f"GET {path}")
        return EngineLimits(None, None, "unknown: no /server_info nor /get_server_info")


# --- llama.cpp's server: /props ----------------------------------------------------------------


def parse_llamacpp_props(props: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """``(max_concurrent, kv_cache_tokens)`` from llama.cpp's ``/props`` (module docstring)."""
    slots = _positive_int(props.get("total_slots"))
    settings = props.get("default_generation_settings")
    n_ctx = _positive_int(settings.get("n_ctx")) if isinstance(settings, Mapping) else None
    return slots, (n_ctx * slots if n_ctx is not None and slots is not None else None)


class LlamacppLimits:
    publishes: frozenset[EngineField] = frozenset(ENGINE_FIELDS)

    async def read(self, client: httpx.AsyncClient, url: str, timeout_s: float) -> EngineLimits:
        props = await _get_json(client, url + "/props", timeout_s)
        if not isinstance(props, Mapping):
            raise ValueError("GET /props answered no JSON object")
        slots, tokens = parse_llamacpp_props(props)
        return EngineLimits(slots, tokens, "GET /props")


class NoLimits:
    """A generic OpenAI-compatible server says nothing of its limits."""

    publishes: frozenset[EngineField] = frozenset()

    async def read(self, client: httpx.AsyncClient, url: str, timeout_s: float) -> EngineLimits:
        return EngineLimits(None, None, "unknown: the kind publishes no limits")


READERS: Mapping[BackendKind, LimitsReader] = MappingProxyType(
    {
        BackendKind.VLLM: VllmLimits(),
        BackendKind.SIM: VllmLimits(),  # the simulator answers as vLLM
        BackendKind.SGLANG: SglangLimits(),
        BackendKind.LLAMACPP: LlamacppLimits(),
        BackendKind.OPENAI: NoLimits(),
    }
)
"""Every kind's reader (a kind without one is refused at import, as in ``gateway/engines.py``)."""

_missing = [kind.value for kind in BackendKind if kind not in READERS]
if _missing:
    raise TypeError(f"gateway/dispatch/engine_limits.py: no limits reader for kind(s) {', '.join(_missing)}")


async def read_engine_limits(client: httpx.AsyncClient, backend: Backend, timeout_s: float = 2.0) -> EngineLimits:
    """The limits ``backend``'s engine reports; both None, with the reason in ``source``, when it
    cannot be read (down, an error status, an answer in another shape)."""
    try:
        return await READERS[backend.kind].read(client, backend.url, timeout_s)
    except (httpx.HTTPError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        return EngineLimits(None, None, f"unreadable: {type(exc).__name__}: {exc}")


WHY_NOT_PUBLISHED: Mapping[EngineField, str] = MappingProxyType(
    {
        "max_concurrent": "declare it as a number (for vLLM and the simulator: their --max-num-seqs)",
        "kv_cache_tokens": "declare it as a number (the KV-cache size the engine logs at start), or leave it out",
    }
)


def auto_capacity_problems(policy: Policy) -> list[Problem]:
    """Each backend whose ``capacity`` takes from its engine (``auto``) a figure its kind never
    publishes: refused at load rather than guessed (``Capacity``'s docstring says why)."""
    problems: list[Problem] = []
    for backend in policy.backends:
        for field in sorted(backend.capacity.from_engine - READERS[backend.kind].publishes):
            message = (
                f"auto, but an engine of kind {backend.kind.value} does not publish it; {WHY_NOT_PUBLISHED[field]}"
            )
            problems.append(Problem(f"backends[{backend.name}].capacity.{field}", message))
    return problems
