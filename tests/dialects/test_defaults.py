"""The dialects on the OpenAI defaults (``gateway/dialects/defaults.py``).

The defaults are written once: a dialect class that restates a value it inherits is the re-typed
table the base exists to remove. The ``Dialect`` protocol as the union of its roles:
``test_base.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.dialects.base import Dialect
from gateway.dialects.defaults import OpenAIDialect
from gateway.dialects.registry import DIALECTS
from tests.dialects.test_base import protocol_members

dialects = pytest.mark.parametrize("dialect", list(DIALECTS.values()), ids=lambda d: d.name)


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
