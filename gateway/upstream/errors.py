"""What a client may learn when a backend fails, and what only the operator may.

A backend's error answer is written for the backend's operator, not for the gateway's clients:
it names internal hosts, it is an HTML page from a proxy in front of the engine, and a backend
that echoes its request puts the gateway's own credential in it. So no byte of a failed
upstream answer reaches a client as it is. The rule, for every failure (an error status before
the stream starts, an error event inside it, a 200 the gateway cannot use):

* The client gets the gateway's own OpenAI-shaped error, chosen by the upstream status
  (``mapped_error``)::

      upstream status            client status, code          because
      400, 413, 422              400 upstream_rejected        the engine judged the request itself invalid
      401, 403, 407              502 upstream_auth_failed     the gateway's credential for the backend is wrong
      404, 405, 3xx              502 upstream_misconfigured   the backend does not serve what the policy says
      408, 504                   504 upstream_timeout
      429 (retries exhausted)    503 upstream_overloaded      with the gateway's Retry-After
      503                        503 upstream_unavailable     with the gateway's Retry-After
      any other 2xx              502 upstream_protocol_error  (a 200 that is no answer, too)
      anything else              502 upstream_error

  The upstream status itself is not shown (a client with a valid key never reads a 401), and
  the backend's ``Retry-After`` is never relayed: the gateway's is the backend's hint bounded
  to [1, 30] s (a broken backend cannot park every client for an hour), else 1 s.

* Only a rejection (400) carries words from the backend, because the client needs them to fix
  its request (vLLM: "This model's maximum context length is 4096 tokens ..."): the gateway's
  sentence plus an ``excerpt`` of the ``message`` string of a JSON error body (the OpenAI,
  vLLM, SGLang and llama.cpp shapes), and the body's ``param`` when it is a plain field name.
  Never anything from a non-JSON body: an HTML page is dropped whole.

* ``excerpt`` makes one line of at most ``EXCERPT_CHARS`` characters, in this order: every
  credential value the gateway holds for a backend (and its URL-encoded form) and every
  backend host name are replaced, wherever they are; everything from the first echoed request
  field on (``'input':``, ``input_value=``, ``value=``, ``"messages":``, ``"prompt":``,
  ``"content":``, ``"text":``) is cut, because what follows is the client's prompt (vLLM's
  validation errors repeat the offending input) and prompts go neither to logs nor to traces;
  then what is secret by its *form* is replaced: URLs, ``authorization: ...``-style pairs,
  ``Bearer``/``Basic`` tokens, e-mail addresses, IPv4/IPv6 addresses, host names, absolute
  (or three-level relative) file paths, and any run of 32+ key-like characters.

* The operator gets the upstream status and the same kind of excerpt (of a non-JSON body: its
  text without tags) in one warning line carrying the client's request id and the engine's,
  and on the attempt's trace span (``FaultLog``).

Why this rule for 400s rather than an allowlist of known engine messages: an allowlist goes
stale with every engine release and leaves the client with "rejected" and no reason, while
the redaction removes secrets by their form and so holds for messages nobody listed. What it
cannot tell apart is a rejection caused by a field the *gateway* added (an engine too old for
``cache_salt`` or ``priority``): that still reads as a 400, with the field named in the
excerpt, which is what the operator needs to see it.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import orjson

from gateway.dialects.openai_answers import is_openai_answer
from gateway.errors import GatewayError, UpstreamError, UpstreamRejected, UpstreamTimeout, UpstreamUnavailable

log = logging.getLogger(__name__)

EXCERPT_CHARS = 200
SCAN_CHARS = 1024  # of a text, scanned for the excerpt: five times what it may show
RETRY_AFTER_DEFAULT_S = 1.0
RETRY_AFTER_MAX_S = 30.0
REDACTED = "[redacted]"
LEAK_MIN_CHARS = 12

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]")
_SPACES = re.compile(r"\s+")
_ECHO = re.compile(r"""(?i)['"]?\b(?:input_value|input|value|messages|prompt|content|text)\b['"]?\s*[:=]""")
_TAGS = re.compile(r"<[^<>]*>")
_PARAM = re.compile(r"[A-Za-z_][\w.\[\]-]{0,63}")
_SECRET_KEYS = (
    r"proxy-authorization|authorization|x-api-key|api[-_]?key|access[-_]?token|token|password|passwd|secret"
    r"|set-cookie|cookie|cache_salt"
)
# Secret by form, replaced in this order (a URL holds a host, a path may hold a file name like a host).
# Every quantifier is bounded or unambiguous: no backtracking blow-up on a hostile 4 KiB line.
_FORMS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(?i)\b[a-z][a-z0-9+.-]{0,15}://\S+"), "[url]"),
    (
        re.compile(
            rf"""(?i)\b({_SECRET_KEYS})(["']?\s*[:=]\s*)(?:"[^"]*"|'[^']*'|(?:bearer|basic|digest)\s+\S+|[^\s,;}}\]]+)"""
        ),
        rf"\1\2{REDACTED}",
    ),
    (re.compile(r"(?i)\b(bearer|basic|digest)\s+[\w.~+/=-]+"), rf"\1 {REDACTED}"),
    (re.compile(r"[\w.+-]{1,64}@[\w-]{1,63}(?:\.[\w-]{1,63})+"), "[email]"),
    (re.compile(r"(?<![\w.~/\\-])(?:~|[A-Za-z]:)?[/\\][\w.@+-]+(?:[/\\][\w.@+-]+)*[/\\]?"), "[path]"),
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b"), "[ip]"),
    (re.compile(r"(?i)(?<![\w:])\[?(?:[0-9a-f]{0,4}:){2,7}[0-9a-f]{0,4}\]?(?::\d{1,5})?(?![\w:])"), "[ip]"),
    (re.compile(r"(?i)\b(?:[a-z0-9-]{1,63}\.){1,8}[a-z][a-z-]{0,62}[a-z]\b(?::\d{1,5})?"), "[host]"),
    (re.compile(r"\b[\w.-]{1,64}(?:/[\w.-]{1,64}){2,}"), "[path]"),
    (re.compile(r"[A-Za-z0-9_+/=-]{32,}"), REDACTED),
)


class Redactor:
    """Replaces the gateway's own secrets by value, and anything secret by its form.

    ``secrets`` are the credential values the gateway sends to backends; ``hosts`` the host
    names (and URL user info) of the backends' URLs, which a name like ``vllm-0`` would escape
    by form. ``head`` cuts a long text so that no known value straddles the cut (half of one
    would escape ``known``).
    ``leaks`` says whether relayed bytes hold a known secret of at least ``LEAK_MIN_CHARS``
    characters: a shorter one (``EMPTY``, the usual dummy key of an unauthenticated vLLM) is
    ordinary text that a model may well write, and no secret worth a failed answer.
    """

    __slots__ = ("_known", "_leak", "_longest")

    def __init__(self, secrets: Iterable[str] = (), hosts: Iterable[str] = ()) -> None:
        plain = {s for s in secrets if s}
        values = plain | {quote(s, safe="") for s in plain}
        checked = sorted((v.encode() for v in values if len(v) >= LEAK_MIN_CHARS), key=len, reverse=True)
        self._leak = re.compile(b"|".join(re.escape(v) for v in checked)) if checked else None
        parts = [re.escape(v) for v in sorted(values, key=len, reverse=True)]
        named = sorted({h for h in hosts if h}, key=len, reverse=True)
        parts += [rf"(?i:\b{re.escape(h)}\b)(?::\d{{1,5}})?" for h in named]  # with its port
        self._known = re.compile("|".join(parts)) if parts else None
        self._longest = max((len(v) for v in (*values, *hosts)), default=0)

    def head(self, text: str, chars: int) -> str:
        """At most ``chars`` of ``text``, less the length of the longest known value when cut."""
        return text if len(text) <= chars else text[: max(0, chars - self._longest)]

    def known(self, text: str) -> str:
        """``text`` with every known secret and backend host replaced."""
        return text if self._known is None else self._known.sub(REDACTED, text)

    def leaks(self, data: bytes) -> bool:
        return self._leak is not None and self._leak.search(data) is not None

    def __repr__(self) -> str:
        return f"Redactor(leak_checked={self._leak is not None})"


def forms(text: str) -> str:
    """``text`` with what is secret by its form replaced (URLs, hosts, addresses, tokens, paths)."""
    for pattern, replacement in _FORMS:
        text = pattern.sub(replacement, text)
    return text


def excerpt(text: str, redactor: Redactor, limit: int = EXCERPT_CHARS) -> str:
    """One sanitised line of at most ``limit`` characters (rules in the module docstring)."""
    cut = len(text) > SCAN_CHARS
    text = _CONTROL.sub(" ", redactor.known(redactor.head(text, SCAN_CHARS)))
    echo = _ECHO.search(text)
    if echo is not None:
        text, cut = text[: echo.start()], True
    text = _SPACES.sub(" ", forms(text)).strip()
    if len(text) > limit:
        text, cut = text[:limit].rsplit(" ", 1)[0], True  # never the first half of a word
    return f"{text.rstrip(' ,;:')}..." if cut and text else text


@dataclass(frozen=True, slots=True)
class UpstreamFault:
    """What a backend said when it failed: for the operator (logs, traces), never for the client.

    ``status`` is the HTTP status, or the one an error event names in its ``code`` (0: none);
    ``excerpt`` is sanitised (``excerpt``); ``where`` says what failed: ``status`` (an error
    answer), ``event`` (an error event in a stream) or ``answer`` (a 200 that is no answer).
    """

    status: int
    excerpt: str
    where: str


class FaultTrace(Protocol):
    """Whatever records a fault on the attempt's span (``gateway.telemetry.tracing.AttemptSpan``)."""

    def upstream_fault(self, *, status: int, excerpt: str) -> None: ...


@dataclass(frozen=True, slots=True)
class FaultLog:
    """Where one attempt's upstream failures are reported: a warning line and the attempt's span.

    The line joins the attempt's two ids: the client's request id (what the client, the trace
    log and the gateway's span know) and the engine's (what the backend's own logs know).
    """

    backend: str
    request_id: str
    engine_request_id: str
    trace: FaultTrace | None = None

    def __call__(self, fault: UpstreamFault) -> None:
        log.warning(
            "request %s: backend %s failed (%s %s; engine request %s): %r",
            self.request_id,
            self.backend,
            fault.where,
            fault.status,
            self.engine_request_id,
            fault.excerpt,
        )
        if self.trace is not None:
            self.trace.upstream_fault(status=fault.status, excerpt=fault.excerpt)


def gateway_retry_after(backend_hint_s: float | None) -> float:
    """The Retry-After the gateway gives for a backend that is full or down (module docstring)."""
    if backend_hint_s is None or not math.isfinite(backend_hint_s):
        return RETRY_AFTER_DEFAULT_S
    return min(max(backend_hint_s, RETRY_AFTER_DEFAULT_S), RETRY_AFTER_MAX_S)


def mapped_error(
    status: int, *, detail: str = "", param: str | None = None, retry_after_s: float | None = None
) -> GatewayError:
    """The gateway's error for an upstream ``status`` (the table in the module docstring).

    ``detail`` (an ``excerpt``) and ``param`` (a ``plain_param``) are shown only with a rejection.
    """
    if status in (400, 413, 422):
        message = f"The backend rejected the request: {detail}" if detail else "The backend rejected the request."
        return UpstreamRejected(message, param=param)
    if status in (401, 403, 407):
        return UpstreamError(
            "The gateway could not authenticate to the backend. This is a problem of the gateway's "
            "configuration, not of your request or your key.",
            code="upstream_auth_failed",
        )
    if status in (404, 405) or 300 <= status < 400:
        return UpstreamError(
            "The backend does not serve this request as the gateway is configured to send it. "
            "This is a problem of the gateway's configuration, not of your request.",
            code="upstream_misconfigured",
        )
    if status in (408, 504):
        return UpstreamTimeout("The backend timed out.")
    if status in (429, 503):
        wait_s = gateway_retry_after(retry_after_s)
        if status == 429:
            return UpstreamUnavailable(
                f"The backend is overloaded; retry after {wait_s:g}s.", code="upstream_overloaded", retry_after_s=wait_s
            )
        return UpstreamUnavailable(f"The backend is unavailable; retry after {wait_s:g}s.", retry_after_s=wait_s)
    if 200 <= status < 300:
        return UpstreamError("The backend sent an answer the gateway cannot use.", code="upstream_protocol_error")
    return UpstreamError("The backend failed to process the request.", code="upstream_error")


def plain_param(param: str | None, redactor: Redactor) -> str | None:
    """An error's ``param`` when it is a plain field name that sanitising leaves alone, else None."""
    if param is None or not _PARAM.fullmatch(param) or excerpt(param, redactor) != param:
        return None
    return param


def status_error(
    status: int, body: bytes, redactor: Redactor, *, retry_after_s: float | None = None
) -> tuple[GatewayError, UpstreamFault]:
    """The client's error and the operator's record for an error answer ``status`` + ``body``."""
    document = _json(body)
    message, param, _ = _error_fields(document)
    if message is not None:
        shown = excerpt(message, redactor)
        error = mapped_error(status, detail=shown, param=plain_param(param, redactor), retry_after_s=retry_after_s)
        return error, UpstreamFault(status, shown, "status")
    logged = excerpt(_text_of(body, redactor), redactor)
    return mapped_error(status, retry_after_s=retry_after_s), UpstreamFault(status, logged, "status")


ERROR_EVENT_TYPES = frozenset({"error", "response.failed"})
"""Typed stream events that report a failure (Responses: ``error``, ``response.failed``)."""


def is_error_document(document: dict[str, Any]) -> bool:
    """An error object in any engine's shape (``{"error": ...}``, vLLM's flat ``object: error``,
    a typed ``error`` or ``response.failed`` event)."""
    return bool(document.get("error")) or document.get("object") == "error" or document.get("type") in ERROR_EVENT_TYPES


def event_error(document: Any, redactor: Redactor) -> tuple[GatewayError, UpstreamFault]:
    """The gateway's error event for an upstream error event (its JSON, already parsed).

    vLLM and llama.cpp put the HTTP status in the error's ``code``; without one, an error whose
    ``type`` says the request was invalid is a 400, anything else a 500.
    """
    message, param, code = _error_fields(document)
    status = _status_of(code, document)
    shown = excerpt(message, redactor) if message is not None else ""
    error = mapped_error(status or 500, detail=shown, param=plain_param(param, redactor))
    return error, UpstreamFault(status, shown or excerpt(_text_of(orjson.dumps(document), redactor), redactor), "event")


def answer_error(
    body: bytes,
    document: Any,
    redactor: Redactor,
    is_answer: Callable[[dict[str, Any]], bool] = is_openai_answer,
) -> tuple[GatewayError, UpstreamFault] | None:
    """Why a 200 answer (``body``, parsed as ``document`` or None) must not reach the client, if it must not.

    An answer is a JSON object shaped as the API answers (``is_answer``, the request's dialect's)
    that holds none of the gateway's credentials; an error object in a 200 is the error it says.
    """
    if isinstance(document, dict):
        if is_error_document(document):
            error, fault = event_error(document, redactor)
            return error, UpstreamFault(fault.status, fault.excerpt, "answer")
        shaped = is_answer(document)
        if shaped and not redactor.leaks(body):
            return None
        if shaped:
            return mapped_error(200), UpstreamFault(200, "the answer holds a credential of the gateway", "answer")
    return mapped_error(200), UpstreamFault(200, excerpt(_text_of(body, redactor), redactor), "answer")


def _json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def _error_fields(document: Any) -> tuple[str | None, str | None, Any]:
    """``(message, param, code)`` of an error body: nested (OpenAI, vLLM), flat (SGLang, llama.cpp, old vLLM)."""
    if not isinstance(document, dict):
        return None, None, None
    if document.get("type") == "response.failed" and isinstance(document.get("response"), dict):
        document = document["response"]  # the failure is the response's own ``error``
    inner = document.get("error")
    if isinstance(inner, str):
        return inner, None, document.get("code")
    source = inner if isinstance(inner, dict) else document
    message = source.get("message")
    if not isinstance(message, str):
        detail = source.get("detail")  # FastAPI's own errors
        message = detail if isinstance(detail, str) else None
    param = source.get("param")
    return message, param if isinstance(param, str) else None, source.get("code")


def _status_of(code: Any, document: Any) -> int:
    if isinstance(code, str) and code.isdigit():
        code = int(code)
    if isinstance(code, int) and not isinstance(code, bool) and 100 <= code <= 599:
        return code
    inner = document.get("error") if isinstance(document, dict) else None
    kind = (inner if isinstance(inner, dict) else document if isinstance(document, dict) else {}).get("type")
    if isinstance(kind, str) and ("invalid_request" in kind.lower() or "badrequest" in kind.lower()):
        return 400
    return 0


def _text_of(body: bytes, redactor: Redactor) -> str:
    """The head of a body as text for the operator's excerpt, markup tags dropped."""
    text = redactor.head(body.decode(errors="replace"), 8 * SCAN_CHARS)
    return _TAGS.sub(" ", text) if "<" in text else text
