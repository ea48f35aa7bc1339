"""The ``Dialect`` protocol (``gateway/dialects/base.py``) as the union of its roles.

The roles split the protocol by the stage that reads them, so each member is in exactly one and
``Dialect`` adds none. The dialects built on the OpenAI defaults: ``test_defaults.py``.
"""

from __future__ import annotations

from typing import Protocol

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
from gateway.telemetry.api_identity import ApiIdentity

ROLES = (ApiIdentity, BodyRules, Translating, StreamFormat, AnswerFormat, AnswerState, Continuation)


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
