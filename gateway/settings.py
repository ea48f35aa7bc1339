"""Process settings: where to listen, which policy to load, how big the upstream pool is.

Read once at start-up from the command line and ``GATEWAY_*`` environment variables, then
frozen. Anything a platform team changes per tenant or model belongs in the policy file,
not here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


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
    measure what telemetry costs (``loadtests/overhead.py --telemetry``), never in production."""

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
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
