"""Fault injection: make one engine fail the way real engines fail, on demand.

A ``Fault`` is set per engine with ``POST /admin/fault`` (``GET`` shows the one in force) or
the ``inference-gateway sim --fault`` flags, and applies to inference requests that arrive
after it is set (``/health`` and ``/metrics`` keep answering, as a wedged vLLM's do):

* ``none``: normal service.
* ``fail_503``: every inference request is answered 503 in vLLM's error shape, without
  reaching the engine.
* ``stall``: the engine stops generating a request after ``after_tokens`` tokens and keeps its
  slot and KV blocks, as a hung GPU would; a stream has sent those tokens and then goes quiet
  with the connection open, a non-streaming request never gets its answer. Only the client's
  disconnect ends it, and that counts as an abort (``sim:requests_aborted_total``).
* ``close_mid_stream``: after ``after_tokens`` tokens the engine drops the TCP connection
  (a FIN in the middle of the chunked body: the client sees an incomplete response); a
  non-streaming request gets no answer at all. The engine frees the request, which counts as
  an abort too.

A request that asks for no more than ``after_tokens`` tokens is not affected by ``stall`` or
``close_mid_stream``. Both need an engine (not the ``instant`` profile). Each affected request
is counted in ``sim:faults_injected_total{mode}``.

Usage::

    curl -X POST localhost:8001/admin/fault -d '{"mode": "stall", "after_tokens": 5}'
    inference-gateway sim --profile fixed --port 8001 --fault close_mid_stream --fault-after-tokens 3
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from loadtests.sim.protocol import ApiError
from loadtests.sim.stream import TokenStream

Send = Any  # the ASGI send callable


class FaultMode(StrEnum):
    NONE = "none"
    FAIL_503 = "fail_503"
    STALL = "stall"
    CLOSE_MID_STREAM = "close_mid_stream"


@dataclass(frozen=True, slots=True)
class Fault:
    """The fault an engine injects (see the module docstring)."""

    mode: FaultMode = FaultMode.NONE
    after_tokens: int = 0

    def __post_init__(self) -> None:
        if self.after_tokens < 0:
            raise ValueError("after_tokens must be >= 0")

    @property
    def needs_engine(self) -> bool:
        return self.mode in (FaultMode.STALL, FaultMode.CLOSE_MID_STREAM)

    def stall_at(self, max_tokens: int) -> int | None:
        """Where the engine parks a request asking for ``max_tokens``; None: it runs to the end."""
        if self.needs_engine and self.after_tokens < max_tokens:
            return self.after_tokens
        return None

    def close_at(self, max_tokens: int) -> int | None:
        """After how many tokens the connection is dropped; None: it is not."""
        return self.stall_at(max_tokens) if self.mode is FaultMode.CLOSE_MID_STREAM else None

    def to_json(self) -> bytes:
        return orjson.dumps({"mode": self.mode.value, "after_tokens": self.after_tokens})

    @classmethod
    def parse(cls, body: bytes) -> Fault:
        """A fault from the admin endpoint's JSON body; ``ApiError`` (400) if malformed."""
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"invalid JSON: {exc}") from exc
        if not isinstance(document, dict):
            raise ApiError(400, "the body must be a JSON object")
        unknown = set(document) - {"mode", "after_tokens"}
        if unknown:
            raise ApiError(400, f"unknown keys: {sorted(unknown)}")
        modes = [m.value for m in FaultMode]
        mode = document.get("mode")
        if mode not in modes:
            raise ApiError(400, f"'mode' must be one of {modes}", param="mode")
        after = document.get("after_tokens", 0)
        if not isinstance(after, int) or isinstance(after, bool) or after < 0:
            raise ApiError(400, "'after_tokens' must be an integer >= 0", param="after_tokens")
        return cls(FaultMode(mode), after)


def unavailable() -> ApiError:
    """The answer of ``fail_503``."""
    return ApiError(503, "The engine is unavailable (injected fault fail_503).")


async def drop_connection(send: Send, stream: TokenStream) -> None:
    """Close the client's TCP connection now, then wait until the engine has let go of ``stream``.

    ASGI has no message for it, so this closes uvicorn's transport (the owner of ``send``);
    buffered bytes are flushed first. The disconnect reaches the app's disconnect watcher,
    which aborts the request; once it has, uvicorn sees a disconnected client and logs nothing.
    """
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None:
        raise ConnectionAbortedError("injected close_mid_stream")  # the server closes on an app error
    transport.close()
    await stream.wait_finished()
