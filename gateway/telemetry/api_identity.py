"""``ApiIdentity``: which API a request is, the one role of a dialect that telemetry reads.

Why in telemetry: of the ``Dialect`` roles (``gateway/dialects/base.py``), this is the one the
measurements name an API by (the ``api`` label of the request metrics, the server span's name and
``http.route``, ``gateway/telemetry/tracing.py``), and telemetry is below the dialects' stage. The
role is declared once, here; ``Dialect`` composes it with the others, so every dialect is one.
"""

from __future__ import annotations

from typing import Protocol


class ApiIdentity(Protocol):
    """Which API a request is (``gateway/dialects/base.py``'s docstring: the routes, the metrics, the trace)."""

    @property
    def name(self) -> str:
        """Short lower-case name: the ``api`` label of the request metrics (``gateway_requests_total``,
        the latency histograms, tokens, SLO and goodput counters), ``policy explain``'s wording."""
        ...

    @property
    def path(self) -> str:
        """The path clients POST to, and the path the request is forwarded to on a backend."""
        ...

    @property
    def operation(self) -> str:
        """``gen_ai.operation.name`` of the request's server span, and the span's name (OTel GenAI)."""
        ...
