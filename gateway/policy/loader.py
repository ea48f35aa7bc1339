"""Load a policy file into a frozen ``PolicySnapshot``, or explain exactly why not, and where.

Loading is four steps: reading the YAML strictly (a key written twice in one mapping is
refused, never resolved by "the last one wins": ``gateway/policy/yaml_source.py``); validation
against ``policy.model.Policy`` (types, ranges, unknown keys); cross-checks between sections
(names unique, every model served by a backend, every tenant's models and class declared, no
key both a tenant's and an admin's); and the checks that need the stages above ``policy``,
passed in as one ``PolicyChecks`` (``gateway/policy/checks.py``: the routing and shadow scorer
names, tenants of different cache scopes kept apart on unsalted engines). Every problem is
reported at once, each on a line of its own with the file, the line and column, and the path
with entries by name (``gateway/policy/problems.py``), e.g.::

    policies/prod.yaml:41:7: tenants[acme].limits.rpm: must be greater than 0
    policies/prod.yaml:38:5: tenants[acme].limts: unknown key; did you mean 'limits'?

What is allowed but probably not meant (an unsalted engine shared by tenants of different cache
scopes, a tenant left without a backend for a model it may use) is kept in the snapshot's
``warnings``, each a line of the same form with ``warning:`` before the path: logged at start
and at each reload, printed by ``policy validate``. The checks themselves write paths by index
(``backends[3].tenants[1]: ...``); the loader translates every such message the same way.

The snapshot (``gateway/policy/snapshot.py``) holds the indexes the hot path needs (key hash
to tenant, model to backends), built once here so that a request never scans a list.

Usage (every entry point loads through the composition root's loader, which has every check)::

    from gateway.service import load_policy, parse_policy
    snapshot = load_policy("policies/prod.yaml")           # PolicyError lists every problem
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from gateway.policy.checks import PolicyChecks
from gateway.policy.model import Policy
from gateway.policy.paths import PolicyTree, position
from gateway.policy.problems import Problem, from_duplicate, from_validation, from_yaml_error, located
from gateway.policy.snapshot import PolicySnapshot, content_digest, index_policy
from gateway.policy.yaml_source import YamlDocument, read_yaml


class PolicyError(Exception):
    """The policy file is invalid; ``problems`` lists every reason as ``<path>: <problem>``, and
    ``details`` the same with their line and column (``str()`` shows those, one line each)."""

    def __init__(self, source: str, problems: Sequence[str | Problem]) -> None:
        self.source = source
        self.details = tuple(p if isinstance(p, Problem) else Problem("", p) for p in problems)
        self.problems = [str(problem) for problem in self.details]
        super().__init__("\n".join(problem.render(source) for problem in self.details))


@dataclass(frozen=True, slots=True)
class PolicyLoader:
    """Loads policy files with ``checks``, every one of them, on every load (module docstring)."""

    checks: PolicyChecks

    def load(self, path: str | Path) -> PolicySnapshot:
        """Read, validate and index a policy file; raise ``PolicyError`` listing every problem."""
        source = str(path)
        try:
            text = Path(path).read_bytes()
        except OSError as exc:
            raise PolicyError(source, [f"cannot read: {exc.strerror or exc}"]) from exc
        return self.parse(text, source)

    def parse(self, text: bytes | str, source: str) -> PolicySnapshot:
        """Like ``load`` for text already in memory (tests, admin reloads); ``source`` names it in
        every message, as a file name would."""
        document, tree = _read(text, source)
        try:
            policy = Policy.model_validate(document.data)
        except ValidationError as exc:
            raise PolicyError(source, [from_validation(error, tree, Policy) for error in exc.errors()]) from exc
        isolation = self.checks.isolation(policy)
        problems = [*_cross_check(policy, self.checks), *isolation.problems]
        if problems:
            raise PolicyError(source, [located(problem, tree) for problem in problems])
        warnings = tuple(located(warning, tree).render(source, "warning: ") for warning in isolation.warnings)
        raw_bytes = text.encode() if isinstance(text, str) else text
        return index_policy(
            policy, source, content_digest(raw_bytes), self.checks, warnings, isolation.multi_scope_backends
        )


def _read(text: bytes | str, source: str) -> tuple[YamlDocument, PolicyTree]:
    """The YAML document (a mapping, no key twice) and its node tree, or the reasons why not."""
    try:
        document = read_yaml(text)
    except yaml.YAMLError as exc:
        raise PolicyError(source, [from_yaml_error(exc)]) from exc
    tree = PolicyTree(document.root)
    if document.duplicates:
        found = sorted((from_duplicate(d, tree) for d in document.duplicates), key=lambda p: (p.line, p.column))
        raise PolicyError(source, found)
    if not isinstance(document.data, dict):
        raise PolicyError(source, [Problem("", "the top level must be a mapping", *position(document.root))])
    return document, tree


def _cross_check(policy: Policy, checks: PolicyChecks) -> Iterable[str]:
    yield from _unique("models", [m.name for m in policy.models])
    yield from _unique("backends", [b.name for b in policy.backends])
    yield from _unique("tenants", [t.name for t in policy.tenants])
    model_names = {m.name for m in policy.models}
    served: set[str] = set()
    for i, backend in enumerate(policy.backends):
        for j, model in enumerate(backend.models):
            if model not in model_names:
                yield f"backends[{i}].models[{j}]: unknown model '{model}' (declare it under models)"
            served.add(model)
    for i, model_policy in enumerate(policy.models):
        if model_policy.name not in served:
            yield f"models[{i}]: no backend serves '{model_policy.name}'"
        default = model_policy.default_max_tokens
        if default is not None and default > model_policy.max_output_tokens:
            yield f"models[{i}].default_max_tokens: must not exceed max_output_tokens"
        for problem in checks.routing(model_policy.routing):
            yield f"models[{i}].routing.{problem}"
    yield from _check_groups(policy, model_names, checks)
    groups = {g.name for g in policy.model_groups}
    internal = internal_models(policy)
    owners: dict[str, str] = {}
    for i, tenant in enumerate(policy.tenants):
        if tenant.default_class not in policy.classes:
            yield f"tenants[{i}].default_class: unknown class '{tenant.default_class}'"
        for j, model in enumerate(tenant.models):
            if model in internal:
                yield (
                    f"tenants[{i}].models[{j}]: '{model}' serves model group '{internal[model]}' "
                    "and cannot be called by name; name the group"
                )
            elif model != "*" and model not in model_names and model not in groups:
                yield f"tenants[{i}].models[{j}]: unknown model '{model}'"
        if tenant.cache_scope is not None and tenant.cache_scope not in policy.cache_scopes:
            scope = tenant.cache_scope
            yield f"tenants[{i}].cache_scope: unknown cache scope '{scope}' (declare it under cache_scopes)"
        for j, key_hash in enumerate(tenant.key_hashes):
            if owners.setdefault(key_hash, tenant.name) != tenant.name:
                yield f"tenants[{i}].key_hashes[{j}]: already a key of tenant '{owners[key_hash]}'"
    for j, key_hash in enumerate(policy.admin.key_hashes):
        if key_hash in owners:  # that tenant's clients would hold the keys to /admin
            yield f"admin.key_hashes[{j}]: already a key of tenant '{owners[key_hash]}' (admin keys must be separate)"


def internal_models(policy: Policy) -> dict[str, str]:
    """Every model some group sends traffic to, with the (first) group's name: not callable by name."""
    out: dict[str, str] = {}
    for group in policy.model_groups:
        for model in sorted(group.members()):
            out.setdefault(model, group.name)
    return out


def _check_groups(policy: Policy, model_names: set[str], checks: PolicyChecks) -> Iterable[str]:
    yield from _unique("model_groups", [g.name for g in policy.model_groups])
    for i, group in enumerate(policy.model_groups):
        where = f"model_groups[{i}]"
        if group.name in model_names:
            yield f"{where}.name: '{group.name}' is also a model under models (a public name is one or the other)"
        named = [(f"targets[{j}].model", t.model) for j, t in enumerate(group.targets)]
        named += [(f"fallbacks[{j}]", m) for j, m in enumerate(group.fallbacks)]
        for class_name, chain in group.class_fallbacks.items():
            if class_name not in policy.classes:
                yield f"{where}.class_fallbacks.{class_name}: unknown class '{class_name}'"
            named += [(f"class_fallbacks.{class_name}[{j}]", m) for j, m in enumerate(chain)]
        if group.shadow is not None:
            named.append(("shadow.model", group.shadow.model))
            if group.shadow.scorer is not None:
                for problem in checks.shadow_scorer(group.shadow.scorer):
                    yield f"{where}.shadow.scorer: {problem}"
            if group.shadow.model in {t.model for t in group.targets}:
                yield f"{where}.shadow.model: '{group.shadow.model}' is a target already (it would shadow itself)"
        for path, model in named:
            if model not in model_names:
                yield f"{where}.{path}: unknown model '{model}' (declare it under models)"


def _unique(section: str, names: list[str]) -> Iterable[str]:
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            yield f"{section}[{i}].name: duplicate name '{name}'"
        seen.add(name)
