"""Every policy problem names the file, the line and column, and the entry by name.

The policy is written out (``tests/policy/positions.py``): where a problem is reported is the
subject. Each case edits it by one substitution and names the one line the loader must give for
it; the columns were counted by hand on the edited line (1-based, like an editor's).
"""

from __future__ import annotations

import pytest

from gateway.policy.loader import PolicyError
from gateway.request.keys import hash_api_key
from gateway.service import parse_policy
from tests.policy.positions import SOURCE, edited
from tests.policy_builder import KEY_ACME, KEY_GLOBEX


def refusal(text: str) -> list[str]:
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, SOURCE)
    return str(caught.value).splitlines()


REFUSED = [
    pytest.param(
        edited("{rpm: 60,", "{rpm: 0,"),
        "32:19: tenants[acme].limits.rpm: must be greater than 0",
        id="a bad value is placed on the value and its tenant is named",
    ),
    pytest.param(
        edited("    limits: {rpm", "    limts: {rpm"),
        "32:5: tenants[acme].limts: unknown key; did you mean 'limits'?",
        id="an unknown key is placed on the key, with the closest valid one",
    ),
    pytest.param(
        edited("max_concurrent: 4}", "max_concurrent: 4, burst: 8}"),
        "32:55: tenants[acme].limits.burst: unknown key (valid keys: rpm, tpm, max_concurrent)",
        id="an unknown key close to none lists the few valid ones",
    ),
    pytest.param(
        edited("model_groups:", "model_group:"),
        "23:1: model_group: unknown key; did you mean 'model_groups'?",
        id="a misspelt section is placed at its key, with the section meant",
    ),
    pytest.param(
        edited("    kind: vllm\n", ""),
        "19:5: backends[gpu-a].kind: is required",
        id="a missing key is placed at the entry that lacks it, named",
    ),
    pytest.param(
        edited("      itl_ms: 100\n", ""),
        "8:5: classes.batch.slo.itl_ms: is required",
        id="a missing nested key is placed at the key of the section that lacks it",
    ),
    pytest.param(
        edited("kind: vllm", "kind: tgi"),
        "21:11: backends[gpu-a].kind: must be 'vllm', 'sglang', 'llamacpp', 'openai' or 'sim'",
        id="a value outside its choices is placed on the value and its backend is named",
    ),
    pytest.param(
        edited("  batch:", "  bat ch:"),
        "6:3: classes.bat ch: the key must match pattern '^[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}$'",
        id="a bad name used as a key is placed on the key",
    ),
    pytest.param(
        edited("default_class: batch", "default_class: gold"),
        "36:20: tenants[globex].default_class: unknown class 'gold'",
        id="a cross-check names the tenant and places the value",
    ),
    pytest.param(
        edited("fallbacks: [big]", "fallbacks: [ghost]"),
        "26:17: model_groups[assistant].fallbacks[0]: unknown model 'ghost' (declare it under models)",
        id="a cross-check names the model group and places the list item",
    ),
    pytest.param(
        edited("  - name: big\n", "  - name: big\n  - name: big\n"),
        "17:11: models[3].name: duplicate name 'big'",
        id="an entry whose name is not unique is named by its index",
    ),
    pytest.param(
        edited("{strategy: prefix_affinity}", "{strategy: random}"),
        "17:25: models[big].routing.strategy: unknown strategy 'random' (known: ",
        id="a routing problem names the model and places the value",
    ),
    pytest.param(
        edited("    fallbacks: [big]\n", "    fallbacks: [big]\n    shadow: {model: big, percent: 5, scorer: vibes}\n"),
        "27:46: model_groups[assistant].shadow.scorer: unknown scorer 'vibes' (known: ",
        id="a shadow scorer problem names the model group and places the value",
    ),
    pytest.param(
        edited(
            "    models: [chat-v1, chat-v2, big]\n",
            "    models: [chat-v1, chat-v2, big]\n    tenants: [acme, initech]\n",
        ),
        "23:21: backends[gpu-a].tenants[1]: unknown tenant 'initech'",
        id="an isolation problem names the backend and places the list item",
    ),
    pytest.param(
        edited(
            "    limits: {rpm: 60, tpm: 100000, max_concurrent: 4}\n",
            "    limits: {rpm: 60}\n    limits: {rpm: 600000}\n",
        ),
        "33:5: tenants[acme].limits: duplicate key, first at line 32, column 5",
        id="a key written twice is placed on the second, naming the first",
    ),
]


@pytest.mark.parametrize(("text", "line"), REFUSED)
def test_a_policy_problem_names_its_file_line_column_and_entry(text: str, line: str) -> None:
    (reported,) = refusal(text)
    assert reported.startswith(f"{SOURCE}:{line}"), reported


def test_every_problem_is_reported_at_once_each_on_its_line() -> None:
    text = (
        edited("{rpm: 60,", "{rpm: 0,").replace("kind: vllm", "kind: tgi").replace("limits: {", "limits: {burst: 1, ")
    )
    assert refusal(text) == [
        f"{SOURCE}:21:11: backends[gpu-a].kind: must be 'vllm', 'sglang', 'llamacpp', 'openai' or 'sim'",
        f"{SOURCE}:32:29: tenants[acme].limits.rpm: must be greater than 0",
        f"{SOURCE}:32:14: tenants[acme].limits.burst: unknown key (valid keys: rpm, tpm, max_concurrent)",
    ]


def test_the_problems_list_keeps_the_path_and_message_and_the_details_their_position() -> None:
    with pytest.raises(PolicyError) as caught:
        parse_policy(edited("default_class: batch", "default_class: gold"), SOURCE)
    assert caught.value.problems == ["tenants[globex].default_class: unknown class 'gold'"]
    (detail,) = caught.value.details
    assert (detail.path, detail.line, detail.column) == ("tenants[globex].default_class", 36, 20)


def test_a_warning_names_its_file_line_column_and_entry() -> None:
    text = edited("kind: vllm", "kind: llamacpp").replace("models: [assistant]", 'models: ["*"]')
    (warning,) = parse_policy(text, SOURCE).warnings
    prefix = f"{SOURCE}:19:5: warning: backends[gpu-a]: 'gpu-a' (llamacpp) cannot salt its prefix cache"
    assert warning.startswith(prefix), warning


@pytest.mark.parametrize(
    ("text", "line"),
    [
        pytest.param("version: [\n", "2:1: not valid YAML: expected the node content", id="broken YAML at its mark"),
        pytest.param("- a\n- b\n", "1:1: the top level must be a mapping", id="a list at its start"),
        pytest.param("", "1:1: the top level must be a mapping", id="an empty text at its start"),
    ],
)
def test_a_text_that_is_no_policy_is_placed_too(text: str, line: str) -> None:
    (reported,) = refusal(text)
    assert reported.startswith(f"{SOURCE}:{line}"), reported


MERGED = """\
version: merged-1
classes:
  interactive: &interactive
    rank: 0
    slo: &slo {ttft_ms: 500, itl_ms: 30, e2e_ms: 60000}
  batch:
    <<: *interactive
    rank: 1
    slo: {<<: *slo, ttft_ms: 5000}
models:
  - &model {name: chat, max_output_tokens: 64}
  - {<<: *model, name: other}
backends:
  - {name: gpu-a, url: "http://127.0.0.1:1", kind: vllm, models: [chat, other]}
tenants:
  - &tenant
    name: acme
    key_hashes: [KEY]
    models: ["*"]
    default_class: interactive
    limits: {rpm: 60}
  - {<<: *tenant, name: globex, key_hashes: [KEY2], limits: {rpm: 5}}
"""


def merged(old: str = "", new: str = "") -> str:
    text = MERGED.replace("KEY2", hash_api_key(KEY_GLOBEX)).replace("KEY", hash_api_key(KEY_ACME))
    assert not old or text.count(old) == 1, old
    return text.replace(old, new) if old else text


def test_merge_keys_and_aliases_work_as_yaml_defines_them() -> None:
    policy = parse_policy(merged(), SOURCE).policy
    batch = policy.classes["batch"]
    assert (batch.rank, batch.slo.ttft_ms, batch.slo.itl_ms, batch.slo.e2e_ms) == (1, 5000, 30, 60000)
    assert [(m.name, m.max_output_tokens) for m in policy.models] == [("chat", 64), ("other", 64)]
    assert [(t.name, t.default_class, t.limits.rpm) for t in policy.tenants] == [
        ("acme", "interactive", 60),
        ("globex", "interactive", 5),
    ]


def test_a_problem_in_a_merged_value_is_placed_where_it_is_written_and_named_by_each_entry() -> None:
    assert refusal(merged("default_class: interactive", "default_class: gold")) == [
        f"{SOURCE}:20:20: tenants[acme].default_class: unknown class 'gold'",
        f"{SOURCE}:20:20: tenants[globex].default_class: unknown class 'gold'",
    ]


def test_a_merge_key_written_twice_in_one_mapping_is_a_duplicate() -> None:
    (reported,) = refusal(merged("    rank: 1\n", "    <<: *interactive\n"))
    assert reported.startswith(f"{SOURCE}:8:5: classes.batch.<<: duplicate key, first at line 7, column 5"), reported
