"""The supervisor's operator listener: a gateway's operator endpoints, answered for the whole set.

Each worker serves its own operator endpoints on loopback; the supervisor asks every worker at
once (``WorkerSet.operator_url``) and answers:

* ``GET /healthz``: 200 ``ok`` when every worker runs and answers its own ``/healthz``, else
  503 naming those that do not;
* ``GET /readyz``: 200 when every worker is ready, else 503 with the workers' answers (at once
  while the set drains);
* ``GET /metrics``: every worker's ``/metrics`` merged, each sample labelled ``worker``
  (``merge.py``), then the supervisor's own;
* ``POST /admin/reload``, ``GET /admin/policy``, ``GET /admin/rollout``: asked of every worker (below);
* ``POST /admin/rollout``: sent to one worker (below).

The admin endpoints are forwarded with the request's ``Authorization`` headers as they came (two
of them are refused by the worker as by a single gateway): each worker checks the key against
the policy it holds, as a single gateway does, so there is no second copy of the admin keys to
keep in step. If any worker answers 401 or 403, that answer is the supervisor's, alone: a caller
without an admin key learns no more from the set than from one gateway. Otherwise the answer is
every worker's, ``{"workers": [{"worker": 0, "status": 200, "response": {...}}, ...]}``, with the
highest of their statuses: 200 only when every worker answered 200 (a reload applied
everywhere), 422 when one refused the file, 503 when one did not answer (``worker_unavailable``,
within ``ADMIN_TIMEOUT_S``). ``GET /admin/rollout`` so shows how each worker follows each rollout
(its split, and the last verdict of the worker that judged it).

An operator's verdict on a rollout (``POST /admin/rollout``) is one decision, so it goes to one
worker, the first running, with its body, ``x-operator`` and ``content-type``, and its answer is
the supervisor's as it came (the same as a single gateway's). That worker saves the verdict in
the rollout store the set shares (Redis, or the rollout directory's files:
``gateway/rollout/store.py``) and applies it at once; the others follow at their next interval,
as the replicas do. Sent to every worker, it would be applied, logged and counted N times, and a
``promote`` would move the rollout N steps. A worker that does not answer gives 503
``worker_unavailable``, not a second try elsewhere: the first may have saved the verdict.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import httpx
import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Router
from starlette.types import Receive, Scope, Send

from gateway.app import OpenAIRoute, error_response, request_path, with_common_headers
from gateway.errors import GatewayError, NotFound, Overloaded
from gateway.request.intake import ClientDisconnected, read_body, read_headers
from gateway.server.admin import MAX_BODY_BYTES
from gateway.workers.merge import merge_families, parse_pages, supervisor_families

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
"""A worker's answer to a probe; a kubelet probing the supervisor needs ``timeoutSeconds`` above it."""
METRICS_TIMEOUT_S = 5.0
"""A worker's /metrics (Prometheus's scrape timeout is 10 s by default)."""
ADMIN_TIMEOUT_S = 10.0
"""A worker's reload: it reads, validates and builds the whole policy before answering."""
FORWARDED = (b"authorization", b"x-operator", b"content-type")
"""The headers an admin call is forwarded with, every occurrence: what the worker acts on."""
Headers = list[tuple[bytes, bytes]]
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class WorkerSet(Protocol):
    """What the operator endpoints read of the supervisor (``supervisor.Supervisor``)."""

    @property
    def count(self) -> int: ...

    @property
    def draining(self) -> bool: ...

    def operator_url(self, index: int) -> str: ...

    def alive(self) -> Sequence[bool]: ...

    def restarts(self) -> Sequence[int]: ...


class Answer(NamedTuple):
    """One worker's answer; status 503 and ``worker_unavailable`` when it gave none."""

    worker: int
    status: int
    body: bytes

    def summary(self) -> dict[str, object]:
        try:
            response: object = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            response = self.body.decode(errors="replace")
        return {"worker": self.worker, "status": self.status, "response": response}


class SupervisorApp:
    """The ASGI app of the supervisor's operator listener (see the module docstring)."""

    def __init__(self, workers: WorkerSet, http: httpx.AsyncClient) -> None:
        self._workers = workers
        self._http = http
        self._router = Router(
            routes=[
                OpenAIRoute("/healthz", self._healthz, methods=["GET", "HEAD"]),
                OpenAIRoute("/readyz", self._readyz, methods=["GET", "HEAD"]),
                OpenAIRoute("/metrics", self._metrics, methods=["GET"]),
                OpenAIRoute("/admin/reload", self._admin, methods=["POST"]),
                OpenAIRoute("/admin/policy", self._admin, methods=["GET"]),
                OpenAIRoute("/admin/rollout", self._rollout, methods=["GET", "POST"]),
            ],
            default=self._not_found,
            redirect_slashes=False,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        send = with_common_headers(scope, send)
        if request_path(scope) is None:  # percent-encoded: see ``gateway.app.request_path``
            await self._not_found(scope, receive, send)
            return
        await self._router(scope, receive, send)

    async def ask_all(self, method: str, path: str, timeout_s: float, headers: Headers | None = None) -> list[Answer]:
        """``method path`` of every worker at once; a worker not running, or not answering within
        ``timeout_s``, gives 503 ``worker_unavailable``."""
        alive = self._workers.alive()
        asks = [self._ask(i, alive[i], method, path, timeout_s, headers) for i in range(self._workers.count)]
        return list(await asyncio.gather(*asks))

    async def _ask(
        self,
        index: int,
        alive: bool,
        method: str,
        path: str,
        timeout_s: float,
        headers: Headers | None,
        body: bytes | None = None,
    ) -> Answer:
        if alive:
            try:
                url = self._workers.operator_url(index) + path
                reply = await self._http.request(method, url, headers=headers, content=body, timeout=timeout_s)
                return Answer(index, reply.status_code, reply.content)
            except httpx.HTTPError as exc:
                log.warning("worker %d did not answer %s %s: %s", index, method, path, exc or type(exc).__name__)
        error = Overloaded(
            f"Worker {index} is not running or did not answer within {timeout_s:g}s.",
            status=503,
            code="worker_unavailable",
            retry_after_s=1.0,
        )
        return Answer(index, error.status, error.body())

    async def _healthz(self, request: Request) -> Response:
        answers = await self.ask_all("GET", "/healthz", PROBE_TIMEOUT_S)
        down = [a.worker for a in answers if a.status != 200]
        if down:
            return JSONResponse({"alive": False, "workers_down": down}, status_code=503)
        return PlainTextResponse("ok")

    async def _readyz(self, request: Request) -> Response:
        if self._workers.draining:
            return JSONResponse({"ready": False, "reason": "draining"}, status_code=503)
        answers = await self.ask_all("GET", "/readyz", PROBE_TIMEOUT_S)
        ready = all(a.status == 200 for a in answers)
        body = {"ready": ready, "workers": [a.summary() for a in answers]}
        return JSONResponse(body, status_code=200 if ready else 503)

    async def _metrics(self, request: Request) -> Response:
        workers = self._workers
        answers = await self.ask_all("GET", "/metrics", METRICS_TIMEOUT_S)
        pages = {a.worker: a.body.decode(errors="replace") for a in answers if a.status == 200}
        alive, restarts = list(workers.alive()), list(workers.restarts())
        merged = await asyncio.to_thread(_merge, workers.count, pages, alive, restarts)
        return Response(merged, media_type=METRICS_TYPE)

    async def _admin(self, request: Request) -> Response:
        answers = await self.ask_all(request.method, request.url.path, ADMIN_TIMEOUT_S, _forwarded(request))
        for answer in answers:
            if answer.status in (401, 403):
                return Response(answer.body, status_code=answer.status, media_type="application/json")
        status = max(a.status for a in answers)
        return JSONResponse({"workers": [a.summary() for a in answers]}, status_code=status)

    async def _rollout(self, request: Request) -> Response:
        """``GET``: every worker's view; ``POST``: one worker's verdict (module docstring)."""
        if request.method == "GET":
            return await self._admin(request)
        try:
            body = await read_body(
                request.receive, read_headers(request.scope["headers"]).content_length, MAX_BODY_BYTES
            )
        except GatewayError as error:
            return error_response(error)
        except ClientDisconnected:
            return Response(status_code=400)  # gone: nobody reads it
        alive = self._workers.alive()
        first = next((index for index, running in enumerate(alive) if running), 0)
        path = request.url.path
        answer = await self._ask(first, alive[first], "POST", path, ADMIN_TIMEOUT_S, _forwarded(request), body)
        return Response(answer.body, status_code=answer.status, media_type="application/json")

    async def _not_found(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = NotFound(f"No route for {scope.get('method', '')} {scope.get('path', '')}.")
        await error_response(error)(scope, receive, send)


def _forwarded(request: Request) -> Headers:
    """The request's ``FORWARDED`` headers, each occurrence as it came."""
    return [(name, value) for name, value in request.scope["headers"] if name.lower() in FORWARDED]


def _merge(count: int, pages: dict[int, str], alive: list[bool], restarts: list[int]) -> bytes:
    """Parsing a few thousand lines per worker takes milliseconds: in a thread, off the loop."""
    parsed = parse_pages(pages)
    up = [index in parsed for index in range(count)]
    return merge_families(parsed, supervisor_families(count, alive, restarts, up))
