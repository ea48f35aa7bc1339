"""Process settings: where to listen, which policy to load, how big the upstream pool is.

Read once at start-up from the command line and ``GATEWAY_*`` environment variables, then
frozen. Anything a platform team changes per tenant or model belongs in the policy file,
not here. The connection guards (timeouts, header size, open connections) are listener
settings like nginx's, so they live here too; ``gateway/server/connections.py`` enforces them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_ADMIN_PORT = 9464


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """Process settings. ``Settings.from_env(policy_path="policies/demo.yaml")``."""

    policy_path: str
    host: str = "127.0.0.1"
    port: int = 8080
    log_level: str = "info"
    max_upstream_connections: int = 1000
    health_checks: bool = True
    trace_log_path: str | None = None
    """Where the request trace log goes (JSONL, rotated); ``GATEWAY_TRACE_LOG``; off when unset."""
    telemetry: bool = True
    """``GATEWAY_TELEMETRY=off`` stops recording metrics, costs and traces of requests: only to
    measure what telemetry costs (``loadtests/proofs/overhead.py --telemetry``), never in production."""
    admin_host: str = "127.0.0.1"
    """Where the operator listener (``/metrics``, ``/admin/*``, probes) binds: loopback unless the
    platform restricts who reaches it (a NetworkPolicy, see ``deploy/kubernetes``)."""
    admin_port: int = DEFAULT_ADMIN_PORT
    """The operator listener's port; 0 picks a free one (tests). 9464 is the port registered for
    an application's Prometheus endpoint (the OpenTelemetry exporter's default)."""
    admin_max_connections: int = 64
    """Its own bound: scrapes and probes never compete with API clients for connections."""
    header_timeout_s: float = 10.0
    """From a connection's start (or a request's first byte on a kept-alive one) to the end of its
    headers; SDK headers are a few hundred bytes and arrive in one packet."""
    body_timeout_s: float = 30.0
    """From the end of the headers to the end of the body: even the largest body the policy
    allows must arrive within it (a 10 MiB body at 30 s is 350 KB/s)."""
    keepalive_timeout_s: float = 75.0
    """An idle kept-alive connection is closed after this; above the 60 s idle timeout of common
    load balancers, so a balancer never reuses a connection the gateway is closing (which it
    answers with a 502). Idle connections are also the first closed at ``max_connections``."""
    max_header_bytes: int = 65536
    """Request line plus headers; more is refused with 431 (Envoy's default is 60 KiB)."""
    max_headers: int = 100
    """Header lines per request; more is refused with 431 before the rest is parsed. Browsers and
    the OpenAI/Anthropic SDKs send 10 to 20, so 100 leaves room for proxies and tracing headers;
    it is Envoy's ``max_headers_count`` default and Apache's ``LimitRequestFields``. Without it,
    5,000 tiny headers fit in 64 KiB and each costs a Python call and more in the application."""
    max_connections: int = 10000
    """Open connections on the API listener; at the bound the longest-idle one is closed, and
    when none is idle a new one is refused with 503. Lowered at start-up to fit the process's
    file descriptor limit (``gateway/server/serve.py``)."""
    workers: int = 1
    """Gateway processes serving the one API port (``serve --workers N``, ``GATEWAY_WORKERS``): 1 is
    one process and no supervisor; more is a supervisor and N workers (``gateway/workers/``).
    Every worker sees the same number, so that what is shared per process (each backend's
    capacity, without Redis) can be divided by it."""
    rollout_dir: str = ".gateway-state/rollouts"
    """Where rollouts keep their state without Redis (``GATEWAY_ROLLOUT_DIR``): one JSON file per
    rollout, shared by the workers of one host; a Kubernetes pod without Redis mounts a volume
    there so that a rollback outlives the pod (``gateway/rollout/store.py``)."""
    responses_per_tenant: int = 10_000
    """Stored responses (``previous_response_id``) whose holder each tenant's map keeps, in the
    process and in Redis (``GATEWAY_RESPONSES_PER_TENANT``): past it a tenant's oldest is
    forgotten (its follow-up is a 404), never another tenant's (``gateway/responses/affinity.py``).
    Entries live an hour, so 10,000 is a conversation turn every 0.36 s for an hour per tenant."""
    worker_index: int = 0
    """This process's index among the ``workers`` (0 to N-1), set by the supervisor for each
    worker; logs carry it (``[worker 1]``), client responses never do."""

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        env = os.environ
        values: dict[str, object] = {
            "policy_path": env.get("GATEWAY_POLICY", "policies/demo.yaml"),
            "host": env.get("GATEWAY_HOST", "127.0.0.1"),
            "port": int(env.get("GATEWAY_PORT", "8080")),
            "log_level": env.get("GATEWAY_LOG_LEVEL", "info"),
            "max_upstream_connections": int(env.get("GATEWAY_MAX_UPSTREAM_CONNECTIONS", "1000")),
            "trace_log_path": env.get("GATEWAY_TRACE_LOG") or None,
            "telemetry": env.get("GATEWAY_TELEMETRY", "on").lower() not in ("off", "0", "false"),
            "workers": _integer(env, "GATEWAY_WORKERS", 1),
            "rollout_dir": env.get("GATEWAY_ROLLOUT_DIR", ".gateway-state/rollouts"),
            "responses_per_tenant": _integer(env, "GATEWAY_RESPONSES_PER_TENANT", 10_000),
        }
        for name, kind in _CONNECTION_ENV.items():
            raw = env.get(f"GATEWAY_{name.upper()}")
            if raw is not None:
                try:
                    values[name] = kind(raw)
                except ValueError:
                    raise ValueError(f"GATEWAY_{name.upper()}={raw!r}: not a valid {kind.__name__}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be greater than 0, not {getattr(self, name)}")
        for name in ("max_header_bytes", "max_headers", "max_connections", "admin_max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.responses_per_tenant < 1:
            raise ValueError(f"responses_per_tenant must be at least 1, not {self.responses_per_tenant}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, not {self.workers}")
        if not 0 <= self.worker_index < self.workers:
            raise ValueError(f"worker_index must be in 0..{self.workers - 1}, not {self.worker_index}")
        if self.admin_port == self.port and self.port != 0:
            raise ValueError(f"the admin port must differ from the API port ({self.port})")


def _integer(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: not a valid int") from None


_CONNECTION_ENV: dict[str, type[int] | type[float] | type[str]] = {
    "admin_host": str,
    "admin_port": int,
    "admin_max_connections": int,
    "header_timeout_s": float,
    "body_timeout_s": float,
    "keepalive_timeout_s": float,
    "max_header_bytes": int,
    "max_headers": int,
    "max_connections": int,
}
"""The listener settings read from ``GATEWAY_<NAME>`` (e.g. ``GATEWAY_HEADER_TIMEOUT_S``)."""
