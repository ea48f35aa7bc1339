"""The APIs the gateway serves, by path: one dialect each (``gateway/dialects/base.py``).

The app routes every registered path to the inference pipeline (``gateway/app.py``), the
upstream client builds each backend's URL for every registered path (``gateway/upstream/client.py``),
and ``policy explain`` tells the API of a request body by its prompt field. A new API is a
new module of ``gateway/dialects/`` and one line here.

Usage::

    dialect = DIALECTS["/v1/chat/completions"]       # CHAT
    register_dialect(MY_DIALECT)                     # a test's or a fork's own API, before the app starts
"""

from __future__ import annotations

from gateway.dialects.base import Dialect
from gateway.dialects.chat import CHAT
from gateway.dialects.completions import COMPLETIONS
from gateway.dialects.count_tokens import COUNT_TOKENS
from gateway.dialects.embeddings import EMBEDDINGS
from gateway.dialects.messages import MESSAGES
from gateway.dialects.rerank import RERANK, SCORE
from gateway.dialects.responses import RESPONSES
from gateway.dialects.tokenize import DETOKENIZE, TOKENIZE

DIALECTS: dict[str, Dialect] = {}
"""Every registered dialect by its path, in registration order."""


def register_dialect(dialect: Dialect) -> None:
    """Serve ``dialect`` at its path; a path or a name registered twice is a bug (ValueError)."""
    if dialect.path in DIALECTS:
        raise ValueError(f"a dialect is already registered at {dialect.path}")
    if any(known.name == dialect.name for known in DIALECTS.values()):
        raise ValueError(f"a dialect is already registered as {dialect.name!r}")
    DIALECTS[dialect.path] = dialect


register_dialect(CHAT)
register_dialect(COMPLETIONS)
register_dialect(EMBEDDINGS)
register_dialect(RESPONSES)
register_dialect(MESSAGES)
register_dialect(COUNT_TOKENS)
register_dialect(TOKENIZE)
register_dialect(DETOKENIZE)
register_dialect(RERANK)
register_dialect(SCORE)
