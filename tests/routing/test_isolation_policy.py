"""Load-time isolation checks: unsalted engines shared across cache scopes warn or are refused.

Each case is a policy with four tenants (``acme`` and ``globex`` private, ``shared-a`` and
``shared-b`` in the scope ``public-bot``) and the backends and ``cache_isolation.unsalted`` it
names; the loader must give exactly the problems (refused) or the warnings (loaded) listed.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from gateway.policy.loader import PolicyError
from gateway.service import parse_policy
from tests.policy_builder import NOWHERE, OMIT, build_policy, model
from tests.policy_builder import backend as backend_entry
from tests.policy_builder import tenant as tenant_entry
from tests.routing.conftest import PUBLIC_BOT, SCOPED_TENANTS

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
