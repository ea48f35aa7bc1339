"""Over generated policies: no backend that tenants of two cache scopes can reach ever receives a
request its engine runs unsalted, whatever the API (chat, completions, Responses, Messages) and
whether the request is a client's own attempt or a model group's shadow copy.

Hypothesis draws policies of a few tenants (private, or two in a shared scope; naming models,
groups, or ``"*"``), plain models, model groups (targets, fallbacks, class fallbacks, a shadow)
and backends of every kind (some with a ``tenants:`` list), under each ``cache_isolation.unsalted``
mode. For every policy that loads, the test works out who reaches each backend on its own (the
oracle below, written from the policy's documented meaning, not from ``gateway/routing/reach.py``),
then asks the decision every attempt and every shadow copy goes through
(``isolation.attempt_isolation``) what each tenant's request of each API would carry to each
backend it reaches, and checks it against what the engine does with it:

* a salted engine (vLLM, SGLang, the simulator) keys its cache by ``cache_salt`` on chat,
  completions and Responses requests; its ``/v1/messages`` drops the field (vLLM's
  ``AnthropicMessagesRequest`` has none), so a Messages request passed through runs unsalted;
* llama.cpp reuses no prompt when the body says ``cache_prompt: false``;
* an ``openai`` backend never isolates anything.

A request that runs unsalted on a backend that two scopes reach is allowed only where the policy
says so: ``unsalted: shared``, with a warning naming the backend. The oracle's set of backends
that several scopes reach must also be exactly the snapshot's (no path forgotten, none invented,
so Messages keeps its passthrough wherever one scope alone reaches the engine).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.dialects.base import Dialect
from gateway.dialects.chat import CHAT
from gateway.dialects.completions import COMPLETIONS
from gateway.dialects.messages import MESSAGES
from gateway.dialects.responses import RESPONSES
from gateway.policy.loader import PolicyError
from gateway.policy.model import Backend, Tenant
from gateway.policy.snapshot import PolicySnapshot
from gateway.request.keys import hash_api_key
from gateway.routing.isolation import CacheSalter
from gateway.service import parse_policy
from gateway.upstream.body import attempt_isolation

APIS: tuple[Dialect, ...] = (CHAT, COMPLETIONS, RESPONSES, MESSAGES)
SALTED_KINDS = {"vllm", "sglang", "sim"}
READS_SALT = {"chat", "completions", "responses"}
"""The APIs whose engine endpoint keys the prefix cache by ``cache_salt`` (not vLLM's Messages)."""
MODELS = [f"m{i}" for i in range(5)]
SLO = {"ttft_ms": 500, "itl_ms": 50, "e2e_ms": 30000}
SALTER = CacheSalter(b"property-test-secret")


@dataclass(frozen=True)
class Drawn:
    """A generated policy, kept as plain data for the oracle."""

    document: dict[str, Any]
    groups: dict[str, set[str]]
    """Each group's members (targets, fallbacks, class fallbacks, shadow), as the policy says."""


@st.composite
def groups(draw: st.DrawFn) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    free = list(MODELS)
    for g in range(draw(st.integers(0, 2))):
        if len(free) < 1:
            break
        targets = draw(st.lists(st.sampled_from(free), min_size=1, max_size=2, unique=True))
        rest = [m for m in free if m not in targets]
        group: dict[str, Any] = {"name": f"g{g}", "targets": [{"model": m} for m in targets]}
        if rest and draw(st.booleans()):
            group["fallbacks"] = draw(st.lists(st.sampled_from(rest), min_size=1, max_size=2, unique=True))
        if rest and draw(st.booleans()):
            group["class_fallbacks"] = {"batch": draw(st.lists(st.sampled_from(rest), max_size=2, unique=True))}
        if rest and draw(st.booleans()):
            group["shadow"] = {"model": draw(st.sampled_from(rest)), "percent": 50}
        used = set(targets) | set(group.get("fallbacks", ())) | set(group.get("class_fallbacks", {}).get("batch", ()))
        used |= {group["shadow"]["model"]} if "shadow" in group else set()
        free = [m for m in free if m not in used]  # a model serves one group at most
        out.append(group)
    return out


def members(group: dict[str, Any]) -> set[str]:
    out = {t["model"] for t in group["targets"]} | set(group.get("fallbacks", ()))
    for chain in group.get("class_fallbacks", {}).values():
        out |= set(chain)
    if "shadow" in group:
        out.add(group["shadow"]["model"])
    return out


@st.composite
def policies(draw: st.DrawFn) -> Drawn:
    drawn_groups = draw(groups())
    by_group = {g["name"]: members(g) for g in drawn_groups}
    internal = set().union(*by_group.values()) if by_group else set()
    public = [*by_group, *(m for m in MODELS if m not in internal)]
    tenant_names = [f"t{i}" for i in range(draw(st.integers(2, 4)))]
    tenants = []
    for name in tenant_names:
        names = ["*"] if draw(st.booleans()) else draw(st.lists(st.sampled_from(public), min_size=1, unique=True))
        entry: dict[str, Any] = {
            "name": name,
            "key_hashes": [hash_api_key(f"key-{name}")],
            "models": names,
            "default_class": "interactive",
        }
        if draw(st.booleans()):
            entry["cache_scope"] = "team"
        tenants.append(entry)
    backends = []
    for b in range(draw(st.integers(1, 4))):
        served = draw(st.lists(st.sampled_from(MODELS), min_size=1, max_size=3, unique=True))
        entry = {"name": f"b{b}", "url": "http://127.0.0.1:9", "kind": draw(st.sampled_from(KINDS)), "models": served}
        if draw(st.integers(0, 3)) == 0:
            entry["tenants"] = draw(st.lists(st.sampled_from(tenant_names), min_size=1, unique=True))
        backends.append(entry)
    unserved = [m for m in MODELS if not any(m in b["models"] for b in backends)]
    if unserved:  # every model needs a backend to load: one more, of a drawn kind, for the rest
        backends.append(
            {"name": "rest", "url": "http://127.0.0.1:9", "kind": draw(st.sampled_from(KINDS)), "models": unserved}
        )
    document = {
        "version": "property",
        "classes": {"interactive": {"rank": 0, "slo": SLO}, "batch": {"rank": 1, "slo": SLO}},
        "models": [{"name": m} for m in MODELS],
        "model_groups": drawn_groups,
        "backends": backends,
        "tenants": tenants,
        "cache_scopes": {"team": {}},
        "cache_isolation": {"unsalted": draw(st.sampled_from(["shared", "no_prompt_cache", "dedicated"]))},
    }
    return Drawn(document, by_group)


KINDS = ["vllm", "sglang", "sim", "llamacpp", "openai"]


def reached_models(drawn: Drawn, tenant: dict[str, Any]) -> set[str]:
    """The oracle: every served model a request of ``tenant`` may be sent to."""
    internal = set().union(*drawn.groups.values()) if drawn.groups else set()
    names = tenant["models"]
    if "*" in names:
        names = [*drawn.groups, *(m for m in MODELS if m not in internal)]
    out: set[str] = set()
    for name in names:
        out |= drawn.groups.get(name, {name})
    return out


def reaching(drawn: Drawn, backend: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The oracle: the tenants that reach ``backend``."""
    for tenant in drawn.document["tenants"]:
        allowed = backend.get("tenants") is None or tenant["name"] in backend["tenants"]
        if allowed and reached_models(drawn, tenant) & set(backend["models"]):
            yield tenant


def scope(tenant: dict[str, Any]) -> str:
    return f"scope:{tenant['cache_scope']}" if "cache_scope" in tenant else f"tenant:{tenant['name']}"


def runs_salted(api: Dialect, backend: Backend, tenant: Tenant, snapshot: PolicySnapshot) -> bool:
    """Whether the engine keeps this tenant's request in its own cache scope (module docstring)."""
    decided = attempt_isolation(api, backend, tenant, snapshot, SALTER)
    called = api if decided.translation is None else decided.translation.upstream
    if backend.kind.value in SALTED_KINDS:
        return "cache_salt" in decided.fields and called.name in READS_SALT
    if backend.kind.value == "llamacpp":
        return decided.fields.get("cache_prompt") is False
    return False


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policies())
def test_no_backend_two_scopes_reach_runs_a_request_unsalted(drawn: Drawn) -> None:
    try:
        snapshot = parse_policy(yaml.safe_dump(drawn.document, sort_keys=False), "generated.yaml")
    except PolicyError:
        event("refused at load")
        return  # refused at load: nothing is ever sent
    multi_scope = set()
    tenants = {t.name: t for t in snapshot.policy.tenants}
    for entry in drawn.document["backends"]:
        reach = list(reaching(drawn, entry))
        if len({scope(t) for t in reach}) < 2:
            continue
        multi_scope.add(entry["name"])
        backend = next(b for b in snapshot.policy.backends if b.name == entry["name"])
        for tenant in reach:
            for api in APIS:
                if not api.serves(backend.kind) or runs_salted(api, backend, tenants[tenant["name"]], snapshot):
                    event(f"{api.name} reaches a backend of several scopes salted")
                    continue
                mode = drawn.document["cache_isolation"]["unsalted"]
                assert mode == "shared", f"{api.name} from {tenant['name']} runs unsalted on {backend.name}"
                assert any(f"'{backend.name}'" in warning for warning in snapshot.warnings), snapshot.warnings
                event(f"{api.name} runs unsalted where the policy says shared")
    assert snapshot.multi_scope_backends == multi_scope
