"""The baselines of the overhead benchmark: the least a Python proxy can do.

A pure ASGI app on uvicorn (uvloop, httptools) that reads the body, forwards it and returns
the answer: no auth, limits, admission, routing or metrics. What the gateway costs beyond this
is the price of its features, measured in the same run. ``--client`` picks the HTTP client
underneath, so that the data plane's choice is measured in the same run too (issue 14):
``httpx-aiohttp`` (httpx's API over aiohttp's transport, what the gateway uses around the hot
path: health checks, scrapes), ``aiohttp`` (aiohttp's client called directly) or ``wire``
(``gateway/upstream/wire.py``, the lean HTTP/1.1 client of the gateway's data plane).

    python -m loadtests.harness.minimal_proxy --upstream http://127.0.0.1:8001 --port 8002 [--client wire]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import httpx
import uvicorn
from httpx_aiohttp import AiohttpTransport
from starlette.types import Receive, Scope, Send

from gateway.upstream.wire import ConnectionPool, Origin, head_prefix, request_head

Forward = Callable[[str, bytes], Awaitable[tuple[int, bytes, AsyncIterator[bytes]]]]
"""POST a body to a URL: its status, content type and body chunks."""


def httpx_forward() -> tuple[Forward, Callable[[], Awaitable[None]]]:
    transport = AiohttpTransport(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=1000))

    async def forward(url: str, body: bytes) -> tuple[int, bytes, AsyncIterator[bytes]]:
        request = httpx.Request("POST", url, content=body, headers=[(b"content-type", b"application/json")])
        response = await transport.handle_async_request(request)

        async def chunks() -> AsyncIterator[bytes]:
            async for chunk in response.aiter_raw():
                yield chunk
            await response.aclose()

        return response.status_code, response.headers.get("content-type", "application/json").encode(), chunks()

    return forward, transport.aclose


def aiohttp_forward() -> tuple[Forward, Callable[[], Awaitable[None]]]:
    session: list[aiohttp.ClientSession] = []

    async def forward(url: str, body: bytes) -> tuple[int, bytes, AsyncIterator[bytes]]:
        if not session:  # made in the server's loop
            session.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000), auto_decompress=False))
        response = await session[0].post(url, data=body, headers={"content-type": "application/json"})

        async def chunks() -> AsyncIterator[bytes]:
            async for chunk in response.content.iter_any():
                yield chunk
            response.release()

        return response.status, response.headers.get("content-type", "application/json").encode(), chunks()

    async def close() -> None:
        if session:
            await session[0].close()

    return forward, close


def wire_forward(upstream: str) -> tuple[Forward, Callable[[], Awaitable[None]]]:
    pool = ConnectionPool(max_connections=1000)
    url = httpx.URL(upstream)
    origin = Origin(url.host, url.port or 80)
    fixed = [(b"content-type", b"application/json")]
    prefixes: dict[str, bytes] = {}  # the head of each path, built once as the gateway does

    async def forward(target: str, body: bytes) -> tuple[int, bytes, AsyncIterator[bytes]]:
        prefix = prefixes.get(target)
        if prefix is None:
            prefix = prefixes[target] = head_prefix(httpx.URL(target).raw_path, origin, fixed)
        connection = await pool.request(
            origin, request_head(prefix, {}, len(body)), body, connect_s=5.0, read_timeout=60.0
        )
        content_type = next((v for k, v in connection.headers if k.lower() == b"content-type"), b"application/json")

        async def chunks() -> AsyncIterator[bytes]:
            while data := await connection.read():
                yield data
            connection.finish()

        return connection.status, content_type, chunks()

    return forward, pool.aclose


def build_app(upstream: str, client: str = "httpx-aiohttp") -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    clients = {"aiohttp": aiohttp_forward, "httpx-aiohttp": httpx_forward}
    forward, close = wire_forward(upstream) if client == "wire" else clients[client]()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] in ("/health", "/healthz"):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        status, content_type, chunks = await forward(upstream + scope["path"], body)
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--client", choices=("httpx-aiohttp", "aiohttp", "wire"), default="httpx-aiohttp")
    args = parser.parse_args(argv)
    uvicorn.run(
        build_app(args.upstream.rstrip("/"), args.client),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        proxy_headers=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
