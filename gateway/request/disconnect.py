"""How the pipeline learns that its client left: a ``DisconnectSignal`` in the request's scope.

Why not ``receive()``: waiting for ``http.disconnect`` takes a task per request, created, woken
and cancelled (a twentieth of a short request's CPU); a callback set on a signal costs an
attribute. The gateway's server puts one signal per request in the ASGI scope's extensions, under
``DISCONNECT_EXTENSION``; under another server there is none, and the pipeline waits on
``receive()`` (``handler.py``).

Why the protocol is here, with the reading of the client's request: the pipeline listens, the
server implements it (one per response cycle, ``gateway/server/connections.py``), and both sit
above ``request`` in the stage order (``tests/test_import_graph.py``), so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from starlette.types import Scope

DISCONNECT_EXTENSION = "gateway.disconnect"


class DisconnectSignal(Protocol):
    """Calls its listener once, when the client's connection is lost before the response completed."""

    def listen(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` when the client leaves (at once if it already has)."""
        ...

    def clear(self) -> None:
        """Forget the listener: the request is over."""
        ...


def disconnect_signal(scope: Scope) -> DisconnectSignal | None:
    """The request's ``DisconnectSignal``; None under another server (then wait on ``receive()``)."""
    extensions = scope.get("extensions")
    return extensions.get(DISCONNECT_EXTENSION) if extensions is not None else None
