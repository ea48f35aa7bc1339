"""One problem of a policy file, located: where it is (line, column), which entry by name, what.

Every finding of the loader becomes a ``Problem`` before anyone reads it, whatever found it:
pydantic's validation errors (``from_validation``), the keys ``read_yaml`` saw twice
(``from_duplicate``), a YAML syntax error (``from_yaml_error``), and the strings of the
cross-checks, ``check_isolation``, the routing and the shadow scorer checks, which all begin
with an index path (``located``: the leading path is parsed, looked up in the node tree and
written by name, so that any check that says ``section[i].field: message`` is translated
without the loader knowing its messages). One format everywhere (``render``)::

    policies/prod.yaml:41:7: tenants[acme].limits.rpm: must be greater than 0
    policies/prod.yaml:12:5: warning: backends[llama-a]: 'llama-a' (llamacpp) cannot salt ...

The position is the node the problem is about: the key, for an unknown or a repeated key; the
value, for a bad value (a list item or a whole entry is a value); for a key that is missing, the
nearest ancestor the file has (its key, when it has one). Lines and columns count from 1.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BaseModel

from gateway.policy.fields import unknown_key_message
from gateway.policy.paths import Part, PolicyTree, Step, position
from gateway.policy.yaml_source import DuplicateKey

_LEADING_PATH = re.compile(r"^[A-Za-z_][\w-]*(?:\[[^\]\s]+\]|\.[^\s\[\]]+?)*(?=: |$)")
_KEY_LOC = "[key]"
"""pydantic's last location part when a dict's key (not its value) is invalid."""


@dataclass(frozen=True, slots=True)
class Problem:
    """What is wrong at ``path`` (``tenants[acme].limits.rpm``; empty: the whole file), and the
    1-based ``line`` and ``column`` of the node it is about (None: not known, e.g. unreadable)."""

    path: str
    message: str
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message

    def render(self, source: str, label: str = "") -> str:
        """``<source>:<line>:<column>: [<label>]<path>: <message>``, e.g. ``label="warning: "``."""
        where = source if self.line is None else f"{source}:{self.line}:{self.column}"
        return f"{where}: {label}{self}"


def located(text: str, tree: PolicyTree) -> Problem:
    """A check's ``<index path>: <message>`` string, with names and the position of the value."""
    match = _LEADING_PATH.match(text)
    if match is None:  # about no place in particular
        return Problem("", text)
    found, rest = tree.walk(tree.parts(match.group()))
    message = text[match.end() :].removeprefix(": ")
    return _at(tree, found, rest, tree.render(found, rest), message, key=False)


def from_validation(error: Any, tree: PolicyTree, model: type[BaseModel]) -> Problem:
    """One of pydantic's ``errors()``, in the loader's words, named and placed."""
    loc: list[Part] = list(error["loc"])
    is_key = error["type"] == "extra_forbidden" or loc[-1:] == [_KEY_LOC]
    message = _message(error, model, loc)
    if loc[-1:] == [_KEY_LOC]:
        loc.pop()
        message = f"the key {message}"
    found, rest = tree.walk(loc)
    return _at(tree, found, rest, tree.render(found, rest), message, key=is_key)


def from_duplicate(duplicate: DuplicateKey, tree: PolicyTree) -> Problem:
    """A key written twice in one mapping, placed at the second, naming where the first is."""
    parts = tree.parts_to(duplicate.mapping)
    found, rest = tree.walk([*(parts or []), duplicate.key])
    line, column = position(duplicate.first)
    second_line, second_column = position(duplicate.second)
    message = f"duplicate key, first at line {line}, column {column} (YAML would silently keep only the last)"
    return Problem(tree.render(found, rest), message, second_line, second_column)


def from_yaml_error(exc: yaml.YAMLError) -> Problem:
    """A syntax error at the mark the parser gives (its ``problem``, and the ``context`` it was in)."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return Problem("", f"not valid YAML: {exc}")
    message = f"not valid YAML: {exc.problem}"
    if exc.context and exc.context_mark is not None:
        message += f" ({exc.context} at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1})"
    return Problem("", message, exc.problem_mark.line + 1, exc.problem_mark.column + 1)


def _message(error: Any, model: type[BaseModel], loc: Sequence[Part]) -> str:
    message = str(error["msg"])
    if error["type"] == "extra_forbidden":
        return unknown_key_message(model, loc)
    if error["type"] == "missing":
        return "is required"
    if message.startswith("Value error, "):
        return message.removeprefix("Value error, ")
    message = message.replace("Input should be", "must be").replace("String should", "must")
    return message.replace("List should", "must").replace("Dictionary should", "must")


def _at(tree: PolicyTree, found: list[Step], rest: list[Part], path: str, message: str, *, key: bool) -> Problem:
    """``message`` at ``path``, placed on the last step's key (``key``, or when the path ran past
    the file: the nearest ancestor) or on its value."""
    if not found:
        line, column = position(tree.root)
    else:
        last = found[-1]
        line, column = position(last.key if (key or rest) and last.key is not None else last.node)
    return Problem(path, message, line, column)
