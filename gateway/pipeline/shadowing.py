"""What the pipeline asks of a model group's shadow copies: start one, hand it the primary's answer.

A request of a group with a ``shadow`` may be copied to the group's shadow target once it has its
own backend (``handler.py``); the copy is measured and never answered, and its scorer compares
its answer with the primary's. The pipeline needs two calls of that, nothing more: ``copy`` when
the request is dispatched, ``primary_answered`` when it ends.

Why protocols here: the pipeline calls them, the shadow runner implements them
(``gateway/shadow/runner.py``: ``ShadowRunner``, ``ShadowHandle``). The shadow stage sits above
the pipeline in the stage order (``tests/test_import_graph.py``): it reads the request's context
and places copies with the dispatcher, so the pipeline owns what it calls and the composition
root (``gateway/service.py``) hands it the runner.
"""

from __future__ import annotations

from typing import Protocol

from gateway.pipeline.context import RequestContext
from gateway.policy.groups import ModelGroup


class ShadowCopy(Protocol):
    """One running copy, as the pipeline sees it: it takes the primary's answer, nothing else."""

    @property
    def wants_primary_text(self) -> bool:
        """Whether ``primary_answered`` uses a text (the group's shadow has a scorer): collecting it is worth it."""
        ...

    def primary_answered(self, text: str | None) -> None:
        """Once, when the primary ends: its output text, or None when not known (failed, not collected)."""
        ...


class Shadows(Protocol):
    """Starts the shadow copies of requests (one per gateway)."""

    def copy(self, ctx: RequestContext, group: ModelGroup) -> ShadowCopy | None:
        """Start a copy of ``ctx.request`` on ``group``'s shadow target, or not; never blocks nor raises."""
        ...
