"""Run several engines in one event loop, one uvicorn server (and port) each."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

import uvicorn

from loadtests.sim.faults import Fault
from loadtests.sim.kv_events import attach_publishers
from loadtests.sim.kvcache import KVCache, VllmHashingSpec
from loadtests.sim.server import EngineApp, build_engine_app
from loadtests.sim.tokenizer import HfTokenization

log = logging.getLogger("loadtests.sim")
SHUTDOWN_GRACE_S = 5.0


def build_servers(apps: Sequence[EngineApp], *, host: str, ports: Sequence[int]) -> list[uvicorn.Server]:
    servers = []
    for app, port in zip(apps, ports, strict=True):
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http="httptools",
            lifespan="on",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=30,
        )
        servers.append(uvicorn.Server(config))
    return servers


async def serve_engines(
    profile: str,
    *,
    host: str = "127.0.0.1",
    ports: Sequence[int],
    model: str | None = None,
    time_scale: float = 1.0,
    ttft_ms: float | None = None,
    itl_ms: float | None = None,
    faults: Mapping[int, Fault] | None = None,
    gpu_memory_utilization: float | None = None,
    cache_scope: str | None = None,
    max_num_seqs: int | None = None,
    answer_format: str = "vllm",
    prompt_tokens_details: bool = True,
    kv_events: str | None = None,
    kv_events_replay: str | None = None,
    tokenization: HfTokenization | None = None,
    block_hashing: VllmHashingSpec | None = None,
) -> None:
    """Serve one engine per port in the running loop until cancelled (or signalled).

    ``faults`` maps an engine's index (0 for the first port) to the fault it injects from the start;
    ``answer_format`` and ``prompt_tokens_details`` are ``build_engine_app``'s; ``kv_events`` (and
    ``kv_events_replay``) publish each engine's KV events there, engine ``i`` on the port + ``i``
    (``kv_events.py``); ``tokenization`` and ``block_hashing`` (``sim --tokenizer``) make every engine
    a vLLM with that tokenizer and vLLM's block hashes (each its own random root when unseeded).
    """
    apps = [
        build_engine_app(
            profile,
            model=model,
            time_scale=time_scale,
            ttft_ms=ttft_ms,
            itl_ms=itl_ms,
            index=i,
            gpu_memory_utilization=gpu_memory_utilization,
            cache_scope=cache_scope,
            max_num_seqs=max_num_seqs,
            answer_format=answer_format,
            prompt_tokens_details=prompt_tokens_details,
            tokenization=tokenization,
            block_hashing=block_hashing,
        )
        for i in range(len(ports))
    ]
    for index, fault in (faults or {}).items():
        apps[index].set_fault(fault)
    servers = build_servers(apps, host=host, ports=ports)
    caches = [kv for app in apps if isinstance(kv := getattr(app.engine, "kv", None), KVCache)]
    if kv_events is not None and len(caches) != len(apps):
        raise ValueError(f"--kv-events needs an engine; the {profile} profile has none")
    publishers = [] if kv_events is None else attach_publishers(caches, kv_events, kv_events_replay)
    tasks = [
        asyncio.create_task(server.serve(), name=f"sim-engine-{port}")
        for server, port in zip(servers, ports, strict=True)
    ]
    replays = [asyncio.create_task(p.serve_replay(), name="sim-kv-events-replay") for p in publishers]
    log.info("simulated engines: profile=%s ports=%s time_scale=%s", profile, list(ports), time_scale)
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for server in servers:
            server.should_exit = True
        _done, pending = await asyncio.wait(tasks, timeout=SHUTDOWN_GRACE_S)
        for task in [*pending, *replays]:
            task.cancel()
        await asyncio.gather(*replays, return_exceptions=True)
        for publisher in publishers:
            publisher.close()
    for task in tasks:
        error = None if task.cancelled() or not task.done() else task.exception()
        if error is not None:
            raise error
