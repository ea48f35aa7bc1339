"""Every policy the tests run, from one builder: the test policy, edited section by section.

``build_policy(url, **sections)`` is the smallest complete test policy, as YAML text: classes
``interactive`` and ``batch``, models ``test/chat`` and ``test/other``, one ``vllm`` backend
``fake`` at ``url`` serving both, tenants ``acme`` (key ``key-acme``, every model) and
``globex`` (key ``key-globex``, ``test/chat`` only, class ``batch``).
``session_policy(url, **sections)`` is the policy of the session gateway (``tests/conftest.py``):
the same under ``SESSION``: small request limits that a test crosses with a small body, the
backend's credential, acme's limits, fast health checks, no breaker and no retries.

Each keyword edits one top-level section; a helper with a policy of its own passes it as a
layer of such edits before them (``build_policy(url, SESSION, retry=...)``). The rules, where
``OMIT`` removes what it stands for and ``None`` is YAML's null::

    build_policy(url, retry={"max_retries": 2})                  # a section is set, or updated key by key
    build_policy(url, limits=OMIT)                               # a section removed
    build_policy(url, tenants={"acme": {"limits": {"rpm": 3}}})  # named entries updated field by field
    build_policy(url, backends={"b2": backend("b2", url, [CHAT_MODEL])})  # a new name is added
    build_policy(url, tenants={"globex": OMIT})                  # an entry removed
    build_policy(url, backends=[backend("a", url, ["m"])])       # a list replaces every entry

Named entries are those of ``models``, ``backends`` and ``tenants`` (lists, by ``name``) and of
``classes`` (a mapping, by key); ``backend``, ``model`` and ``tenant`` build whole ones. A field
is replaced whole: ``{"limits": {"rpm": 3}}`` leaves acme no other limit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import yaml

from gateway.request.keys import hash_api_key

KEY_ACME = "key-acme"
KEY_GLOBEX = "key-globex"
CHAT_MODEL = "test/chat"
OTHER_MODEL = "test/other"
BACKEND_TOKEN_ENV = "GATEWAY_TEST_BACKEND_TOKEN"
MAX_BODY_BYTES = 65536
NOWHERE = "http://127.0.0.1:1"
"""A backend URL for a policy that is only loaded: nothing listens on port 1."""

INTERACTIVE_SLO: Final = {"ttft_ms": 500, "itl_ms": 30, "e2e_ms": 60000}
BATCH_SLO: Final = {"ttft_ms": 2000, "itl_ms": 100, "e2e_ms": 600000}


class _Omit:
    def __repr__(self) -> str:
        return "OMIT"


OMIT: Final = _Omit()
"""An edit that removes the section, entry or field it is given for."""

NAMED_LISTS = frozenset({"models", "backends", "tenants"})
NAMED_MAPPINGS = frozenset({"classes"})


def backend(name: str, url: str, models: Sequence[str], kind: str = "vllm", **fields: Any) -> dict[str, Any]:
    """One ``backends`` entry: ``backend("b0", url, ["m"], kind="sim", capacity={"max_concurrent": 1})``."""
    return {"name": name, "url": url, "kind": kind, "models": list(models), **fields}


def model(name: str, **fields: Any) -> dict[str, Any]:
    """One ``models`` entry: ``model("m", max_output_tokens=64)``."""
    return {"name": name, **fields}


def tenant(
    name: str, key: str, *, models: Sequence[str] = ("*",), default_class: str = "interactive", **fields: Any
) -> dict[str, Any]:
    """One ``tenants`` entry, holding the hash of ``key``: ``tenant("acme", KEY_ACME, limits={"rpm": 3})``."""
    entry = {"name": name, "key_hashes": [hash_api_key(key)], "models": list(models), "default_class": default_class}
    return {**entry, **fields}


def admin_keys(*keys: str) -> dict[str, Any]:
    """The ``admin`` section that lets ``keys`` call ``/admin/*``."""
    return {"key_hashes": [hash_api_key(key) for key in keys]}


def redis_state(url: str, prefix: str, *, timeout_ms: float = 1000, ping_interval_s: float = 0.05) -> dict[str, Any]:
    """A ``state`` section that puts the limits in Redis at ``url`` under ``prefix``.

    The timeout and the request budget are generous: the test machine is shared and busy, and a
    command slower than them would (rightly) send the gateway to its fallback for a ping interval.
    A killed Redis refuses connections at once, so it does not make the outage tests slower."""
    return {
        "backend": "redis",
        "redis_url": url,
        "key_prefix": prefix,
        "timeout_ms": timeout_ms,
        "request_budget_ms": timeout_ms,
        "ping_interval_s": ping_interval_s,
        "lease_ttl_s": max(1.0, 3 * ping_interval_s),
    }


def traces_to(sink_url: str, **fields: Any) -> dict[str, Any]:
    """A ``telemetry`` section that exports every trace to the OTLP/HTTP receiver at ``sink_url``."""
    return {"tracing": {"enabled": True, "endpoint": f"{sink_url}/v1/traces", "sampling_ratio": 1.0, **fields}}


def _base(backend_url: str) -> dict[str, Any]:
    return {
        "version": "test-1",
        "classes": {"interactive": {"rank": 0, "slo": INTERACTIVE_SLO}, "batch": {"rank": 1, "slo": BATCH_SLO}},
        "models": [
            model(CHAT_MODEL, max_prompt_tokens=64, max_output_tokens=32, default_max_tokens=16),
            model(OTHER_MODEL, max_prompt_tokens=64, max_output_tokens=32),
        ],
        "backends": [backend("fake", backend_url, [CHAT_MODEL, OTHER_MODEL])],
        "tenants": [
            tenant("acme", KEY_ACME),
            tenant("globex", KEY_GLOBEX, models=[CHAT_MODEL], default_class="batch"),
        ],
    }


SESSION: Final[Mapping[str, Any]] = {
    # Small on purpose, so that a test can cross each limit with a small body; small charges per
    # media part, so that an image fits the models' 64 prompt tokens.
    "limits": {
        "max_body_bytes": MAX_BODY_BYTES,
        "max_json_depth": 8,
        "max_messages": 4,
        "max_n": 2,
        "max_content_parts": 8,
        "max_tools": 4,
        "media_tokens": {"image_url": 8, "input_audio": 8, "video_url": 8, "file": 8},
        "max_tokens_over_limit": "reject",
    },
    "backends": {"fake": {"credential_env": BACKEND_TOKEN_ENV}},
    "tenants": {"acme": {"limits": {"rpm": 6000, "tpm": 20000000, "max_concurrent": 256}}},
    "health_checks": {"interval_s": 0.05, "timeout_s": 0.5},
    # The session gateway is shared by many tests that make its backend fail on purpose: no
    # breaker and no retries, so that one test's failures never change another's outcome.
    # Breakers and retries are tested with gateways of their own (tests/test_resilience.py).
    "breaker": {"consecutive_failures": None, "failure_ratio": None},
    "retry": {"max_retries": 0},
}
"""What the session gateway's policy adds to the test policy (see ``session_policy``)."""


def build_policy(backend_url: str = NOWHERE, /, *layers: Mapping[str, Any], **sections: Any) -> str:
    """The test policy with its backend at ``backend_url``, edited by each of ``layers`` in turn,
    then by ``sections`` (the rules of the module docstring)."""
    document = _base(backend_url)
    for layer in (*layers, sections):
        document = _edited(document, layer)
    return _dump(document)


def session_policy(backend_url: str = NOWHERE, /, **sections: Any) -> str:
    """The session gateway's policy (``SESSION`` over the test policy), each section edited."""
    return build_policy(backend_url, SESSION, **sections)


def _edited(document: Mapping[str, Any], sections: Mapping[str, Any]) -> dict[str, Any]:
    """``document`` with ``sections`` applied by the rules of the module docstring."""
    out = dict(document)
    for key, edit in sections.items():
        current = out.get(key)
        if edit is OMIT:
            out.pop(key, None)
        elif key in NAMED_LISTS and isinstance(edit, Mapping) and isinstance(current, list):
            out[key] = _edit_entries(current, edit)
        elif key in NAMED_MAPPINGS and isinstance(edit, Mapping) and isinstance(current, Mapping):
            out[key] = _edit_named(dict(current), edit)
        elif isinstance(edit, Mapping) and isinstance(current, Mapping):
            out[key] = _updated(current, edit)
        else:
            out[key] = edit
    return out


def _edit_entries(entries: list[dict[str, Any]], edits: Mapping[str, Any]) -> list[dict[str, Any]]:
    named = _edit_named({entry["name"]: entry for entry in entries}, edits)
    return [{"name": name, **fields} for name, fields in named.items()]


def _edit_named(entries: dict[str, Any], edits: Mapping[str, Any]) -> dict[str, Any]:
    for name, edit in edits.items():
        if edit is OMIT:
            entries.pop(name, None)
        elif name in entries:
            entries[name] = _updated(entries[name], edit)
        else:
            entries[name] = dict(edit)
    return {name: {k: v for k, v in fields.items() if k != "name"} for name, fields in entries.items()}


def _updated(mapping: Mapping[str, Any], edit: Mapping[str, Any]) -> dict[str, Any]:
    out = {**mapping, **edit}
    return {key: value for key, value in out.items() if value is not OMIT}


class _Dumper(yaml.SafeDumper):
    """Writes a value used twice (one SLO for two classes) twice, not as a YAML alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _dump(document: Mapping[str, Any]) -> str:
    return yaml.dump(dict(document), Dumper=_Dumper, sort_keys=False, allow_unicode=True)
