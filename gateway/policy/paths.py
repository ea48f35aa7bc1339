"""Paths inside a policy file: where they point (line and column), and how to write them by name.

A problem is found on the parsed policy (pydantic's ``loc`` tuples, the loader's cross-checks,
``check_isolation``, ...), and all of these say where by index: ``tenants[2].limits.rpm``. An
operator reads a file by names, not by counting list items, and wants the line to look at.
``PolicyTree`` walks the YAML node tree (``gateway/policy/yaml_source.py``) along such a path
and gives back ``tenants[acme].limits.rpm`` and the node it ends at (whose ``start_mark`` is the
position).

The rule for names: an item of a list is written ``[<its name>]`` when it is a mapping with a
``name`` that is a plain string (no whitespace or brackets, not all digits, so that it never
reads as an index) and that no other item of the list shares; else ``[<index>]``. Mapping keys
are written as they are (``classes.batch.slo``).

A path that runs past the file (a key that is missing, a section left to its defaults) is found
as far as it goes: ``walk`` returns the steps it found and the parts it did not.

Usage::

    tree = PolicyTree(document.root)
    found, rest = tree.walk(("tenants", 2, "limits", "rpm"))
    tree.render(found, rest)                      # "tenants[acme].limits.rpm"
    found, rest = tree.walk(tree.parts("backends[3].tenants[1]"))
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import yaml

from gateway.policy.yaml_source import MERGE_TAG

Part = str | int


class ItemName(str):
    """A list item named in brackets in a written path (``tenants[acme]``), not a mapping key."""

    __slots__ = ()


_NAME = re.compile(r"^(?!\d+$)[^\s\[\]]+$")
_TOKEN = re.compile(r"\[([^\]\s]+)\]|\.?([^\s\[\].]+)")


@dataclass(frozen=True, slots=True)
class Step:
    """One part of a path found in the tree: the mapping key or list index it was, its key node
    (None for a list item), the node it leads to, and how it is written (``[acme]``, ``.limits``)."""

    part: Part
    key: yaml.Node | None
    node: yaml.Node
    label: str


class PolicyTree:
    """The node tree of one policy text, to name and place paths in it (see the module docstring)."""

    __slots__ = ("_names", "root")

    def __init__(self, root: yaml.Node | None) -> None:
        self.root = root
        self._names: dict[int, list[str | None]] = {}
        """Each list's usable item names, by the list node's id: computed once per list, since a
        policy of thousands of tenants may have a warning for each."""

    def walk(self, parts: Sequence[Part]) -> tuple[list[Step], list[Part]]:
        """The steps of ``parts`` found in the tree, and the parts left after the first one not found.

        A string part may also name a list item (an ``ItemName``); keys split at dots by
        ``parts`` are joined back when the mapping has the dotted key."""
        found: list[Step] = []
        node, rest = self.root, list(parts)
        while rest and node is not None:
            step, used = self._step(node, rest)
            if step is None:
                break
            found.append(step)
            node, rest = step.node, rest[used:]
        return found, rest

    def render(self, found: Sequence[Step], rest: Sequence[Part] = ()) -> str:
        """The path as an operator reads it: names for named list items, keys, indexes."""
        labels = [step.label for step in found] + [_label(part) for part in rest]
        return "".join(labels).removeprefix(".")

    def parts(self, path: str) -> list[Part]:
        """``backends[3].tenants[1]`` as ``["backends", 3, "tenants", 1]`` (``[acme]`` is an ``ItemName``)."""
        out: list[Part] = []
        for match in _TOKEN.finditer(path):
            index, key = match.groups()
            if index is None:
                out.append(key)
            else:
                out.append(int(index) if index.isdigit() else ItemName(index))
        return out

    def parts_to(self, target: yaml.Node) -> list[Part] | None:
        """The path from the root to ``target`` (the first way there, depth first), or None."""
        seen: set[int] = set()
        stack: list[tuple[yaml.Node, list[Part]]] = [(self.root, [])] if self.root is not None else []
        while stack:
            node, parts = stack.pop()
            if node is target:
                return parts
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.extend(reversed([(child, [*parts, part]) for part, child in _children(node)]))
        return None

    def _step(self, node: yaml.Node, rest: list[Part]) -> tuple[Step | None, int]:
        """The step of ``rest[0]`` (of more parts, for a dotted key) from ``node``, and how many parts it used."""
        part = rest[0]
        if isinstance(node, yaml.SequenceNode):
            names = self._item_names(node)
            index = part if isinstance(part, int) else names.index(part) if part in names else None
            if index is None or not 0 <= index < len(node.value):
                return None, 0
            name = names[index]
            return Step(index, None, node.value[index], f"[{index if name is None else name}]"), 1
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            for used in range(len(rest), 0, -1):  # the longest dotted key first: "tier.gold" before "tier"
                if not all(isinstance(p, str) for p in rest[:used]):
                    continue
                key = ".".join(str(p) for p in rest[:used])
                pair = _entry(node, key)
                if pair is not None:
                    return Step(key, pair[0], pair[1], f".{key}"), used
        return None, 0

    def _item_names(self, node: yaml.SequenceNode) -> list[str | None]:
        names = self._names.get(id(node))
        if names is None:
            names = self._names[id(node)] = _names(node)
        return names


def position(node: yaml.Node | None) -> tuple[int, int]:
    """The 1-based line and column where ``node`` starts (1, 1 for no node: an empty file)."""
    if node is None:
        return 1, 1
    mark = node.start_mark
    return mark.line + 1, mark.column + 1


def _entry(node: yaml.MappingNode, key: str) -> tuple[yaml.Node, yaml.Node] | None:
    """The pair of ``key`` in ``node``; the last one, as in the dict built (merged pairs come first)."""
    for key_node, value_node in reversed(node.value):
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag != MERGE_TAG and key_node.value == key:
            return key_node, value_node
    return None


def _children(node: yaml.Node) -> Iterator[tuple[Part, yaml.Node]]:
    if isinstance(node, yaml.SequenceNode):
        yield from enumerate(node.value)
    elif isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != MERGE_TAG:
                yield str(key_node.value), value_node
            else:
                yield "<<", value_node


def _names(node: yaml.SequenceNode) -> list[str | None]:
    """Each item's usable name (see the module docstring), None where it has none."""
    names: list[str | None] = []
    for item in node.value:
        pair = _entry(item, "name") if isinstance(item, yaml.MappingNode) else None
        value = pair[1] if pair is not None else None
        usable = isinstance(value, yaml.ScalarNode) and value.tag.endswith(":str") and _NAME.match(value.value)
        names.append(str(value.value) if usable and value is not None else None)
    counts = Counter(names)
    return [name if name is not None and counts[name] == 1 else None for name in names]


def _label(part: Part) -> str:
    return f"[{part}]" if isinstance(part, int | ItemName) else f".{part}"
