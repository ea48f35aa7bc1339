"""The engine's HTTP face: a raw ASGI app, one per engine, served by uvicorn.

No framework on the hot path: routing is a dict lookup on the path, JSON is orjson, and SSE
chunks come from byte templates (see `protocol`). The app handles ``lifespan`` itself: startup
starts the engine's step loop, shutdown cancels it.

A request is aborted the moment its client disconnects: while a response is pending, a watcher
task reads ``receive()`` and, on ``http.disconnect``, aborts the request in the engine, which
frees its KV blocks at once.

Routes: ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/responses``
(the Responses API, see ``responses.py``), ``/tokenize``, ``/detokenize``, ``/v1/rerank`` and
``/v1/score`` (the small endpoints, see ``pooling.py``), ``/v1/messages`` and
``/v1/messages/count_tokens`` (Anthropic's Messages API and its token counting as vLLM serves
them, see ``messages.py``); ``GET /health`` (200, empty body), ``/metrics``,
``/v1/models``, ``/version``.

Usage: chat and completions answers report the prompt tokens the engine reused as vLLM does
(started with ``--enable-prompt-tokens-details``, or without), or as llama.cpp does, with its
``timings`` (``build_engine_app``'s ``answer_format``; ``usage_report.py``). The other APIs keep
vLLM's shapes.

Fault injection (not in vLLM): ``POST /admin/fault`` with ``{"mode", "after_tokens"}`` sets
the fault injected into later requests, ``GET /admin/fault`` shows it (see ``faults.py``).

Debug (not in vLLM): ``POST /debug/prefix_cache`` takes a chat or completions request body
(``messages`` makes it chat) and answers ``{"prompt_tokens": n, "cached_tokens": m}``: how many
of its prompt tokens the engine's prefix cache holds right now, under the body's
``cache_salt``, exactly as admission would count them, with no side effect. The routing
benchmark's oracle router reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import orjson

from loadtests.sim.clock import Clock
from loadtests.sim.engine import Engine, EngineRequest, build_engine
from loadtests.sim.faults import Fault, FaultMode, drop_connection, unavailable
from loadtests.sim.kvcache import BlockHashing, KVCache, VllmHashingSpec, block_chain, salt_root
from loadtests.sim.messages import (
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    AnthropicError,
    MessageEvents,
    count_tokens_answer,
    message_answer,
    parse_messages_request,
    stream_answer,
)
from loadtests.sim.metrics import EngineMetrics
from loadtests.sim.pooling import PoolingEndpoints
from loadtests.sim.profiles import BLOCK_SIZE, Profile, ProfileKind, get_profile
from loadtests.sim.protocol import (
    DONE,
    ApiError,
    Endpoint,
    ParsedRequest,
    StreamRenderer,
    embedding_response,
    full_response,
    models_response,
    parse_request,
)
from loadtests.sim.responses import (
    RESPONSES_PATH,
    ResponseEvents,
    ResponsesRequest,
    ResponseStore,
    final_response,
    parse_responses_request,
)
from loadtests.sim.scheduler import Scheduler
from loadtests.sim.stream import FinishReason, TokenStream
from loadtests.sim.tokenizer import HfTokenization, embed, output_text, output_token_id
from loadtests.sim.usage_report import AnswerFormat, UsageReport

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_POST_ROUTES = {
    "/v1/chat/completions": Endpoint.CHAT,
    "/v1/completions": Endpoint.COMPLETION,
    "/v1/embeddings": Endpoint.EMBEDDING,
}
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
_ID_PREFIX = {Endpoint.CHAT: "chatcmpl-", Endpoint.COMPLETION: "cmpl-", Endpoint.EMBEDDING: "embd-"}


class EngineApp:
    """ASGI app of one simulated engine (see the module docstring)."""

    def __init__(
        self,
        profile: Profile,
        *,
        model: str,
        index: int,
        time_scale: float,
        clock: Clock | None,
        usage_report: UsageReport | None = None,
        tokenization: HfTokenization | None = None,
        hashing: BlockHashing | None = None,
    ) -> None:
        self.profile = profile
        self.model = model
        self.usage_report = usage_report or UsageReport()  # vLLM's shapes unless told (usage_report.py)
        self.tokenization = tokenization  # vLLM's prompt ids (``sim --tokenizer``); the word tokenizer's if None
        self.engine: Engine | None = None
        if profile.kind is not ProfileKind.INSTANT:
            output_id = output_token_id if tokenization is None else tokenization.output_token_id
            self.engine = build_engine(
                profile,
                model_name=model,
                index=index,
                time_scale=time_scale,
                clock=clock,
                hashing=hashing,
                output_id=output_id,
            )
            self.metrics = self.engine.metrics
            self.max_model_len = self.engine.max_model_len
        else:
            self.metrics = EngineMetrics(model, index, running=_zero, waiting=_zero, kv_usage=_zero)
            self.max_model_len = 131_072
        self._created = int(time.time())
        self._ids = itertools.count()
        self._id_base = os.urandom(6).hex()
        self._task: asyncio.Task[None] | None = None
        self._texts: dict[int, str] = {}
        self.fault = Fault()
        self.response_store = ResponseStore()  # finished responses, for previous_response_id
        self.pooling = PoolingEndpoints(model, self.max_model_len, self.metrics)  # /tokenize, /v1/rerank, ...

    def set_fault(self, fault: Fault) -> None:
        """Inject ``fault`` into the requests that arrive from now on (see ``faults.py``)."""
        if fault.needs_engine and self.engine is None:
            raise ValueError(f"fault {fault.mode.value} needs an engine; the {self.profile.name} profile has none")
        self.fault = fault

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                await self._http(scope, receive, send)
            except ApiError as error:
                await _respond(send, error.status, error.body())
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    def start(self) -> None:
        if self.engine is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.engine.run(), name="sim-engine")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        endpoint = _POST_ROUTES.get(path)
        if path == "/admin/fault":
            await self._admin_fault(method, receive, send)
        elif path == "/debug/prefix_cache" and method == "POST":
            body = await _read_body(receive)
            if body is not None:
                await _respond(send, 200, self._cached_prefix(body))
        elif path == RESPONSES_PATH:
            if method != "POST":
                raise ApiError(405, "Method Not Allowed")
            body = await _read_body(receive)
            if body is not None:
                await self._responses(body, receive, send)
        elif path in self.pooling.paths:
            if method != "POST":
                raise ApiError(405, "Method Not Allowed")
            body = await _read_body(receive)
            if body is not None:
                await _respond(send, 200, self.pooling.answer(path, body, self.fault))
        elif path == MESSAGES_PATH:
            if method != "POST":
                raise ApiError(405, "Method Not Allowed")
            body = await _read_body(receive)
            if body is not None:
                await self._messages(body, receive, send)
        elif path == COUNT_TOKENS_PATH:
            if method != "POST":
                raise ApiError(405, "Method Not Allowed")
            body = await _read_body(receive)
            if body is not None:
                await _respond(send, 200, self._count_tokens(body))
        elif endpoint is not None:
            if method != "POST":
                raise ApiError(405, "Method Not Allowed")
            body = await _read_body(receive)
            if body is not None:
                await self._generate(endpoint, body, receive, send)
        elif method != "GET":
            raise ApiError(405, "Method Not Allowed")
        elif path == "/health":
            await _respond(send, 200, b"", [])
        elif path == "/metrics":
            await _respond(send, 200, self.metrics.render(), [(b"content-type", b"text/plain; version=0.0.4")])
        elif path == "/v1/models":
            await _respond(send, 200, models_response(self.model, self._created, self.max_model_len))
        elif path == "/version":
            await _respond(send, 200, b'{"version":"sim"}')
        else:
            await _respond(send, 404, b'{"detail":"Not Found"}')

    def _cached_prefix(self, body: bytes) -> bytes:
        endpoint = Endpoint.CHAT if b'"messages"' in body else Endpoint.COMPLETION
        req = parse_request(endpoint, body, served_model=self.model, default_max_tokens=1, prompter=self.tokenization)
        kv = getattr(self.engine, "kv", None)
        scheduler = getattr(self.engine, "scheduler", None)
        slots = scheduler.slots if isinstance(scheduler, Scheduler) else None
        cached = 0
        if isinstance(kv, KVCache):
            bs = kv.block_size
            hashes = block_chain(kv.hashing, req.token_ids, (len(req.token_ids) - 1) // bs, req.cache_salt)
            if slots is None:
                cached = len(kv.lookup(hashes)) * bs
            else:
                cached = min(slots.best(salt_root(req.cache_salt), req.token_ids, hashes)[1], len(req.token_ids) - 1)
        return orjson.dumps({"prompt_tokens": len(req.token_ids), "cached_tokens": cached})

    async def _admin_fault(self, method: str, receive: Receive, send: Send) -> None:
        if method == "POST":
            body = await _read_body(receive)
            if body is None:
                return
            try:
                self.set_fault(Fault.parse(body))
            except ValueError as exc:
                raise ApiError(400, str(exc)) from exc
        elif method != "GET":
            raise ApiError(405, "Method Not Allowed")
        await _respond(send, 200, self.fault.to_json())

    async def _generate(self, endpoint: Endpoint, body: bytes, receive: Receive, send: Send) -> None:
        fault = self.fault
        if fault.mode is FaultMode.FAIL_503:
            self.metrics.faults[fault.mode.value].inc()
            raise unavailable()
        default, prompter = self.profile.default_max_tokens, self.tokenization
        req = parse_request(endpoint, body, served_model=self.model, default_max_tokens=default, prompter=prompter)
        self._check_context(req)
        req_id = f"{_ID_PREFIX[endpoint]}{self._id_base}{next(self._ids):x}"
        if self.engine is None:
            await self._instant(req, req_id, send)
            return
        close_at = fault.close_at(req.max_tokens)
        async with self._submitted(req.token_ids, req.max_tokens, req.priority, req.cache_salt, receive) as stream:
            if req.stream and endpoint is not Endpoint.EMBEDDING:
                await self._stream(req, req_id, stream, send, close_at)
            elif await _finished_whole(stream, send, close_at):
                await _respond(send, 200, self._unary_body(req, req_id, stream))

    def _check_context(self, req: ParsedRequest) -> None:
        if len(req.token_ids) + req.max_tokens > self.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; the request "
                f"has {len(req.token_ids)} prompt tokens and asks for {req.max_tokens}.",
            )

    async def _messages(self, body: bytes, receive: Receive, send: Send) -> None:
        """``POST /v1/messages``: the chat path (faults, engine, disconnects) with vLLM's Messages
        conversion; the body's ``cache_salt`` and ``priority`` are not passed on (see ``messages.py``)."""
        fault = self.fault
        if fault.mode is FaultMode.FAIL_503:
            self.metrics.faults[fault.mode.value].inc()
            raise AnthropicError.of(unavailable())
        default = self.profile.default_max_tokens
        req = parse_messages_request(body, served_model=self.model, default_max_tokens=default)
        try:
            self._check_context(req)
        except ApiError as error:
            raise AnthropicError.of(error) from error
        msg_id = f"{_ID_PREFIX[Endpoint.CHAT]}{self._id_base}{next(self._ids):x}"
        if self.engine is None:
            await self._messages_instant(req, msg_id, send)
            return
        close_at = fault.close_at(req.max_tokens)
        async with self._submitted(req.token_ids, req.max_tokens, req.priority, req.cache_salt, receive) as stream:
            if req.stream:
                await stream_answer(MessageEvents(req, msg_id), stream, send, close_at)
            elif await _finished_whole(stream, send, close_at):
                n = stream.num_tokens
                await _respond(send, 200, message_answer(req, msg_id, self._text(n), stream.prompt_tokens, n))

    def _count_tokens(self, body: bytes) -> bytes:
        """``POST /v1/messages/count_tokens``: the prompt a ``/v1/messages`` request of this body
        would have, counted (see ``messages.py``); nothing reaches the engine."""
        fault = self.fault
        if fault.mode is FaultMode.FAIL_503:
            self.metrics.faults[fault.mode.value].inc()
            raise AnthropicError.of(unavailable())
        return count_tokens_answer(body, served_model=self.model)

    async def _messages_instant(self, req: ParsedRequest, msg_id: str, send: Send) -> None:
        """A Messages answer at once, without an engine (the ``instant`` profile)."""
        prompt, n = len(req.token_ids), req.max_tokens
        self.metrics.prompt_tokens.inc(prompt)
        self.metrics.generation_tokens.inc(n)
        self.metrics.success["length"].inc()
        if not req.stream:
            await _respond(send, 200, message_answer(req, msg_id, self._text(n), prompt, n))
            return
        events = MessageEvents(req, msg_id)
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        await send({"type": "http.response.body", "body": events.tokens(range(n), prompt) + events.finish(prompt, n)})

    @contextlib.asynccontextmanager
    async def _submitted(
        self, token_ids: list[int], max_tokens: int, priority: int, cache_salt: str | None, receive: Receive
    ) -> AsyncIterator[TokenStream]:
        """A request in the engine (with the fault in force) for the block's length: a client that
        disconnects aborts it, and it is aborted if the block ends before it finished."""
        engine, fault = self.engine, self.fault
        assert engine is not None
        stall_at = fault.stall_at(max_tokens)
        if stall_at is not None:
            self.metrics.faults[fault.mode.value].inc()
        stream = engine.submit(EngineRequest(token_ids, max_tokens, priority, cache_salt, stall_at))
        watcher = asyncio.get_running_loop().create_task(_watch_disconnect(receive, engine, stream))
        self.metrics.submitted(priority)
        try:
            yield stream
        finally:
            self.metrics.in_engine[priority] -= 1
            watcher.cancel()
            if stream.finish_reason is None:  # cancelled from outside: do not leak the request
                engine.abort(stream)

    async def _stream(
        self, req: ParsedRequest, req_id: str, stream: TokenStream, send: Send, close_at: int | None = None
    ) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        report = self.usage_report
        renderer = self._renderer(req, req_id, stream.prompt_tokens)
        last = req.max_tokens - 1
        call = req.tool_call
        on_finish = report.timings_on_finish(req.include_usage)
        first = True
        sent = 0
        while sent != close_at and (batch := await stream.drain()):
            parts = [renderer.role_chunk()] if first and renderer.chat else []
            first = False
            for i in batch:
                timings = report.timings(stream) if on_finish and i == last else None
                if call is not None:
                    parts.append(renderer.tool_chunk(call, i, i == last, timings))
                    continue
                text = output_text(i)
                if i == last:
                    parts.append(renderer.final(text, "length", i + 1, timings))
                else:
                    parts.append(renderer.content(text, i + 1))
            await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
            sent += len(batch)
        if sent == close_at:
            await drop_connection(send, stream)
            return
        if stream.finish_reason is FinishReason.ABORT:
            return
        if req.include_usage:
            use = report.final(stream.prompt_tokens, stream.num_tokens, stream.cached_tokens)
            tail = renderer.usage_chunk(use, report.timings(stream)) + DONE
        else:
            tail = DONE
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    def _renderer(self, req: ParsedRequest, req_id: str, prompt_tokens: int) -> StreamRenderer:
        """The stream's renderer; vLLM's ``"usage": null`` on each chunk and per-chunk usage
        (``continuous_usage_stats``) only in vLLM's format: llama.cpp has neither."""
        vllm = self.usage_report.vllm
        continuous = prompt_tokens if req.continuous_usage and vllm else None
        created = int(time.time())
        return StreamRenderer(req.endpoint, req_id, req.model, created, req.include_usage and vllm, continuous)

    async def _responses(self, body: bytes, receive: Receive, send: Send) -> None:
        """``POST /v1/responses``: the chat path (faults, engine, disconnects) with the Responses API's shapes."""
        fault = self.fault
        if fault.mode is FaultMode.FAIL_503:
            self.metrics.faults[fault.mode.value].inc()
            raise unavailable()
        req = parse_responses_request(
            body,
            served_model=self.model,
            default_max_tokens=self.profile.default_max_tokens,
            max_model_len=self.max_model_len,
            store=self.response_store,
        )
        created = int(time.time())
        if self.engine is None:
            await self._responses_instant(req, created, send)
            return
        close_at = fault.close_at(req.max_tokens)
        async with self._submitted(req.token_ids, req.max_tokens, req.priority, req.cache_salt, receive) as stream:
            if req.stream:
                await self._responses_stream(req, created, stream, send, close_at)
            elif await _finished_whole(stream, send, close_at):
                await _respond(send, 200, orjson.dumps(self._finished_response(req, created, stream)))

    async def _responses_stream(
        self, req: ResponsesRequest, created: int, stream: TokenStream, send: Send, close_at: int | None
    ) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        events = ResponseEvents(req, created)
        await send({"type": "http.response.body", "body": events.start(), "more_body": True})
        sent = 0
        while sent != close_at and (batch := await stream.drain()):
            chunk = b"".join(events.delta(output_text(i)) for i in batch)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            sent += len(batch)
        if sent == close_at:
            await drop_connection(send, stream)
            return
        if stream.finish_reason is FinishReason.ABORT:
            return
        final = self._finished_response(req, created, stream)
        await send({"type": "http.response.body", "body": events.finish(final), "more_body": False})

    async def _responses_instant(self, req: ResponsesRequest, created: int, send: Send) -> None:
        """A response at once, without an engine (the ``instant`` profile)."""
        prompt, n = len(req.token_ids), req.max_tokens
        m = self.metrics
        m.prompt_tokens.inc(prompt)
        m.generation_tokens.inc(n)
        m.success["length"].inc()
        done = TokenStream(prompt)
        done.num_tokens = n
        final = self._finished_response(req, created, done)
        if not req.stream:
            await _respond(send, 200, orjson.dumps(final))
            return
        events = ResponseEvents(req, created)
        parts = [events.start(), *(events.delta(output_text(i)) for i in range(n)), events.finish(final)]
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        await send({"type": "http.response.body", "body": b"".join(parts)})

    def _finished_response(self, req: ResponsesRequest, created: int, stream: TokenStream) -> dict[str, Any]:
        """The finished response object, stored for follow-ups when the request asked to be."""
        n = stream.num_tokens
        if req.store:
            self.response_store.put(req.response_id, req.messages, n, called=req.tool_call is not None)
        return final_response(req, created, self._text(n), stream.prompt_tokens, n, stream.cached_tokens)

    def _unary_body(self, req: ParsedRequest, req_id: str, stream: TokenStream) -> bytes:
        created = int(time.time())
        if req.endpoint is Endpoint.EMBEDDING:
            return embedding_response(req_id, req.model, created, embed(req.token_ids), len(req.token_ids))
        n = stream.num_tokens
        report = self.usage_report
        use = report.whole(stream.prompt_tokens, n, stream.cached_tokens)
        timings = report.timings(stream)
        call = req.tool_call
        if call is not None:
            calls = [call.message_call(n)]
            return full_response(
                req.endpoint, req_id, req.model, created, "", call.finish_reason, use, calls, timings=timings
            )
        return full_response(req.endpoint, req_id, req.model, created, self._text(n), "length", use, timings=timings)

    def _text(self, n: int) -> str:
        text = self._texts.get(n)
        if text is None:
            text = "".join(output_text(i) for i in range(n))
            if len(self._texts) < 4096:
                self._texts[n] = text
        return text

    async def _instant(self, req: ParsedRequest, req_id: str, send: Send) -> None:
        """Answer at once, without an engine: the gateway-overhead benchmark's backend."""
        prompt, n = len(req.token_ids), req.max_tokens
        m = self.metrics
        m.prompt_tokens.inc(prompt)
        m.generation_tokens.inc(n)
        m.success["length" if n else "stop"].inc()
        if req.endpoint is Endpoint.EMBEDDING or not req.stream:
            stream = TokenStream(prompt)
            stream.num_tokens = n
            await _respond(send, 200, self._unary_body(req, req_id, stream))
            return
        report = self.usage_report
        done = TokenStream(prompt)
        done.num_tokens = n
        timings = report.timings(done)
        on_finish = timings if report.timings_on_finish(req.include_usage) else None
        renderer = self._renderer(req, req_id, prompt)
        parts = [renderer.role_chunk()] if renderer.chat else []
        call = req.tool_call
        if call is not None:
            parts.extend(renderer.tool_chunk(call, i, i == n - 1, on_finish if i == n - 1 else None) for i in range(n))
        else:
            parts.extend(renderer.content(output_text(i), i + 1) for i in range(n - 1))
            parts.append(renderer.final(output_text(n - 1), "length", n, on_finish))
        if req.include_usage:
            parts.append(renderer.usage_chunk(report.final(prompt, n, 0), timings))
        parts.append(DONE)
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        await send({"type": "http.response.body", "body": b"".join(parts)})


def _zero() -> float:
    return 0.0


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None if the client went away first."""
    message = await receive()
    if message["type"] == "http.disconnect":
        return None
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        return body
    chunks = [body]
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _watch_disconnect(receive: Receive, engine: Engine, stream: TokenStream) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    engine.abort(stream)


async def _respond(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    head = [*(_JSON if headers is None else headers), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def build_engine_app(
    profile: str,
    *,
    model: str | None = None,
    time_scale: float = 1.0,
    ttft_ms: float | None = None,
    itl_ms: float | None = None,
    index: int = 0,
    clock: Clock | None = None,
    gpu_memory_utilization: float | None = None,
    cache_scope: str | None = None,
    max_num_seqs: int | None = None,
    answer_format: str = AnswerFormat.VLLM.value,
    prompt_tokens_details: bool = True,
    tokenization: HfTokenization | None = None,
    block_hashing: VllmHashingSpec | None = None,
) -> EngineApp:
    """One engine's ASGI app; its step loop runs between lifespan startup and shutdown.

    ``answer_format`` (``vllm``, ``llamacpp``, ``llamacpp-legacy``) and ``prompt_tokens_details``
    (vLLM's ``--enable-prompt-tokens-details``) choose how its answers report the prompt tokens it
    reused (``usage_report.py``). ``tokenization`` and ``block_hashing`` make it a vLLM with that
    tokenizer and template and vLLM's block hashes (``sim --tokenizer``); by default the
    simulator's own words and chain."""
    if time_scale <= 0:
        raise ValueError("time_scale must be positive")
    report = UsageReport(AnswerFormat(answer_format), prompt_tokens_details)
    spec = get_profile(
        profile,
        ttft_ms=ttft_ms,
        itl_ms=itl_ms,
        gpu_memory_utilization=gpu_memory_utilization,
        cache_scope=cache_scope,
        max_num_seqs=max_num_seqs,
    )
    name = model or spec.model.name
    hashing = None if block_hashing is None or spec.kind is ProfileKind.INSTANT else block_hashing.build(BLOCK_SIZE)
    return EngineApp(
        spec,
        model=name,
        index=index,
        time_scale=time_scale,
        clock=clock,
        usage_report=report,
        tokenization=tokenization,
        hashing=hashing,
    )


async def _finished_whole(stream: TokenStream, send: Send, close_at: int | None) -> bool:
    """Wait for a non-streamed answer's end (dropping the connection at ``close_at`` tokens, the
    ``close_mid_stream`` fault); True when it finished and is to be sent."""
    while close_at is not None and stream.num_tokens < close_at and await stream.drain():
        pass
    if close_at is not None:
        await drop_connection(send, stream)
    await stream.wait_finished()
    return stream.finish_reason is not FinishReason.ABORT
