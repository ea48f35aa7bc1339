"""The checks of a policy that need what only the stages above ``policy`` know, passed in.

Why: ``policy`` sits near the bottom of the stages (every stage reads the parsed policy), yet
three checks of a policy file need registries and rules that live higher up: the routing
strategies and scorers a model's ``routing`` may name (``gateway/routing/registry.py``), the
shadow quality scorers a group's ``shadow.scorer`` may name (``gateway/shadow/scorers.py``), and
who reaches each backend and whether its engine keeps their cache scopes apart
(``gateway/routing/isolation.py``). The loader takes them as one ``PolicyChecks`` whose every
slot is required, so that a policy cannot be loaded with a check left out; the composition root
binds them once (``gateway/service.py``: ``POLICY_LOADER``, ``load_policy``, ``parse_policy``), and
every entry point (serve, workers, ``policy validate`` and ``explain``, reloads, tests, benches)
loads through it.

Each check answers with paths relative to where the loader asks (``strategy: ...`` for a model's
``routing``, ``models[0].routing.`` put before it by the loader), or from the top of the policy
(``backends[3].tenants[1]: ...``); the loader places every problem in the file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gateway.policy.model import Policy, Routing


@dataclass(frozen=True, slots=True)
class IsolationReport:
    """What the isolation check found: ``problems`` refuse the policy, ``warnings`` are logged, and
    ``multi_scope_backends`` (the backends tenants of several cache scopes reach, by any path) is
    kept on the snapshot for the request path (``PolicySnapshot.multi_scope_backends``)."""

    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    multi_scope_backends: frozenset[str] = frozenset()


RoutingCheck = Callable[[Routing], Iterable[str]]
"""A model's ``routing`` section to its problems, each ``<field>: <problem>`` relative to the section."""
ScorerCheck = Callable[[str], Iterable[str]]
"""A shadow quality scorer's name to what is wrong with a policy naming it (nothing when it is known)."""
IsolationCheck = Callable[[Policy], IsolationReport]
"""A whole policy to its tenants' isolation on every backend (paths from the top of the policy)."""


@dataclass(frozen=True, slots=True)
class PolicyChecks:
    """Every check of a policy the loader cannot make by itself (module docstring); bound once, by
    the composition root (``gateway/service.py``), each slot to its stage's function."""

    routing: RoutingCheck
    shadow_scorer: ScorerCheck
    isolation: IsolationCheck
