"""``PolicyTree``: a path by index becomes a path by name, found in the YAML node tree with its position."""

from __future__ import annotations

import pytest

from gateway.policy.paths import Part, PolicyTree, position
from gateway.policy.yaml_source import read_yaml

TEXT = """\
tenants:
  - name: acme
    limits: {rpm: 60}
  - {models: [a, b]}
  - name: twin
  - name: twin
  - name: "42"
  - name: two words
classes:
  tier.gold:
    rank: 0
"""


def tree() -> PolicyTree:
    return PolicyTree(read_yaml(TEXT).root)


@pytest.mark.parametrize(
    ("parts", "path", "at"),
    [
        pytest.param(["tenants", 0, "limits", "rpm"], "tenants[acme].limits.rpm", (3, 19), id="a named entry by name"),
        pytest.param(
            ["tenants", 1, "models", 1], "tenants[1].models[1]", (4, 18), id="an entry without a name by index"
        ),
        pytest.param(["tenants", 3], "tenants[3]", (6, 5), id="a name two entries share by index"),
        pytest.param(["tenants", 4], "tenants[4]", (7, 5), id="a name that reads as an index by index"),
        pytest.param(["tenants", 5], "tenants[5]", (8, 5), id="a name with whitespace by index"),
        pytest.param(["classes", "tier", "gold", "rank"], "classes.tier.gold.rank", (11, 11), id="a dotted key"),
    ],
)
def test_a_path_is_written_by_name_and_placed(parts: list[Part], path: str, at: tuple[int, int]) -> None:
    found, rest = tree().walk(parts)
    assert (tree().render(found, rest), rest) == (path, [])
    assert position(found[-1].node) == at


def test_a_path_past_the_file_is_found_as_far_as_it_goes() -> None:
    found, rest = tree().walk(["tenants", 0, "limits", "tpm"])
    assert [step.part for step in found] == ["tenants", 0, "limits"]
    assert rest == ["tpm"]
    assert tree().render(found, rest) == "tenants[acme].limits.tpm"


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        pytest.param("backends[3].tenants[1]", ["backends", 3, "tenants", 1], id="indexes"),
        pytest.param("tenants[acme].limits.rpm", ["tenants", "acme", "limits", "rpm"], id="a name"),
        pytest.param("classes.tier.gold.rank", ["classes", "tier", "gold", "rank"], id="dots split keys"),
    ],
)
def test_a_written_path_is_read_back_into_parts(text: str, parts: list[Part]) -> None:
    assert tree().parts(text) == parts


def test_a_named_part_finds_its_entry() -> None:
    found, rest = tree().walk(["tenants", "acme", "limits"])
    assert ([step.part for step in found], rest) == (["tenants", 0, "limits"], [])


def test_the_path_to_a_node_is_the_first_way_to_it() -> None:
    document = read_yaml(TEXT)
    limits = document.root.value[0][1].value[0].value[1][1]  # tenants[0].limits
    assert PolicyTree(document.root).parts_to(limits) == ["tenants", 0, "limits"]


@pytest.mark.parametrize(
    "path",
    ["tenants[globex].limits.rpm", "tenants[9].limits", "classes.platinum.slo"],
    ids=["an unknown name", "an index past the list", "an unknown key"],
)
def test_a_written_path_the_file_does_not_have_is_written_back_as_it_was(path: str) -> None:
    found, rest = tree().walk(tree().parts(path))
    assert rest
    assert tree().render(found, rest) == path
