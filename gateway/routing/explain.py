"""``policy explain``: what the gateway would do with a request, and why, without sending it.

It runs the request path's own functions (authentication, validation, class resolution, the
room rule, the model's router) against a policy and an optional picture of the backends, and
prints the tenant and its cache scope, the class and queue, every backend's room, scores and
matched prefix blocks, and the backend chosen with its reason code.

The backend-state file (JSON) gives, per backend name, any of ``healthy``, ``in_flight``,
``in_flight_tokens``, ``waiting``, ``kv_usage`` (taken as freshly scraped) and ``served``: a
list of request bodies (same tenant) the backend served recently, which teach the router as
dispatches would::

    {"sim-a": {"in_flight": 3, "served": [{"model": "m", "messages": [...]}]}}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.admission.build import build_request, require_model
from gateway.admission.tenant_limits import resolve_class
from gateway.clock import MonotonicClock
from gateway.dialects.base import Dialect
from gateway.dialects.registry import DIALECTS
from gateway.dispatch.backends import BackendPool, BackendState
from gateway.dispatch.capacity import has_room
from gateway.dispatch.dispatcher import ModelQueues
from gateway.dispatch.router import Router, RoutingDecision
from gateway.errors import InvalidRequest
from gateway.policy.groups import ModelGroup
from gateway.policy.model import Backend, CacheIsolation, ModelPolicy, PriorityClass, Tenant
from gateway.policy.snapshot import PolicySnapshot
from gateway.request.auth import authenticate, authorize_model
from gateway.request.tokens import CharRatioEstimator
from gateway.routing.isolation import CacheSalter, isolation_fields, tenant_scope
from gateway.routing.prefix_secret import PrefixSecret
from gateway.routing.registry import build_routers
from gateway.routing.targets import TargetPicker, explain_group, lookup_public
from gateway.types import InferenceRequest

_EXPLAIN_SALTER = CacheSalter(b"explain: the salt is never shown")
_STATE_FIELDS = {"healthy": bool, "in_flight": int, "in_flight_tokens": int, "waiting": float, "kv_usage": float}


def api_of(body: Mapping[str, Any]) -> Dialect:
    """The API a request body is for: among the registered dialects whose prompt field it has
    (two APIs may share one, ``input``), the first that accepts all its fields, else the first."""
    candidates = [dialect for dialect in DIALECTS.values() if dialect.prompt_field in body]
    if not candidates:
        named = ", ".join(f"'{d.prompt_field}' ({d.name})" for d in DIALECTS.values())
        raise InvalidRequest(f"The request has no prompt: none of {named}.")
    return next((dialect for dialect in candidates if body.keys() <= dialect.fields), candidates[0])


def explain(
    snapshot: PolicySnapshot,
    api_key: str,
    body: dict[str, Any],
    backend_state: Mapping[str, Any] | None = None,
    *,
    priority: str | None = None,
    session_id: str | None = None,
    rollouts: Mapping[str, tuple[float, str]] | None = None,
) -> list[str]:
    """The explanation, line by line; raises ``GatewayError`` where the gateway would refuse.

    ``rollouts`` gives, per group with a rollout, its candidate's percent now and a description
    of its state (read from the rollout store by the caller)."""
    clock = MonotonicClock()
    body = dict(body)  # validation names the served model in it: the caller's stays as it was
    tenant = authenticate(b"Bearer " + api_key.strip().encode(), snapshot)
    class_name, priority_class = resolve_class(tenant, priority.encode() if priority else None, snapshot)
    group_lines, target = _target(snapshot, tenant, body, class_name, rollouts or {})
    request = _request(snapshot, tenant, body, session_id, target)
    model = request.model
    secret = PrefixSecret.from_env(snapshot.policy.cache_isolation.secret_env)  # the gateway's tie-breaks when set
    router = build_routers(snapshot, clock, secret)[model]
    pool = BackendPool(snapshot)
    now = clock.now()
    _apply_state(pool, router, snapshot, tenant, backend_state or {}, now, session_id, snapshot.models[model])
    fresh_s = snapshot.policy.scrape.fresh_s
    tokens = request.prompt_tokens + request.max_tokens
    states = pool.for_model(model)
    mine = pool.lane(model, tenant.name).states
    roomy = [s for s in mine if has_room(s, priority_class, tokens, now, fresh_s)]
    routing = snapshot.models[model].routing
    lines = [
        f"tenant:  {tenant.name} (cache scope {tenant_scope(tenant)})",
        *group_lines,
        f"request: {request.api.name} for model '{model}', about {request.prompt_tokens} prompt tokens "
        f"(estimated), max_tokens {request.max_tokens}",
        f"class:   {class_name} (rank {priority_class.rank}); queue: model '{model}' class '{class_name}' "
        f"(max depth {priority_class.queue.max_depth}, max wait {_wait_budget(priority_class)})",
        f"routing: {routing.strategy} (block {routing.block_tokens} tokens, epsilon {routing.epsilon:g})",
    ]
    if not mine:
        return [
            *lines,
            "no backend of the model serves this tenant: the request would be refused: 503 no_backend_for_tenant",
            *_room_lines(states, roomy, mine),
        ]
    if not roomy:
        verdict = "wait in its queue" if any(s.healthy for s in mine) else "be refused: 503 no_healthy_backend"
        return [*lines, f"no backend has room: the request would {verdict}", *_room_lines(states, roomy, mine)]
    decision = router.pick(request, tenant, roomy)
    lines.append("dispatch: at once (fast path: an empty gateway queues nothing)")
    lines += _score_lines(states, roomy, mine, decision)
    chosen = decision.state
    lines.append(f"chosen:  {chosen.name} ({decision.reason}; {decision.matched_blocks} prefix blocks expected cached)")
    return [*lines, _isolation_line(chosen.backend, snapshot.policy.cache_isolation, tenant)]


def _isolation_line(backend: Backend, isolation: CacheIsolation, tenant: Tenant) -> str:
    """What keeps the tenant's prompts out of other tenants' reach on ``backend`` (``routing/isolation.py``)."""
    kind, mode = backend.kind.value, isolation.unsalted.value
    fields = isolation_fields(backend.kind, isolation.unsalted, _EXPLAIN_SALTER, tenant)
    if "cache_salt" in fields:
        return (
            f"cache_salt: set to HMAC-SHA256(secret, '{tenant_scope(tenant)}') for this {kind} "
            "backend; a client's own cache_salt is overwritten"
        )
    if fields.get("cache_prompt") is False:
        return (
            f"cache_salt: not set ({kind} backends do not read it); cache_prompt: set to false "
            f"(cache_isolation.unsalted: {mode}): the engine reuses no cached prompt, whoever sent it"
        )
    served = f"tenants {', '.join(backend.tenants)}" if backend.tenants else "every tenant allowed the model"
    return (
        f"cache_salt: not set ({kind} backends do not read it); its prefix cache is shared by the tenants it "
        f"serves: {served} (cache_isolation.unsalted: {mode})"
    )


def _target(
    snapshot: PolicySnapshot,
    tenant: Tenant,
    body: dict[str, Any],
    class_name: str,
    rollouts: Mapping[str, tuple[float, str]],
) -> tuple[list[str], ModelPolicy]:
    """The served model the request is explained on, and the lines saying how a group chose it."""
    public = lookup_public(snapshot, require_model(body))
    if not isinstance(public, ModelGroup):
        return [], public
    authorize_model(tenant, public.name, snapshot)
    rollout = rollouts.get(public.name)
    picker = TargetPicker(candidate_share=lambda group: rollout[0] if rollout else None)
    weights = picker.weights(public)
    likeliest, lines = explain_group(snapshot, public, weights, tenant, class_name, rollout[1] if rollout else None)
    return lines, snapshot.models[likeliest]


def _request(
    snapshot: PolicySnapshot,
    tenant: Tenant,
    body: dict[str, Any],
    session_id: str | None,
    target: ModelPolicy | None = None,
) -> InferenceRequest:
    model = require_model(body)
    if target is None:
        public = lookup_public(snapshot, model)
        authorize_model(tenant, model, snapshot)
        assert isinstance(public, ModelPolicy)
        target = public
    model_policy = target
    request = build_request(
        api=api_of(body),
        body=body,
        raw_body=b"",
        request_id="explain",
        arrival=0.0,
        model_policy=model_policy,
        limits=snapshot.policy.limits,
        estimator=CharRatioEstimator(),
    )
    request.session_id = session_id
    return request


def _apply_state(
    pool: BackendPool,
    router: Router,
    snapshot: PolicySnapshot,
    tenant: Tenant,
    given: Mapping[str, Any],
    now: float,
    session_id: str | None,
    router_target: ModelPolicy,
) -> None:
    states = {s.name: s for s in pool.all()}
    for name, fields in given.items():
        state = states.get(name)
        if state is None or not isinstance(fields, dict):
            raise InvalidRequest(f"backend state: '{name}' is not a backend of the policy, or not an object")
        for key, value in fields.items():
            if key == "served":
                for body in value:
                    served = _request(snapshot, tenant, dict(body), session_id, router_target)
                    router.on_dispatch(served, tenant, router.pick(served, tenant, [state]))
            elif key in _STATE_FIELDS:
                setattr(state, key, _STATE_FIELDS[key](value))
            else:
                raise InvalidRequest(f"backend state: {name}.{key}: unknown field")
        state.scraped_at = now


def _room_lines(
    states: tuple[BackendState, ...], roomy: list[BackendState], mine: tuple[BackendState, ...]
) -> list[str]:
    return [f"  {s.name}: {_room(s, roomy, mine)}" for s in states]


def _room(state: BackendState, roomy: list[BackendState], mine: tuple[BackendState, ...]) -> str:
    if state not in mine:
        return "other-tenants"
    if state in roomy:
        return "room"
    return "unhealthy" if not state.healthy else "full"


def _score_lines(
    states: tuple[BackendState, ...],
    roomy: list[BackendState],
    mine: tuple[BackendState, ...],
    decision: RoutingDecision,
) -> list[str]:
    detail = decision.detail
    scorers = list(detail.by_scorer) if detail is not None else []
    header = ["backend", "room", "in_flight", "matched", *scorers, "total"]
    rows = [header]
    for state in states:
        row = [state.name, _room(state, roomy, mine), str(state.in_flight)]
        if detail is not None and state.name in detail.backends:
            i = detail.backends.index(state.name)
            row.append(f"{detail.matched[i]}/{detail.prompt_blocks}")
            row += [f"{detail.by_scorer[name][i]:.3f}" for name in scorers]
            row.append(f"{detail.totals[i]:.3f}")
        else:
            row += ["-"] * (len(header) - len(row))
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    table = ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if detail is not None and detail.load_bound:
        table.append(f"  bounded load: at most {detail.load_bound} requests in flight per backend after this one")
    return table


def _wait_budget(priority_class: PriorityClass) -> str:
    """The class's wait budget as dispatch computes it (``ModelQueues.wait_budget``), said for a
    gateway that has measured nothing yet: the measured dispatch-to-first-token tail lowers it."""
    if priority_class.queue.max_wait_s is not None:
        return f"{priority_class.queue.max_wait_s:g}s"
    fresh = ModelQueues("-", {}).wait_budget(priority_class)
    return f"{fresh:g}s, the TTFT objective less the measured dispatch-to-first-token time"
