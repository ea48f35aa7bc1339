"""Real processes and a steady streaming load for the resilience tests (``tests/test_resilience.py``).

* ``engines(n)`` runs ``python -m gateway sim --profile fixed`` (first token after 20 ms, then a
  token every 10 ms) with ``n`` engines on consecutive loopback ports, as one OS process that a
  test may kill; each engine is identified by the id prefix it puts in every chunk it streams.
* ``gateway(text)`` runs ``python -m gateway serve`` on a policy file it writes (the process may
  be signalled; the file may be overwritten); ``policy(...)`` builds that policy for sim engines
  (with ``tests.policy_builder``).
* ``Load`` runs closed-loop streaming clients (aiohttp) in a thread of its own, so that the test
  thread can kill, signal and poll while they run. Every request becomes a ``Stream`` whose
  ``outcome`` is exactly one of ``Outcome``; a request that reaches its deadline is cut and
  recorded as ``DEADLINE`` (a hang), never left running.

Processes are started and stopped by ``loadtests.harness.processes``; tests synchronise with
``tests.servers.wait_until``.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from loadtests.harness.processes import GATEWAY, Labels, bindable, policy_file, process
from loadtests.loadgen.client import error_code
from tests.policy_builder import NOWHERE, OMIT, admin_keys, backend, build_policy, model, tenant
from tests.servers import free_port, metric, samples, scrape, wait_until

MODEL = "sim-model"
KEY = "resilience-key"
ADMIN_KEY = "resilience-admin-key"
CHAT_ID_PREFIX = "chatcmpl-"
ENGINE_ID_LEN = 12  # the engine's random id base in every chunk id (loadtests/sim/server.py)


@dataclass(frozen=True)
class Engine:
    name: str  # the backend's name in the policy
    url: str
    id: str  # the id base of every response this engine sends


@dataclass
class Fleet:
    """Simulated engines served by one process."""

    proc: subprocess.Popen[bytes]
    engines: list[Engine]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def metric(self, engine: Engine, name: str, **labels: str) -> float:
        return metric(engine.url, name, **labels)


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive loopback ports that are free right now."""
    for _ in range(100):
        first = free_port()
        if all(bindable(first + i) for i in range(1, count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports")


@contextmanager
def engines(
    count: int, *, names: list[str] | None = None, fault: tuple[str, ...] = (), port: int | None = None
) -> Iterator[Fleet]:
    """``count`` fixed-profile engines in one process (from ``port``, else free ports);
    ``fault`` adds ``--fault ...`` flags."""
    port = port or free_ports(count)
    argv = [*GATEWAY, "sim", "--profile", "fixed", "--ttft-ms", "20", "--itl-ms", "10"]
    argv += ["--port", str(port), "--count", str(count), *fault]
    urls = [f"http://127.0.0.1:{port + i}" for i in range(count)]
    with process(argv, urls[0] + "/health") as proc:
        for url in urls[1:]:
            wait_until(partial(_answers, url + "/health"), what=f"the engine at {url}")
        names = names or [f"engine-{i}" for i in range(count)]
        yield Fleet(proc, [Engine(name, url, _engine_id(url)) for name, url in zip(names, urls, strict=True)])


def call(method: str, url: str, *, key: str | None = None, body: object = None) -> tuple[int, Any]:
    """One HTTP exchange: its status and JSON body (``None`` if not JSON).

    urllib, not httpx: making an httpx client costs tens of milliseconds (its SSL context),
    too slow for probes timed against streams of a second."""
    request = urllib.request.Request(url, method=method, data=None if body is None else orjson.dumps(body))
    request.add_header("content-type", "application/json")
    if key is not None:
        request.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            status, raw = int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, orjson.loads(raw)
    except orjson.JSONDecodeError:
        return status, None


def _answers(url: str) -> bool:
    try:
        return call("GET", url)[0] == 200
    except OSError:
        return False


def _engine_id(url: str) -> str:
    """Ask the engine once (one token, unaffected by any fault but fail_503) for its id base."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "id?"}], "max_tokens": 1}
    status, reply = call("POST", url + "/v1/chat/completions", body=body)
    assert status == 200, reply
    return str(reply["id"])[len(CHAT_ID_PREFIX) :][:ENGINE_ID_LEN]


def set_fault(engine: Engine, mode: str, after_tokens: int = 0) -> None:
    status, reply = call("POST", engine.url + "/admin/fault", body={"mode": mode, "after_tokens": after_tokens})
    assert status == 200, reply


def policy(engines: list[Engine], *, max_concurrent: int = 256, between_chunks_s: float = 30.0, **sections: Any) -> str:
    """A policy for ``engines`` (sim engines serving ``MODEL``) and one tenant, ``load``, with ``KEY``;
    ``sections`` edit it as ``tests.policy_builder.build_policy`` does (``retry={"max_retries": 0}``)."""
    slots, timeouts = {"max_concurrent": max_concurrent}, {"between_chunks_s": between_chunks_s}
    resilience = dict(
        version="resilience-1",
        classes={
            "interactive": {
                "slo": {"ttft_ms": 2000, "itl_ms": 100, "e2e_ms": 60000},
                "queue": {"max_depth": 1024, "max_wait_s": 30},
            },
            "batch": OMIT,
        },
        models=[model(MODEL, max_prompt_tokens=1024, max_output_tokens=256, routing={"strategy": "least_load"})],
        backends=[backend(e.name, e.url, [MODEL], kind="sim", capacity=slots, timeouts=timeouts) for e in engines],
        tenants=[tenant("load", KEY)],
        admin=admin_keys(ADMIN_KEY),
        health_checks={"interval_s": 0.1, "timeout_s": 0.5},
        scrape={"interval_s": 0.5, "timeout_s": 0.5},
        lifecycle={"watch_interval_s": 0.05, "drain_timeout_s": 20},
        retry={"max_retries": 2},
        breaker={},
    )
    return build_policy(NOWHERE, resilience, **sections)


@dataclass
class Gateway:
    """A gateway process, its URL and its live policy file."""

    proc: subprocess.Popen[bytes]
    url: str
    policy_path: Path
    admin_url: str  # the operator listener: /metrics, /admin/*

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.admin_url, name, **labels)

    def samples(self, name: str) -> dict[Labels, float]:
        return samples(self.admin_url, name)

    def admin_policy(self) -> Any:
        status, document = call("GET", self.admin_url + "/admin/policy", key=ADMIN_KEY)
        assert status == 200, document
        return document

    def status(self, path: str) -> int:
        return self.call("GET", path)[0]

    def chat(self, content: str, max_tokens: int = 4) -> tuple[int, Any]:
        """One request outside the load; its status and JSON body (a stream's error is JSON)."""
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
        return self.call("POST", "/v1/chat/completions", key=KEY, body={**body, "stream": True})

    def call(self, method: str, path: str, *, key: str | None = None, body: object = None) -> tuple[int, Any]:
        return call(method, self.url + path, key=key, body=body)


@contextmanager
def gateway(text: str) -> Iterator[Gateway]:
    """``python -m gateway serve`` on a policy file holding ``text``; entered once ``/readyz`` is 200."""
    port, admin_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    with ExitStack() as stack:
        path = stack.enter_context(policy_file(text))
        serve = [*GATEWAY, "serve", "--policy", str(path), "--port", str(port), "--admin-port", str(admin_port)]
        proc = stack.enter_context(process(serve, url + "/readyz"))
        yield Gateway(proc, url, path, f"http://127.0.0.1:{admin_port}")


class Outcome(StrEnum):
    """How one request ended, as its client saw it."""

    COMPLETED = "completed"  # 200, every token, then [DONE]
    ERROR_EVENT = "error_event"  # 200, then an SSE error event, then [DONE]
    HTTP_ERROR = "http_error"  # an error status with an OpenAI error body
    DISCONNECTED = "disconnected"  # the client hung up on purpose (``Load(disconnect=...)``)
    DEADLINE = "deadline"  # still running at its deadline: a hang
    BROKEN = "broken"  # anything else: transport error, no [DONE], an event after [DONE], ...


@dataclass
class Stream:
    """One request of the load, as its client saw it; times are ``time.perf_counter`` seconds."""

    index: int
    max_tokens: int
    t_start: float
    status: int = 0
    t_headers: float | None = None
    token_times: list[float] = field(default_factory=list)
    engine: str | None = None  # id base of the engine that streamed it
    error_code: str | None = None
    t_error: float | None = None
    done: bool = False
    detail: str = ""
    t_end: float | None = None
    outcome: Outcome | None = None
    usage: dict[str, Any] | None = None  # the usage chunk, when the load asks for it
    prompt: str = ""

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.t_start if self.token_times else None

    def feed(self, payload: bytes, now: float) -> None:
        if self.done:
            raise _Broken("an event after [DONE]")
        if payload == b"[DONE]":
            self.done = True
            return
        event = orjson.loads(payload)
        if "error" in event:
            if self.error_code is not None:
                raise _Broken("two error events")
            self.error_code, self.t_error = error_code(payload, 200), now
            return
        if self.error_code is not None:
            raise _Broken("a chunk after the error event")
        chunk_id = str(event.get("id", ""))
        if chunk_id.startswith(CHAT_ID_PREFIX):
            self.engine = chunk_id[len(CHAT_ID_PREFIX) :][:ENGINE_ID_LEN]
        choices = event.get("choices") or []
        if choices and (choices[0].get("delta") or {}).get("content"):
            self.token_times.append(now)
        if not choices and isinstance(event.get("usage"), dict):
            self.usage = event["usage"]

    def finish(self) -> Outcome:
        if not self.done:
            raise _Broken("the stream ended without [DONE]")
        if self.error_code is not None:
            return Outcome.ERROR_EVENT
        if len(self.token_times) != self.max_tokens:
            raise _Broken(f"{len(self.token_times)} of {self.max_tokens} tokens")
        return Outcome.COMPLETED


class _Broken(Exception):
    pass


@dataclass(frozen=True)
class Disconnect:
    """A ``share`` of the requests hang up at a moment uniform in ``[0, within_s)`` after they
    start, unless their stream is within ``margin_tokens`` of its end by then: near its end a
    stream could finish at the engine while its client hangs up (the issue gives the gateway
    100 ms to close the upstream; the margin is 15 tokens, 150 ms at 10 ms a token)."""

    share: float
    within_s: float
    margin_tokens: int = 15


class Load:
    """``clients`` closed-loop streaming clients in a thread of their own (see the module docstring).

    Usage::

        with Load(gw.url, clients=20, max_tokens=(8, 16)) as load:
            wait_until(lambda: load.count(Outcome.COMPLETED) >= 100)
        # leaving the block stops sending and waits for every request to end
        assert not load.of(Outcome.DEADLINE, Outcome.BROKEN)
    """

    def __init__(
        self,
        url: str,
        *,
        clients: int,
        max_tokens: tuple[int, int],
        deadline_s: float = 10.0,
        total: int | None = None,
        disconnect: Disconnect | None = None,
        include_usage: bool = False,
        seed: int = 6,
    ) -> None:
        self.url = url + "/v1/chat/completions"
        self.include_usage = include_usage
        self.clients = clients
        self.max_tokens = max_tokens
        self.deadline_s = deadline_s
        self.total = total
        self.disconnect = disconnect
        self.streams: list[Stream] = []
        self._rng = random.Random(seed)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(),), name="load", daemon=True)
        self._headers = {
            "authorization": f"Bearer {KEY}",
            "content-type": "application/json",
            "x-request-timeout": str(deadline_s),
        }

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.join()

    def stop(self) -> None:
        """Send no new request (those under way go on)."""
        self._stopping.set()

    def join(self) -> None:
        self._thread.join(self.deadline_s + 10)
        assert not self._thread.is_alive(), "the load did not stop"

    @property
    def finished(self) -> bool:
        return not self._thread.is_alive()

    def of(self, *outcomes: Outcome) -> list[Stream]:
        return [s for s in list(self.streams) if s.outcome in outcomes]

    def count(self, outcome: Outcome, since: float = 0.0) -> int:
        return sum(1 for s in list(self.streams) if s.outcome is outcome and s.t_start >= since)

    def streaming(self, engine: str | None = None) -> list[Stream]:
        """Requests under way that have received tokens (from ``engine``, if given)."""
        return [
            s
            for s in list(self.streams)
            if s.outcome is None and s.token_times and (engine is None or s.engine == engine)
        ]

    def by_outcome(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.streams:
            key = str(s.outcome)
            counts[key] = counts.get(key, 0) + 1
        return counts

    async def _main(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(self._client(session) for _ in range(self.clients)))

    async def _client(self, session: aiohttp.ClientSession) -> None:
        while not self._stopping.is_set() and (self.total is None or len(self.streams) < self.total):
            stream = Stream(len(self.streams), self._rng.randint(*self.max_tokens), time.perf_counter())
            self.streams.append(stream)
            hang_up = self._hang_up_after()
            await self._request(session, stream, hang_up)
            stream.t_end = time.perf_counter()

    def _hang_up_after(self) -> float | None:
        plan = self.disconnect
        if plan is None or self._rng.random() >= plan.share:
            return None
        return self._rng.uniform(0, plan.within_s)

    async def _request(self, session: aiohttp.ClientSession, stream: Stream, hang_up: float | None) -> None:
        stream.prompt = f"Tell me a story, number {stream.index}."
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": stream.prompt}],
            "max_tokens": stream.max_tokens,
            "stream": True,
        }
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        try:
            async with asyncio.timeout(self.deadline_s):
                async with asyncio.timeout(hang_up) as hanging:
                    stream.outcome = await self._exchange(session, stream, orjson.dumps(body), hanging)
        except TimeoutError:
            stream.outcome = Outcome.DISCONNECTED if hanging.expired() else Outcome.DEADLINE
        except (_Broken, aiohttp.ClientError, OSError, orjson.JSONDecodeError) as exc:
            stream.outcome, stream.detail = Outcome.BROKEN, f"{type(exc).__name__}: {exc}"

    async def _exchange(
        self, session: aiohttp.ClientSession, stream: Stream, body: bytes, hanging: asyncio.Timeout
    ) -> Outcome:
        async with session.post(self.url, data=body, headers=self._headers) as response:
            stream.status, stream.t_headers = response.status, time.perf_counter()
            if response.status != 200:
                raw = await response.read()
                stream.error_code, stream.detail = error_code(raw, response.status), raw.decode(errors="replace")
                if not stream.error_code or stream.error_code.startswith("http_"):
                    raise _Broken(f"status {response.status} without an OpenAI error body")
                return Outcome.HTTP_ERROR
            last_moment = stream.max_tokens - (self.disconnect.margin_tokens if self.disconnect else 0)
            buffer = b""
            async for data in response.content.iter_any():
                now = time.perf_counter()
                *events, buffer = (buffer + data).split(b"\n\n")
                for event in events:
                    if event.startswith(b"data: "):
                        stream.feed(event[6:], now)
                if len(stream.token_times) >= last_moment:
                    hanging.reschedule(None)  # too close to its end to hang up (see ``Disconnect``)
            if buffer.strip():
                raise _Broken(f"a trailing partial event {buffer[:80]!r}")
            return stream.finish()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def gauges_at_zero(gw: Gateway, names: tuple[str, ...]) -> Callable[[], bool]:
    """A condition: every sample of every gauge in ``names`` is 0."""

    def check() -> bool:
        return all(v == 0 for (n, _), v in scrape(gw.admin_url).items() if n in names)

    return check
