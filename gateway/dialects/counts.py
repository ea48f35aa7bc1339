"""The one count check every dialect makes before it reads a text: a list no longer than its limit.

Messages, items, inputs, content parts, blocks and tools are bounded by the policy's
``limits`` (``max_messages``, ``max_content_parts``, ``max_tools``) by their length alone, so that
a body of a million tiny entries is refused before the estimate walks it. One function, so that
every API words the refusal the same way and names the same codes.
"""

from __future__ import annotations

from collections.abc import Sized

from gateway.errors import InvalidRequest


def at_most(values: Sized, limit: int, param: str, unit: str, code: str) -> None:
    """400 ``code`` naming ``param`` when ``values`` has more than ``limit`` ``unit`` (``entries``,
    ``parts``, ``blocks``, ``items``, ``inputs``)."""
    if len(values) > limit:
        raise InvalidRequest(f"'{param}' has {len(values)} {unit}; the limit is {limit}.", code=code, param=param)
