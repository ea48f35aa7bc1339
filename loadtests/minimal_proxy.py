"""The baseline of the overhead benchmark: the least a Python proxy can do.

A pure ASGI app on uvicorn (uvloop, httptools) that reads the body, forwards it with httpx over
the aiohttp transport, and returns the answer: no auth, limits, admission, routing or metrics.
What the gateway costs beyond this is the price of its features, measured in the same run.

    python -m loadtests.minimal_proxy --upstream http://127.0.0.1:8001 --port 8002
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable

import httpx
import uvicorn
from httpx_aiohttp import AiohttpTransport
from starlette.types import Receive, Scope, Send


def build_app(upstream: str) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    transport = AiohttpTransport(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=1000))

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await transport.aclose()
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
        request = httpx.Request(
            "POST", upstream + scope["path"], content=body, headers=[(b"content-type", b"application/json")]
        )
        response = await transport.handle_async_request(request)
        await send(
            {
                "type": "http.response.start",
                "status": response.status_code,
                "headers": [(b"content-type", response.headers.get("content-type", "application/json").encode())],
            }
        )
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await response.aclose()
        await send({"type": "http.response.body", "body": b""})

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvicorn.run(
        build_app(args.upstream.rstrip("/")),
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
