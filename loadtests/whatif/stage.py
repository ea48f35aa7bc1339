"""One side's processes: a policy rewritten for simulated engines, the engines, and its gateway.

``stage_policy`` writes a copy of a policy file into a work directory, changed only where a
replay must change it, and loads it with the gateway's own loader (``gateway/policy/loader.py``)
so that a policy the gateway would refuse fails here, with the loader's message:

* **Backends**: each model's backends become simulated engines on loopback ports. With
  ``StageSettings.engines`` None, one engine per backend the policy names (same name, capacity,
  price, GPUs, class sharing, ``engine_priority``; kind ``sim``, no credential); with ``engines``
  N, N copies of the model's first backend, named ``<name>-0`` .. ``<name>-N-1``. A backend
  serving several models cannot be one simulated engine (an engine serves one model): refused.
* **Keys**: each tenant's ``key_hashes`` becomes the hash of ``tenant_key(tenant)``, a key the
  replay knows; the admin keys are kept.
* **Time**: ``speed`` S runs S times faster. The engines run with ``--time-scale 1/S`` and the
  policy's times are divided by S with the gateway's own rule (``gateway/policy/timescale.py``:
  SLOs, queue waits, deadlines, first-byte and between-chunk timeouts; prices multiplied by S,
  which is why costs are taken from the original policy). Two more, since a replay compresses
  traffic and not only the engines: tenant ``rpm`` and ``tpm`` are multiplied by S (the buckets
  refill S times faster; their burst allowance is S times larger too, which a policy cannot
  express otherwise), and the prefix index's ``ttl_s`` is divided by S. What is about the
  gateway's own work (health checks, scrapes, connect timeouts, breaker windows) is unchanged.
* **State**: a policy with ``state.backend: redis`` (and so ``fleet`` settings) is staged on
  in-memory state: a stage is one gateway process, and the replay must not touch a shared Redis.
  Tracing is turned off (no collector is running). Both are listed in ``StagePlan.notes``.

``running`` starts one ``sim`` process per served model (``--count`` engines on consecutive
ports) and the gateway (``serve`` on ``port_base``, its operator listener at
``processes.admin_args``), waits with a deadline until every engine answers ``/health``, the
gateway ``/readyz`` and the gateway's health check has found every engine up, and stops them
all at the end. The gateway runs without the caller's ``GATEWAY_*`` and ``OTEL_*`` environment
(one process, no trace log unless asked for).

Ports: the gateway on ``port_base``, its operator listener on ``port_base + 1000``, the engines
on ``port_base + 1`` onwards (``ports_needed``; ``free_port_base`` finds such a block).
"""

from __future__ import annotations

import copy
import math
import os
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.policy.model import Backend, ModelPolicy
from gateway.policy.snapshot import PolicySnapshot
from gateway.policy.timescale import scale_policy_time
from gateway.request.keys import hash_api_key
from gateway.service import load_policy
from loadtests.sim.profiles import profile_names
from loadtests.whatif.model import StageSettings
from loadtests.whatif.processes import (
    ADMIN_PORT_OFFSET,
    GATEWAY,
    admin_args,
    admin_url,
    bindable,
    labelled,
    metrics,
    process,
)

STAGED_POLICY = "policy.yaml"
READY_TIMEOUT_S = 60.0
_POLL_S = 0.05


class StageError(ValueError):
    """The policy or the settings cannot be staged; the message says why."""


@dataclass(frozen=True, slots=True)
class StagedEngine:
    """One simulated engine standing in for a backend; its cost is the original policy's."""

    name: str
    source: str
    """The policy's backend it stands in for."""
    model: str
    served_as: str
    """The model name the engine answers to (the policy's ``upstream_name``, else its name)."""
    port: int
    gpus: int
    price_per_gpu_hour: float | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True, slots=True)
class StagePlan:
    """A staged policy and the fleet it runs on (module docstring)."""

    policy_path: Path
    snapshot: PolicySnapshot
    """The rewritten policy, as the gateway loads it (times divided by the speed)."""
    original: PolicySnapshot
    """The policy as written: SLOs in trace time, prices as charged."""
    engines: tuple[StagedEngine, ...]
    gateway_port: int
    profile: str
    speed: float
    keys: Mapping[str, str]
    """Each tenant's API key in the staged policy."""
    notes: tuple[str, ...] = ()

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def admin_url(self) -> str:
        return admin_url(self.gateway_port)


def ports_needed(plan: StagePlan) -> int:
    """Consecutive ports a stage takes from ``port_base``: the gateway's and one per engine."""
    return 1 + len(plan.engines)


def free_port_base(count: int, candidates: range, *, taken: Sequence[int] = ()) -> int:
    """The first port of ``count`` consecutive ports in ``candidates``, none in ``taken``, that are
    free right now together with the operator port of the first (``port + 1000``)."""
    for first in range(candidates.start, candidates.stop - count + 1):
        block = range(first, first + count)
        if any(port in taken for port in block):
            continue
        if all(bindable(port) for port in block) and bindable(first + ADMIN_PORT_OFFSET):
            return first
    raise StageError(f"no {count} consecutive free ports in {candidates.start}..{candidates.stop - 1}")


def tenant_key(tenant: str) -> str:
    """The API key a stage gives ``tenant`` (a local, throw-away policy: no secret to keep)."""
    return f"whatif-{tenant}"


def check_profile(name: str) -> None:
    if name not in profile_names():
        raise StageError(f"unknown simulator profile {name!r}; known: {', '.join(profile_names())}")


def stage_policy(policy: Path, settings: StageSettings, *, work_dir: Path, port_base: int) -> StagePlan:
    """Write the staged copy of ``policy`` into ``work_dir`` and load it (module docstring)."""
    check_profile(settings.profile)
    if settings.speed <= 0:
        raise StageError(f"speed must be positive, not {settings.speed}")
    if settings.engines is not None and settings.engines < 1:
        raise StageError(f"engines must be at least 1, not {settings.engines}")
    original = load_policy(policy)
    engines = _fleet(original, settings.engines, port_base + 1)
    data = _scaled(original, settings.speed)
    data["backends"] = _sim_backends(data["backends"], engines)
    keys = {tenant["name"]: tenant_key(tenant["name"]) for tenant in data["tenants"]}
    for tenant in data["tenants"]:
        tenant["key_hashes"] = [hash_api_key(keys[tenant["name"]])]
    notes = _standalone(data)
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / STAGED_POLICY
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    staged = load_policy(path)
    return StagePlan(path, staged, original, engines, port_base, settings.profile, settings.speed, keys, notes)


def _scaled(snapshot: PolicySnapshot, speed: float) -> dict[str, Any]:
    """The policy as data with its times divided by ``speed`` (module docstring)."""
    data: dict[str, Any] = scale_policy_time(snapshot, 1 / speed).policy.model_dump(mode="json", exclude_none=True)
    for tenant in data["tenants"]:
        limits = tenant.get("limits", {})
        for name in ("rpm", "tpm"):
            if limits.get(name) is not None:
                limits[name] = math.ceil(limits[name] * speed)
    for model in data["models"]:
        index = model.setdefault("routing", {}).setdefault("index", {})
        index["ttl_s"] = index.get("ttl_s", 600.0) / speed
    return data


def _standalone(data: dict[str, Any]) -> tuple[str, ...]:
    """Put the staged policy on in-memory state, without tracing; say what was changed."""
    notes = []
    if data.get("state", {}).get("backend") == "redis":
        data["state"] = {"backend": "memory"}
        notes.append("the policy's Redis state (and fleet settings) replaced by in-memory state: one gateway process")
    tracing = data.get("telemetry", {}).get("tracing")
    if tracing and tracing.get("enabled"):
        notes.append("tracing turned off")
    data.setdefault("telemetry", {})["tracing"] = {"enabled": False}
    return tuple(notes)


def _fleet(snapshot: PolicySnapshot, engines: int | None, first_port: int) -> tuple[StagedEngine, ...]:
    """The simulated engines of every model, in the policy's order of models."""
    staged: list[StagedEngine] = []
    for model in snapshot.policy.models:
        for name, source in _sources(snapshot, model, engines):
            staged.append(
                StagedEngine(
                    name=name,
                    source=source.name,
                    model=model.name,
                    served_as=model.upstream_name or model.name,
                    port=first_port + len(staged),
                    gpus=source.gpus,
                    price_per_gpu_hour=source.price_per_gpu_hour,
                )
            )
    return tuple(staged)


def _sources(snapshot: PolicySnapshot, model: ModelPolicy, engines: int | None) -> list[tuple[str, Backend]]:
    """(engine name, the backend it copies) for each engine of ``model``."""
    backends = snapshot.backends_by_model[model.name]
    for backend in backends:
        if len(backend.models) > 1:
            raise StageError(
                f"backend {backend.name!r} serves several models ({', '.join(backend.models)}); a simulated "
                "engine serves one: give each model its own backends"
            )
    if engines is None:
        return [(backend.name, backend) for backend in backends]
    return [(f"{backends[0].name}-{i}", backends[0]) for i in range(engines)]


def _sim_backends(scaled: list[dict[str, Any]], engines: Sequence[StagedEngine]) -> list[dict[str, Any]]:
    """The ``backends`` section: each engine as a copy of its (already scaled) source backend."""
    by_name = {backend["name"]: backend for backend in scaled}
    out = []
    for engine in engines:
        data = copy.deepcopy(by_name[engine.source])
        data.pop("credential_env", None)
        data.update(name=engine.name, url=engine.url, kind="sim", models=[engine.model])
        out.append(data)
    return out


@contextmanager
def running(plan: StagePlan, *, trace_log: Path | None = None, timeout_s: float = READY_TIMEOUT_S) -> Iterator[None]:
    """The engines and the gateway of ``plan`` until the block ends (module docstring).

    ``trace_log``: the gateway writes its request trace log there (``GATEWAY_TRACE_LOG``).
    """
    with ExitStack() as stack:
        for argv, ready in _engine_commands(plan):
            stack.enter_context(process(argv, ready, timeout_s=timeout_s))
        wait_until(lambda: all(_answers(e.url + "/health") for e in plan.engines), timeout_s, "engines healthy")
        argv = [*GATEWAY, "serve", "--policy", str(plan.policy_path), "--port", str(plan.gateway_port)]
        argv += admin_args(plan.gateway_port)
        env = gateway_env(trace_log)
        stack.enter_context(process(argv, plan.gateway_url + "/readyz", timeout_s=timeout_s, env=env))
        names = {e.name for e in plan.engines}
        wait_until(lambda: _healthy_backends(plan.admin_url) >= names, timeout_s, "the gateway to see every engine")
        yield


def _engine_commands(plan: StagePlan) -> Iterator[tuple[list[str], str]]:
    """One ``sim`` command per served model (its engines are on consecutive ports), with the URL
    that answers once its last engine is up."""
    groups: dict[str, list[StagedEngine]] = {}
    for engine in plan.engines:
        groups.setdefault(engine.served_as, []).append(engine)
    for model, engines in groups.items():
        argv = [*GATEWAY, "sim", "--profile", plan.profile, "--port", str(engines[0].port)]
        argv += ["--count", str(len(engines)), "--model", model, "--time-scale", repr(1 / plan.speed)]
        yield argv, engines[-1].url + "/health"


def gateway_env(trace_log: Path | None) -> dict[str, str]:
    """This process's environment without the gateway's and OpenTelemetry's settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "OTEL_"))}
    if trace_log is not None:
        env["GATEWAY_TRACE_LOG"] = str(trace_log)
    return env


def _healthy_backends(url: str) -> set[str]:
    try:
        samples = metrics(url)
    except OSError:
        return set()
    healthy = labelled(samples, "gateway_backend_healthy")
    return {dict(labels)["backend"] for labels, value in healthy.items() if value == 1}


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition()`` until it is true; ``StageError`` naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise StageError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(_POLL_S)
