"""What the supervisor hands a worker: its settings and the descriptors of its sockets.

A worker is a whole gateway with the settings of ``serve``, but for four fields: its index, the
API port the supervisor bound (``--port 0`` resolved), its operator listener (loopback, a port
of its own), and the connection bounds, which are totals for the set and so divided by N
(each worker enforces its share with its own guards; rounded up, so that the bound is never
lowered to zero). The spec travels in one environment variable, as JSON.

The lifeline is a socket pair: the worker writes ``DRAINED`` once it has drained, the
supervisor closes its end once every worker has (or when it exits, however it exits), and
never writes (``child.py``, ``supervisor.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from gateway.settings import Settings

SPEC_ENV = "GATEWAY_WORKER_SPEC"
DRAINED = b"d"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    """``WorkerSpec(settings=..., api_fd=5, admin_fd=6, lifeline_fd=7)``; the descriptors are the
    worker's (the supervisor passes them at the same numbers)."""

    settings: Settings
    api_fd: int
    admin_fd: int
    lifeline_fd: int
    """The worker's end of the lifeline (the module docstring)."""

    def encode(self) -> str:
        return json.dumps(
            {
                "settings": dataclasses.asdict(self.settings),
                "api_fd": self.api_fd,
                "admin_fd": self.admin_fd,
                "lifeline_fd": self.lifeline_fd,
            }
        )

    @classmethod
    def decode(cls, text: str) -> WorkerSpec:
        data = json.loads(text)
        return cls(
            settings=Settings(**data["settings"]),
            api_fd=int(data["api_fd"]),
            admin_fd=int(data["admin_fd"]),
            lifeline_fd=int(data["lifeline_fd"]),
        )


def worker_settings(settings: Settings, index: int, *, port: int, admin_port: int) -> Settings:
    """The settings of worker ``index`` of the set ``settings`` describes (see the module docstring)."""
    share = settings.workers
    return dataclasses.replace(
        settings,
        worker_index=index,
        port=port,
        admin_host="127.0.0.1",
        admin_port=admin_port,
        max_connections=math.ceil(settings.max_connections / share),
        max_upstream_connections=math.ceil(settings.max_upstream_connections / share),
    )
