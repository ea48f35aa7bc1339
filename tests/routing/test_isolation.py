"""Backend isolation (``gateway/routing/isolation.py``): the gateway sets ``cache_salt`` per tenant
scope, overwriting the client's; unsalted engines shared across cache scopes warn or are refused at
load; and over generated policies no request runs unsalted where two scopes meet.

Load-time isolation checks: each case is a policy with four tenants (``acme`` and ``globex``
private, ``shared-a`` and ``shared-b`` in the scope ``public-bot``) and the backends and
``cache_isolation.unsalted`` it names; the loader must give exactly the problems (refused) or the
warnings (loaded) listed.

The property, over generated policies: no backend that tenants of two cache scopes can reach
ever receives a request its engine runs unsalted, whatever the API (chat, completions, Responses,
Messages) and whether the request is a client's own attempt or a model group's shadow copy.

Hypothesis draws policies of a few tenants (private, or two in a shared scope; naming models,
groups, or ``"*"``), plain models, model groups (targets, fallbacks, class fallbacks, a shadow)
and backends of every kind (some with a ``tenants:`` list), under each ``cache_isolation.unsalted``
mode. For every policy that loads, the test works out who reaches each backend on its own (the
oracle below, written from the policy's documented meaning, not from ``gateway/routing/reach.py``),
then asks the decision every attempt and every shadow copy goes through
(``attempt_isolation``, ``gateway/upstream/body.py``) what each tenant's request of each API would carry to each
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

import hashlib
import hmac
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.dialects.base import Dialect
from gateway.dialects.chat import CHAT
from gateway.dialects.completions import COMPLETIONS
from gateway.dialects.messages import MESSAGES
from gateway.dialects.responses import RESPONSES
from gateway.policy.loader import PolicyError
from gateway.policy.model import Backend, BackendKind, Tenant, UnsaltedMode
from gateway.policy.snapshot import PolicySnapshot
from gateway.request.keys import hash_api_key
from gateway.routing.isolation import CacheSalter, isolation_fields
from gateway.service import parse_policy
from gateway.upstream.body import attempt_isolation
from tests.conftest import KEY_ACME, KEY_GLOBEX, BackendServer, StartGateway
from tests.fake_backend import FakeBackend
from tests.policy_builder import NOWHERE, OMIT, build_policy, model, session_policy
from tests.policy_builder import backend as backend_entry
from tests.policy_builder import tenant as tenant_entry
from tests.routing.conftest import PUBLIC_BOT, SCOPED_TENANTS

# Salts set per tenant scope


SECRET = "test-salt-secret"


def expected_salt(scope: str) -> str:
    return hmac.new(SECRET.encode(), scope.encode(), hashlib.sha256).hexdigest()[:32]


def send(url: str, key: str, **fields: object) -> None:
    body = {"model": "test/chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text


@pytest.fixture
def salted_gateway(
    start_gateway: StartGateway, backend: FakeBackend, backend_server: BackendServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    monkeypatch.setenv("GATEWAY_CACHE_SALT_SECRET", SECRET)
    with start_gateway(session_policy(backend_server.url), health_checks=False) as url:
        yield url


@pytest.mark.parametrize(
    ("key", "scope", "client_salt"),
    [
        pytest.param(KEY_ACME, "tenant:acme", None, id="a tenant's requests carry its salt"),
        pytest.param(KEY_GLOBEX, "tenant:globex", None, id="another tenant's carry another salt"),
        pytest.param(KEY_ACME, "tenant:acme", "globex-guess", id="a client's own cache_salt is overwritten"),
    ],
)
def test_vllm_backends_get_the_hmac_of_the_tenants_scope_as_cache_salt(
    salted_gateway: str, backend: FakeBackend, key: str, scope: str, client_salt: str | None
) -> None:
    extra = {"cache_salt": client_salt} if client_salt else {}
    send(salted_gateway, key, **extra)
    assert backend.received[-1].body["cache_salt"] == expected_salt(scope)


ACME_SALT = expected_salt("tenant:acme")
DEDICATED = {"tenants": ["acme"]}


@pytest.mark.parametrize(
    ("kind", "unsalted", "client_fields", "forwarded"),
    [
        pytest.param("sglang", "shared", {}, {"cache_salt": ACME_SALT}, id="sglang backends get the salt as vllm's do"),
        pytest.param(
            "sglang",
            "shared",
            {"cache_salt": "globex-guess"},
            {"cache_salt": ACME_SALT},
            id="an sglang client's own cache_salt is overwritten",
        ),
        pytest.param("sim", "shared", {}, {"cache_salt": ACME_SALT}, id="simulated engines get the salt"),
        pytest.param(
            "vllm",
            "no_prompt_cache",
            {"cache_prompt": True},
            {"cache_salt": ACME_SALT, "cache_prompt": None},
            id="salted backends are left their cache under no_prompt_cache, the client's cache_prompt stripped",
        ),
        pytest.param(
            "llamacpp",
            "no_prompt_cache",
            {"cache_prompt": True},
            {"cache_salt": None, "cache_prompt": False},
            id="llamacpp backends get cache_prompt false under no_prompt_cache, the client's true overwritten",
        ),
        pytest.param(
            "llamacpp",
            "no_prompt_cache",
            {},
            {"cache_salt": None, "cache_prompt": False},
            id="llamacpp backends get cache_prompt false when the client says nothing",
        ),
        pytest.param(
            "llamacpp",
            "shared",
            {"cache_prompt": True},
            {"cache_salt": None, "cache_prompt": None},
            id="llamacpp backends under shared get no cache_prompt: it is the gateway's field",
        ),
        pytest.param(
            "llamacpp",
            "dedicated",
            {},
            {"cache_salt": None, "cache_prompt": None},
            id="a dedicated llamacpp backend keeps its cache, since one scope reaches it",
        ),
        pytest.param(
            "openai", "shared", {}, {"cache_salt": None, "cache_prompt": None}, id="openai backends get neither field"
        ),
    ],
)
def test_each_backend_kind_gets_the_isolation_fields_of_the_policys_mode(
    start_gateway: StartGateway,
    backend: FakeBackend,
    backend_server: BackendServer,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    unsalted: str,
    client_fields: dict[str, object],
    forwarded: dict[str, object],
) -> None:
    monkeypatch.setenv("GATEWAY_CACHE_SALT_SECRET", SECRET)
    served = DEDICATED if unsalted == "dedicated" else {}
    text = session_policy(
        backend_server.url, backends={"fake": {"kind": kind, **served}}, cache_isolation={"unsalted": unsalted}
    )
    with (
        start_gateway(text, health_checks=False) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=0, timeout=10) as client,
    ):
        client.chat.completions.create(
            model="test/chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, extra_body=client_fields
        )
    (received,) = backend.received
    assert {field: received.body.get(field) for field in forwarded} == forwarded


def test_without_a_secret_each_process_draws_its_own_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.routing.isolation"):
        one, two = CacheSalter.from_env("NOPE", environ={}), CacheSalter.from_env("NOPE", environ={})
    assert one.salt("tenant:a") != two.salt("tenant:a")
    assert not one.shared
    assert "replicas will not share" in caplog.text


def test_a_shared_secret_gives_every_replica_the_same_salts() -> None:
    one = CacheSalter.from_env("S", environ={"S": SECRET})
    two = CacheSalter.from_env("S", environ={"S": SECRET})
    assert one.salt("tenant:a") == two.salt("tenant:a") == expected_salt("tenant:a")
    assert one.salt("tenant:a") != one.salt("tenant:b")


SALT = {"cache_salt": ACME_SALT}
NO_REUSE = {"cache_prompt": False}


@pytest.mark.parametrize(
    ("kind", "fields"),
    [
        pytest.param(kind, {mode: fields[i] for i, mode in enumerate(UnsaltedMode)}, id=f"{kind.value}: {label}")
        for kind, fields, label in [
            (BackendKind.VLLM, (SALT, SALT, SALT), "salted whatever the mode"),
            (BackendKind.SGLANG, (SALT, SALT, SALT), "salted whatever the mode"),
            (BackendKind.SIM, (SALT, SALT, SALT), "salted whatever the mode"),
            (BackendKind.LLAMACPP, ({}, NO_REUSE, {}), "no prompt reuse under no_prompt_cache only"),
            (BackendKind.OPENAI, ({}, {}, {}), "nothing to set in any mode"),
        ]
    ],
)
def test_isolation_fields_by_kind_and_mode(kind: BackendKind, fields: dict[UnsaltedMode, dict[str, object]]) -> None:
    acme = parse_policy(session_policy(), "t.yaml").policy.tenants[0]
    salter = CacheSalter(SECRET.encode())
    assert {mode: dict(isolation_fields(kind, mode, salter, acme)) for mode in UnsaltedMode} == fields


# Load-time isolation checks: unsalted engines shared across cache scopes warn or are refused


SOURCE = "policies/prod.yaml"
WARNING_AT = re.compile(rf"^{re.escape(SOURCE)}:\d+:\d+: warning: ")
"""How each warning begins: the file, the line and column of the entry it is about."""


def backend(name: str, kind: str, tenants: list[str] | None = None, models: list[str] | None = None) -> dict[str, Any]:
    served = {} if tenants is None else {"tenants": tenants}
    return backend_entry(name, NOWHERE, models or ["m"], kind=kind, **served)


def policy(
    *backends: dict[str, Any], unsalted: str = "shared", globex_models: list[str] | None = None, **sections: Any
) -> str:
    """Models ``m`` and ``m2`` on ``backends``, the routing tests' four tenants (``globex`` allowed
    ``globex_models``, else every model) and ``cache_isolation.unsalted``; ``sections`` edit it."""
    isolation = {
        "version": "t",
        "classes": {"batch": OMIT},
        "models": [model("m"), model("m2")],
        "backends": list(backends),
        "cache_scopes": PUBLIC_BOT,
        "cache_isolation": {"unsalted": unsalted},
        "tenants": SCOPED_TENANTS,
    }
    globex = {"tenants": {"globex": {"models": globex_models or ["*"]}}}
    return build_policy(NOWHERE, isolation, globex, **sections)


M2 = backend("vllm-m2", "vllm", models=["m2"])
"""Serves model m2 to everyone, so that the cases about m are not about m2 too."""

EVERYONE = "'acme', 'globex', 'shared-a' (scope 'public-bot'), 'shared-b' (scope 'public-bot')"

REFUSED = [
    pytest.param(
        policy(backend("llama-a", "llamacpp"), M2, unsalted="dedicated"),
        [
            f"backends[llama-a]: 'llama-a' (llamacpp) is not salted (cache_isolation.unsalted: dedicated) and serves "
            f"tenants of different cache scopes: {EVERYONE}; list in its tenants: the tenants it serves, all of "
            "one cache scope"
        ],
        id="dedicated refuses an unsalted backend that lists no tenants and every tenant reaches",
    ),
    pytest.param(
        policy(backend("llama-a", "llamacpp", ["acme", "shared-a", "globex"]), M2, unsalted="dedicated"),
        [
            "backends[llama-a].tenants[1]: tenant 'shared-a' shares unsalted backend 'llama-a' with 'acme' "
            "(another cache scope; cache_isolation.unsalted is dedicated)",
            "backends[llama-a].tenants[2]: tenant 'globex' shares unsalted backend 'llama-a' with 'acme' "
            "(another cache scope; cache_isolation.unsalted is dedicated)",
        ],
        id="dedicated names each listed tenant of another scope than the first",
    ),
    pytest.param(
        policy(backend("gpt", "openai", ["acme", "globex"]), backend("llama-a", "llamacpp"), M2, unsalted="dedicated"),
        [
            "backends[gpt].tenants[1]: tenant 'globex' shares unsalted backend 'gpt' with 'acme' "
            "(another cache scope; cache_isolation.unsalted is dedicated)",
            f"backends[llama-a]: 'llama-a' (llamacpp) is not salted (cache_isolation.unsalted: dedicated) and serves "
            f"tenants of different cache scopes: {EVERYONE}; list in its tenants: the tenants it serves, all of "
            "one cache scope",
        ],
        id="dedicated holds openai backends to the same rule and reports every backend at once",
    ),
    pytest.param(
        policy(backend("gpt", "openai"), backend("llama-a", "llamacpp"), M2, unsalted="no_prompt_cache"),
        [
            "backends[gpt]: 'gpt' (openai) has no switch to turn prompt caching off (cache_isolation.unsalted: "
            f"no_prompt_cache) and serves tenants of different cache scopes: {EVERYONE}; give it tenants: of "
            "one cache scope, or set cache_isolation.unsalted: dedicated"
        ],
        id="no_prompt_cache refuses a shared openai backend, which has no such switch, and only it",
    ),
    pytest.param(
        policy(backend("llama-a", "llamacpp", ["acme", "initech"]), M2),
        ["backends[llama-a].tenants[1]: unknown tenant 'initech'"],
        id="a backend listing an undeclared tenant is refused",
    ),
    pytest.param(
        policy(backend("llama-a", "llamacpp", []), M2),
        ["backends[llama-a].tenants: must have at least 1 item after validation, not 0"],
        id="a backend listing no tenant at all is refused rather than never used",
    ),
]


@pytest.mark.parametrize(("text", "problems"), REFUSED)
def test_a_policy_that_would_share_an_unsalted_cache_is_refused_with_paths(text: str, problems: list[str]) -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, SOURCE)
    assert caught.value.problems == problems


LOADED = [
    pytest.param(
        policy(backend("llama-a", "llamacpp"), M2),
        [
            f"backends[llama-a]: 'llama-a' (llamacpp) cannot salt its prefix cache and serves tenants of different "
            f"cache scopes: {EVERYONE}; each can time whether another sent a prompt (cache_isolation.unsalted is "
            "shared; set it to no_prompt_cache or dedicated, or give the backend tenants: of one scope)"
        ],
        id="shared, the default, warns about a llamacpp backend that every tenant reaches",
    ),
    pytest.param(
        policy(backend("gpt", "openai", ["acme", "globex"]), backend("vllm-m", "vllm"), M2),
        [
            "backends[gpt]: 'gpt' (openai) cannot salt its prefix cache and serves tenants of different cache "
            "scopes: 'acme', 'globex'; each can time whether another sent a prompt (cache_isolation.unsalted is "
            "shared; set it to dedicated, or give the backend tenants: of one scope)"
        ],
        id="shared names only the tenants a backend serves, and offers openai only the remedy it has",
    ),
    pytest.param(
        policy(backend("llama-a", "llamacpp", ["shared-a", "shared-b"]), backend("vllm-m", "vllm"), M2),
        [],
        id="tenants of one shared scope may share an unsalted backend without a warning",
    ),
    pytest.param(
        policy(backend("llama-a", "llamacpp"), M2, unsalted="no_prompt_cache"),
        [],
        id="no_prompt_cache isolates a shared llamacpp backend",
    ),
    pytest.param(
        policy(
            backend("llama-a", "llamacpp", ["acme"]),
            backend("llama-b", "llamacpp", ["globex"]),
            backend("gpt", "openai", ["shared-b", "shared-a"]),
            M2,
            unsalted="dedicated",
        ),
        [],
        id="dedicated loads when each unsalted backend serves one cache scope",
    ),
    pytest.param(
        policy(backend("vllm-a", "vllm"), backend("sglang-a", "sglang"), backend("sim-a", "sim"), M2),
        [],
        id="salted backends are shared without a warning",
    ),
    pytest.param(
        policy(
            backend("llama-a", "llamacpp", ["acme"]),
            backend("llama-b", "llamacpp", ["acme"], models=["m2"]),
            unsalted="dedicated",
        ),
        [
            f"tenants[{name}]: tenant '{name}' may use model '{model}' but none of its backends serves this tenant "
            "(their tenants: lists leave it out); its requests for it get 503 no_backend_for_tenant"
            for name in ["globex", "shared-a", "shared-b"]
            for model in ["m", "m2"]
        ],
        id="a tenant allowed a model that no backend serves to it is warned about",
    ),
    pytest.param(
        policy(
            backend("vllm-a", "vllm"),
            backend("vllm-m2", "vllm", ["globex", "acme", "shared-a", "shared-b"], models=["m2"]),
            globex_models=["m"],
        ),
        ["backends[vllm-m2].tenants[0]: tenant 'globex' may use none of this backend's models"],
        id="a backend listing a tenant that may use none of its models is warned about",
    ),
]


@pytest.mark.parametrize(("text", "warnings"), LOADED)
def test_a_policy_loads_with_the_isolation_warnings_it_deserves(text: str, warnings: list[str]) -> None:
    loaded = parse_policy(text, SOURCE).warnings
    assert all(WARNING_AT.match(warning) for warning in loaded), loaded
    assert [WARNING_AT.sub("", warning, count=1) for warning in loaded] == warnings


def test_a_long_list_of_tenants_is_cut_in_the_warning() -> None:
    more = {f"t{i}": tenant_entry(f"t{i}", f"k{i}") for i in range(14)}
    text = policy(backend("llama-a", "llamacpp"), M2, tenants=more)
    (warning,) = parse_policy(text, SOURCE).warnings
    assert "'t4', 't5' and 8 more; each can time" in warning


# The property, over generated policies: no request runs unsalted where two cache scopes meet


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
