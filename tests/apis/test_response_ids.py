"""Sealed response ids (``gateway/responses/ids.py``): what an id says, and that nothing else opens.

An id opens only for the tenant it was handed to, under the secret that sealed it, before it
expires, while the policy still serves its holder; any other string, including every id with one
character changed, opens to nothing, as an unknown id does.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.responses.ids import MAX_UPSTREAM_ID, PREFIX, ResponseIds

ENGINE_ID = "resp_4f9c2a7e0b1d4c3a8e6f5d2c1b0a9e8f"


@dataclass(frozen=True)
class Backend:
    name: str


SERVED = {"llama": (Backend("gpu-1"), Backend("gpu-2")), "mistral": (Backend("gpu-3"),)}


class Wall:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def ids(secret: bytes = b"s3cret", wall: Wall | None = None) -> ResponseIds:
    return ResponseIds(secret, ttl_s=3600.0, wall=wall or Wall())


def test_an_id_opens_to_its_holder_and_the_engines_own_id_for_its_tenant() -> None:
    sealed = ids().seal(ENGINE_ID, "acme", "llama", "gpu-2")
    opened = ids().open(sealed, "acme", SERVED)  # another process with the same secret
    assert opened is not None
    assert (opened.backend, opened.model, opened.upstream_id) == ("gpu-2", "llama", ENGINE_ID)
    assert opened.left_s == pytest.approx(3600.0)
    assert sealed.startswith(PREFIX)
    assert sealed.endswith("." + ENGINE_ID)
    assert ResponseIds.sealed(sealed)
    assert not ResponseIds.sealed(ENGINE_ID)
    assert "gpu" not in sealed.removesuffix(ENGINE_ID)
    assert "llama" not in sealed


@pytest.mark.parametrize(
    ("why", "tenant", "secret", "served", "later_s"),
    [
        pytest.param("another tenant", "globex", b"s3cret", SERVED, 0, id="another tenant's id opens to nothing"),
        pytest.param("another secret", "acme", b"other", SERVED, 0, id="another secret's id opens to nothing"),
        pytest.param("holder gone", "acme", b"s3cret", {"llama": (Backend("gpu-1"),)}, 0, id="a holder off the policy"),
        pytest.param("expired", "acme", b"s3cret", SERVED, 3600, id="an id past its ttl"),
    ],
)
def test_an_id_opens_to_nothing_for_anyone_else_or_once_it_cannot_be_served(
    why: str, tenant: str, secret: bytes, served: dict[str, tuple[Backend, ...]], later_s: float
) -> None:
    wall = Wall()
    sealed = ids(wall=wall).seal(ENGINE_ID, "acme", "llama", "gpu-2")
    wall.t += later_s
    assert ids(secret, wall).open(sealed, tenant, served) is None, why


@given(st.data())
def test_an_id_with_any_one_character_changed_opens_to_nothing(data: st.DataObject) -> None:
    sealed = ids().seal(ENGINE_ID, "acme", "llama", "gpu-2")
    at = data.draw(st.integers(0, len(sealed) - 1))
    other = data.draw(st.sampled_from("ABCabc012_-.xyzZ").filter(lambda c: c != sealed[at]))
    changed = sealed[:at] + other + sealed[at + 1 :]
    assert ids().open(changed, "acme", SERVED) is None


@given(st.text(max_size=200))
def test_no_string_a_client_makes_up_opens(made_up: str) -> None:
    assert ids().open(made_up, "acme", SERVED) is None
    assert ids().open(PREFIX + "A" * 39 + "." + made_up, "acme", SERVED) is None


def test_an_engine_id_too_long_to_seal_is_handed_out_as_it_is() -> None:
    long_id = "resp_" + "x" * MAX_UPSTREAM_ID
    assert ids().seal(long_id, "acme", "llama", "gpu-1") == long_id


def test_without_the_secret_there_are_no_sealed_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GATEWAY_TEST_RESPONSE_SECRET", raising=False)
    assert ResponseIds.from_env("GATEWAY_TEST_RESPONSE_SECRET") is None
    monkeypatch.setenv("GATEWAY_TEST_RESPONSE_SECRET", "s3cret")
    made = ResponseIds.from_env("GATEWAY_TEST_RESPONSE_SECRET")
    assert made is not None
    assert made.open(ids().seal(ENGINE_ID, "acme", "llama", "gpu-1"), "acme", SERVED) is not None
