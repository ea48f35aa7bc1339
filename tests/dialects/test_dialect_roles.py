"""The ``Dialect`` protocol as the union of its roles, and the dialects on the OpenAI defaults.

The roles (``gateway/dialects/base.py``) split the protocol by the stage that reads them, so each
member is in exactly one and ``Dialect`` adds none. The defaults (``gateway/dialects/defaults.py``)
are written once: a dialect class that restates a value it inherits is the re-typed table the
base exists to remove.
"""

from __future__ import annotations

from typing import Any, Protocol

import pytest

from gateway.dialects.base import (
    AnswerFormat,
    AnswerState,
    BodyRules,
    Continuation,
    Dialect,
    StreamFormat,
    Translating,
)
from gateway.dialects.defaults import OpenAIDialect
from gateway.dialects.registry import DIALECTS
from gateway.telemetry.api_identity import ApiIdentity

ROLES = (ApiIdentity, BodyRules, Translating, StreamFormat, AnswerFormat, AnswerState, Continuation)

dialects = pytest.mark.parametrize("dialect", list(DIALECTS.values()), ids=lambda d: d.name)


def own_members(protocol: type) -> set[str]:
    """The members a Protocol class declares itself."""
    return {name for name in vars(protocol) if not name.startswith("_")}


def protocol_members(protocol: type) -> set[str]:
    """The members a Protocol declares, its base protocols' included."""
    return {
        name
        for cls in protocol.__mro__
        if getattr(cls, "_is_protocol", False) and cls is not Protocol
        for name in own_members(cls)
    }


def test_the_dialect_protocol_is_its_roles_and_declares_nothing_of_its_own() -> None:
    assert own_members(Dialect) == set()
    assert set(Dialect.__mro__) >= set(ROLES)
    assert protocol_members(Dialect) == set().union(*map(own_members, ROLES))


@pytest.mark.parametrize("role", ROLES, ids=lambda role: role.__name__)
def test_a_role_shares_no_member_with_another(role: type) -> None:
    others = set().union(*(own_members(other) for other in ROLES if other is not role))
    assert own_members(role)
    assert not own_members(role) & others


@dialects
def test_every_registered_dialect_is_built_on_the_openai_defaults(dialect: Dialect) -> None:
    assert isinstance(dialect, OpenAIDialect)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, staticmethod) and isinstance(b, staticmethod):
        return a.__func__ is b.__func__
    return a is b or (type(a) is type(b) and isinstance(a, bool | str | tuple) and a == b)


@dialects
def test_no_dialect_class_restates_a_value_it_inherits(dialect: Dialect) -> None:
    members = protocol_members(Dialect)
    mro = type(dialect).__mro__
    for i, cls in enumerate(mro):
        for name in members & set(vars(cls)):
            inherited = next((vars(base)[name] for base in mro[i + 1 :] if name in vars(base)), None)
            assert inherited is None or not _same(vars(cls)[name], inherited), (
                f"{cls.__qualname__}.{name} restates what it inherits"
            )
