"""The valid keys of a policy section, and the closest one to a key the model does not know.

Every section is a pydantic model that refuses unknown keys (``extra="forbid"``), so the valid
keys are its ``model_fields``: the section an unknown key sits in is found by following the
error's location from ``Policy`` through nested models, lists, tuples and dicts. A typo then
reads ``tenants[acme].limts: unknown key; did you mean 'limits'?`` (``difflib``'s closest match,
ratio 0.6 or more); a key close to none gets the list of valid ones when the section has at
most ``LISTED_KEYS``, since a long list hides the answer more than it gives it.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Sequence
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel

LISTED_KEYS = 8
_ITEMS = (list, tuple, set, frozenset)


def unknown_key_message(model: type[BaseModel], loc: Sequence[str | int]) -> str:
    """``unknown key``, with the closest valid key of its section or the valid keys (see above)."""
    *section, key = loc
    names = section_keys(model, section)
    if not names or not isinstance(key, str):
        return "unknown key"
    close = difflib.get_close_matches(key, names, n=1)
    if close:
        return f"unknown key; did you mean '{close[0]}'?"
    if len(names) <= LISTED_KEYS:
        return f"unknown key (valid keys: {', '.join(names)})"
    return "unknown key"


def section_keys(model: type[BaseModel], loc: Sequence[str | int]) -> list[str]:
    """The field names of the model found at ``loc`` from ``model``; empty when ``loc`` ends
    anywhere else (a dict of free keys, a scalar)."""
    annotation: Any = model
    for part in loc:
        annotation = _inner(annotation, part)
        if annotation is None:
            return []
    found = _model(annotation)
    return list(found.model_fields) if found is not None else []


def _inner(annotation: Any, part: str | int) -> Any:
    """The annotation of ``part`` inside a value annotated ``annotation``; None if none."""
    for option in _options(annotation):
        if isinstance(option, type) and issubclass(option, BaseModel):
            field = option.model_fields.get(part) if isinstance(part, str) else None
            if field is not None:
                return field.annotation
        origin, args = get_origin(option), get_args(option)
        if origin in _ITEMS and isinstance(part, int) and args:
            return args[0]
        if origin is dict and isinstance(part, str) and len(args) == 2:
            return args[1]
    return None


def _model(annotation: Any) -> type[BaseModel] | None:
    for option in _options(annotation):
        if isinstance(option, type) and issubclass(option, BaseModel):
            return option
    return None


def _options(annotation: Any) -> list[Any]:
    """``annotation`` without ``Annotated`` metadata, each member of a union on its own."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _options(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return [option for arg in get_args(annotation) for option in _options(arg)]
    return [annotation]
