"""Read a policy's YAML strictly: a key written twice is refused, never silently dropped.

``yaml.safe_load`` builds a dict in which the last of two equal keys wins: a second ``limits:``
under a tenant replaced the first (rpm 60 became 600,000 and the other limits went) without a
word, and ``policy validate`` called the file valid. The request path refuses duplicate JSON
keys; a policy is held to the same rule. ``StrictLoader`` notes every key that one mapping
repeats, with where each occurrence starts, and ``read_yaml`` constructs no document that has
any, so that the loader can name them all at once, each with its path.

The check runs when a mapping is composed, before ``SafeConstructor.flatten_mapping``: merging
(``<<: *defaults``) rewrites a mapping node's pairs in place, merged pairs first, and an explicit
key overriding a merged one is YAML's merge rule, not a duplicate. The ``<<`` key is a key like
any other: written twice in one mapping it is a duplicate (merge several with ``<<: [*a, *b]``).

The composed node tree is kept (``YamlDocument.root``): every node carries its start mark, which
is how a problem found later names its line and column (``gateway/policy/paths.py``).

Usage::

    document = read_yaml(text)          # raises yaml.YAMLError on a syntax error
    if document.duplicates: ...         # document.data is None then
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import yaml

MERGE_TAG = "tag:yaml.org,2002:merge"


@dataclass(frozen=True, slots=True)
class DuplicateKey:
    """A key written twice in one mapping: ``mapping`` holds both, ``first`` and ``second`` are
    the two key nodes (their ``start_mark`` is where each was written)."""

    mapping: yaml.MappingNode
    key: str
    first: yaml.Node
    second: yaml.Node


@dataclass(frozen=True, slots=True)
class YamlDocument:
    """A parsed policy text: the node tree (None for an empty text), the data built from it
    (None when the text repeats a key), and every repeated key."""

    root: yaml.Node | None
    data: Any
    duplicates: tuple[DuplicateKey, ...]


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that notes every key one mapping repeats (``duplicates``).

    It still constructs what ``SafeLoader`` would (last key wins): use ``read_yaml``, which
    refuses to construct a text with duplicates."""

    def __init__(self, stream: str | bytes) -> None:
        super().__init__(stream)
        self.duplicates: list[DuplicateKey] = []

    def compose_mapping_node(self, anchor: Any) -> yaml.MappingNode:
        node = super().compose_mapping_node(anchor)
        seen: dict[Hashable, yaml.Node] = {}
        for key_node, _ in node.value:
            identity = self._identity(key_node)
            if identity is None:
                continue
            first = seen.setdefault(identity, key_node)
            if first is not key_node:
                self.duplicates.append(DuplicateKey(node, str(key_node.value), first, key_node))
        return node

    def _identity(self, key_node: yaml.Node) -> Hashable | None:
        """What makes two keys equal in the dict being built: the constructed scalar (so that
        ``limits`` and ``"limits"`` are one key); None for keys that cannot collide here."""
        if not isinstance(key_node, yaml.ScalarNode):
            return None
        if key_node.tag == MERGE_TAG:
            return ("<<", MERGE_TAG)
        try:
            value = self.construct_object(key_node)
        except yaml.YAMLError:
            return (key_node.tag, key_node.value)
        return value if isinstance(value, Hashable) else None


def read_yaml(text: str | bytes) -> YamlDocument:
    """Compose ``text`` (one document) and construct it unless it repeats a key.

    Raises ``yaml.YAMLError`` (a ``MarkedYAMLError`` with the position, mostly) on bad syntax."""
    loader = StrictLoader(text)
    try:
        root = loader.get_single_node()
        duplicates = tuple(loader.duplicates)
        data = None if root is None or duplicates else loader.construct_document(root)
    finally:
        loader.dispose()
    return YamlDocument(root, data, duplicates)
