"""One output-length bound per request, and the one body field each backend kind obeys for it.

**Why.** Clients name the output bound with several fields, and engines read different ones:

============  =======================================  ==========================================
engine        ``/v1/chat/completions``                 ``/v1/completions``
============  =======================================  ==========================================
vLLM          ``max_completion_tokens or max_tokens``  ``max_tokens`` (unknown fields ignored)
SGLang        ``max_completion_tokens or max_tokens``  ``max_tokens``
llama.cpp     ``n_predict``, else ``max_tokens``       ``n_predict``, else ``max_tokens``
OpenAI        ``max_completion_tokens`` (reasoning     ``max_tokens``
              models refuse ``max_tokens``)
simulator     ``max_completion_tokens or max_tokens``  ``max_tokens``
============  =======================================  ==========================================

A gateway that checks one field and forwards the body as it came caps nothing: on
``/v1/completions``, ``{"max_completion_tokens": 1, "max_tokens": 3000}`` passed a check of the
first and vLLM generated 3,000 tokens. So the bound is read once, from every alias
(``requested_output_length``), capped once (``gateway/admission/build.py``), and each attempt's body
carries exactly one field, the one its backend's kind obeys, set to the bound, with every other
alias removed (``output_length_edits``). A request that named no bound gets one too: an engine's
own default is its remaining context, far above any cap.

**Which field per kind** (``obeyed_field``, from each dialect's ``output_field`` in
``gateway/dialects/``, which for chat and completions reads the kind's record,
``EngineKind.chat_output_field`` and ``completions_output_field`` in ``gateway/engines.py``): the
one every version of that engine reads.
vLLM and SGLang get ``max_tokens`` (deprecated on chat, but read by every release; versions
before ``max_completion_tokens`` existed ignore it as an unknown field, so sending it alone could
lift the cap); llama.cpp gets ``n_predict`` (its native field, read before ``max_tokens``);
OpenAI's chat gets ``max_completion_tokens`` (its reasoning models refuse ``max_tokens``).

**Several aliases with different values are refused** (400 ``conflicting_max_tokens`` naming
them) rather than resolved by a rule: engines disagree on which one wins, so whatever rule the
gateway picked, the client would get a bound other than the one it meant from some backend, and
two values in one request are a client bug (or a probe) worth saying so. Equal values are fine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from gateway.errors import InvalidRequest
from gateway.policy.model import BackendKind

OUTPUT_LENGTH_FIELDS = ("max_completion_tokens", "max_tokens", "n_predict")
"""Every request field an engine behind the gateway reads as the output bound on the OpenAI
generating APIs (chat and completions: their dialects' ``output_aliases``)."""


class OutputBound(Protocol):
    """What this module reads of an API: the two output-bound members of a dialect's ``BodyRules``
    (``gateway/dialects/base.py``, where they are documented), declared here because the dialects'
    stage is above this one; every dialect is one."""

    @property
    def output_aliases(self) -> tuple[str, ...]: ...

    def output_field(self, kind: BackendKind) -> str | None: ...


def requested_output_length(
    body: Mapping[str, Any], aliases: tuple[str, ...] = OUTPUT_LENGTH_FIELDS
) -> tuple[int | None, str | None]:
    """The bound the client asked for and the field it used; ``(None, None)`` when it named none.

    ``null`` counts as absent. Every alias present must be a positive integer, and all of
    them must agree (see the module docstring)."""
    found: list[tuple[str, int]] = []
    for name in aliases:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidRequest(f"'{name}' must be a positive integer.", param=name)
        found.append((name, value))
    if not found:
        return None, None
    if len({value for _, value in found}) > 1:
        named = ", ".join(f"'{name}' is {value}" for name, value in found)
        raise InvalidRequest(
            f"The output length is given twice with different values ({named}); send one of them.",
            code="conflicting_max_tokens",
            param=found[1][0],
        )
    name, value = found[0]
    return value, name


def obeyed_field(kind: BackendKind, api: OutputBound) -> str | None:
    """The one field a backend of ``kind`` reads as the output bound on ``api`` (None: embeddings)."""
    return api.output_field(kind)


def output_length_edits(kind: BackendKind, api: OutputBound, bound: int) -> dict[str, int | None]:
    """The body edits that give a backend of ``kind`` exactly ``bound``: alias -> None (remove), field -> bound.

    Pure: the caller applies them to its own copy of the body (``fit_output_length``)."""
    field = api.output_field(kind)
    if field is None:
        return {}
    edits: dict[str, int | None] = dict.fromkeys(api.output_aliases)
    edits[field] = bound
    return edits


def fit_output_length(body: dict[str, Any], kind: BackendKind, api: OutputBound, bound: int) -> bool:
    """Apply ``output_length_edits`` to ``body`` in place; True when it changed (re-serialise it)."""
    changed = False
    for name, value in output_length_edits(kind, api, bound).items():
        if value is None:
            if name in body:
                del body[name]
                changed = True
        elif body.get(name) != value or type(body.get(name)) is not int:
            body[name] = value
            changed = True
    return changed
