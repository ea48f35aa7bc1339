"""A model's chat template rendered as transformers renders it (``gateway/request/chat_template.py``).

The ChatML template is the simulator's (``loadtests/sim/chat_template.jinja``); the others are
written here, with the ``tokenizer_config.json`` shapes models publish.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.request.chat_template import ChatTemplate, ChatTemplateError

CHATML = Path(__file__).resolve().parents[2] / "loadtests" / "sim" / "chat_template.jinja"
BOS_TEMPLATE = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def chatml() -> ChatTemplate:
    return ChatTemplate.from_file(CHATML)


def write_config(folder: Path, **config: Any) -> Path:
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def test_chatml_with_the_generation_prompt() -> None:
    assert chatml().render(MESSAGES) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chatml_without_the_generation_prompt() -> None:
    assert chatml().render(MESSAGES, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_chatml_lists_the_tools_as_json_in_a_system_preamble() -> None:
    tools = [{"type": "function", "function": {"name": "weather", "description": "Météo", "parameters": None}}]
    text = chatml().render([{"role": "user", "content": "Hi"}], tools=tools)
    assert text == (
        "<|im_start|>system\n# Tools\n"
        '{"type": "function", "function": {"name": "weather", "description": "Météo", "parameters": null}}\n'
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chatml_writes_an_assistants_tool_calls() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]
    text = chatml().render([{"role": "assistant", "content": "", "tool_calls": calls}], add_generation_prompt=False)
    assert text == (
        "<|im_start|>assistant\n\n<tool_call>\n"
        '{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
    )


def test_tojson_takes_transformers_arguments_and_does_not_escape_html() -> None:
    template = ChatTemplate(
        "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|"
        "{{ messages[0] | tojson(separators=(',', ':'), sort_keys=true) }}"
    )
    text = template.render([{"role": "user", "content": "<b>é</b>"}])
    assert text == (
        '{"role": "user", "content": "<b>é</b>"}|{\n  "role": "user",\n  "content": "<b>é</b>"\n}|'
        '{"content":"<b>é</b>","role":"user"}'
    )


def test_blocks_trim_and_strip_as_transformers_sets_them() -> None:
    template = ChatTemplate(
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    )
    assert template.render(MESSAGES) == "Hi\n"


def test_loop_controls_strftime_now_and_the_generation_tag() -> None:
    template = ChatTemplate(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
        "{% generation %}|{{ strftime_now('%Y') | length }}{% endgeneration %}"
    )
    assert template.render(MESSAGES) == "Be brief.|4"


def test_keyword_arguments_reach_the_template_over_the_special_tokens() -> None:
    template = ChatTemplate(
        "{{ bos_token }}{% if enable_thinking %}think{% endif %}{{ documents | length }}",
        special_tokens={"bos_token": "<s>"},
    )
    assert template.render(MESSAGES, enable_thinking=True, documents=[{"title": "t", "text": "x"}]) == "<s>think1"
    overridden = ChatTemplate("{{ bos_token }}|{{ documents }}|{{ tools }}", special_tokens={"bos_token": "<s>"})
    assert overridden.render(MESSAGES, bos_token="[B]") == "[B]|None|None"


def test_a_tokenizer_config_with_a_string_template_and_string_tokens(tmp_path: Path) -> None:
    path = write_config(tmp_path, chat_template=BOS_TEMPLATE, bos_token="<s>", eos_token="</s>")
    template = ChatTemplate.from_file(path)
    assert (template.bos_token, template.eos_token) == ("<s>", "</s>")
    assert template.render(MESSAGES) == "<s>[system]Be brief.</s>[user]Hi</s>"


def test_a_tokenizer_config_with_added_token_dicts(tmp_path: Path) -> None:
    added = {"__type": "AddedToken", "content": "<|begin|>", "lstrip": False, "normalized": False}
    path = write_config(tmp_path, chat_template=BOS_TEMPLATE, bos_token=added, eos_token={"content": "<|end|>"})
    template = ChatTemplate.from_file(path)
    assert template.render(MESSAGES) == "<|begin|>[system]Be brief.<|end|>[user]Hi<|end|>"


def test_a_tokenizer_config_without_special_tokens_leaves_them_undefined(tmp_path: Path) -> None:
    template = ChatTemplate.from_file(write_config(tmp_path, chat_template=BOS_TEMPLATE, eos_token=None))
    assert template.bos_token is None
    assert template.render(MESSAGES) == "[system]Be brief.[user]Hi"


def test_a_list_of_named_templates_takes_default_and_tool_use_with_tools(tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        chat_template=[
            {"name": "tool_use", "template": "tools:{{ tools | length }}"},
            {"name": "default", "template": "plain"},
        ],
    )
    template = ChatTemplate.from_file(path)
    assert template.render(MESSAGES) == "plain"
    assert template.render(MESSAGES, tools=[{"type": "function", "function": {"name": "f"}}]) == "tools:1"


def test_a_list_without_default_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, chat_template=[{"name": "rag", "template": "x"}])
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config\.json.*'default'"):
        ChatTemplate.from_file(path)


def test_template_files_beside_the_config_win_over_its_key(tmp_path: Path) -> None:
    path = write_config(tmp_path, bos_token="<s>")
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        ChatTemplate.from_file(path)
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}beside", encoding="utf-8")
    assert ChatTemplate.from_file(path).render(MESSAGES) == "<s>beside"
    path = write_config(tmp_path, bos_token="<s>", chat_template="inline")
    assert ChatTemplate.from_file(path).render(MESSAGES) == "<s>beside"
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("tools", encoding="utf-8")
    assert ChatTemplate.from_file(path).render(MESSAGES, tools=[{"type": "function"}]) == "tools"


def test_raise_exception_is_a_chat_template_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "strict.jinja"
    path.write_text(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with user') }}{% endif %}"
    )
    template = ChatTemplate.from_file(path)
    with pytest.raises(ChatTemplateError, match=r"strict\.jinja.*Conversations must start with user"):
        template.render(MESSAGES)
    assert template.render([{"role": "user", "content": "x"}]) == ""


def test_a_template_that_does_not_compile_is_refused_at_load(tmp_path: Path) -> None:
    path = tmp_path / "broken.jinja"
    path.write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ChatTemplateError, match=r"broken\.jinja.*does not compile"):
        ChatTemplate.from_file(path)


def test_unreadable_and_malformed_files_are_chat_template_errors(tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="cannot be read"):
        ChatTemplate.from_file(tmp_path / "missing.jinja")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ChatTemplateError, match="not JSON"):
        ChatTemplate.from_file(tmp_path / "bad.json")
    with pytest.raises(ChatTemplateError, match="bos_token"):
        ChatTemplate.from_file(write_config(tmp_path, chat_template="x", bos_token=7))


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ raise_exception.__globals__['__builtins__'] }}",
        "{{ ''.__class__.__subclasses__() }}",
        "{{ messages.append({'role': 'user'}) }}",
        "{% set m = messages[0] %}{{ m.update({'role': 'x'}) }}",
    ],
    ids=[
        "a class is out of reach",
        "a function's globals are",
        "subclasses are",
        "a list cannot grow",
        "a dict cannot change",
    ],
)
def test_the_sandbox_blocks_internals_and_mutation(source: str) -> None:
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="<string>"):
        ChatTemplate(source).render(messages)
    assert messages == [{"role": "user", "content": "x"}]


def test_an_internal_attribute_reads_as_undefined() -> None:
    """The sandbox answers an unsafe attribute with an undefined value: nothing of it is printed."""
    assert (
        ChatTemplate("{{ raise_exception.__globals__ }}|{{ messages.__class__ is defined }}").render(MESSAGES)
        == "|False"
    )


def test_the_content_format_follows_vllms_detection() -> None:
    assert chatml().content_format() == "string"
    openai = "{% for message in messages %}{% for part in message['content'] %}{{ part.text }}{% endfor %}{% endfor %}"
    assert ChatTemplate(openai).content_format() == "openai"
    aliased = (
        "{% set rest = messages[1:] %}{% for m in rest %}{% for p in m.content | list %}{{ p }}{% endfor %}{% endfor %}"
    )
    assert ChatTemplate(aliased).content_format() == "openai"
    unrelated = "{% for m in messages %}{% for x in other.content %}{% endfor %}{% endfor %}"
    assert ChatTemplate(unrelated).content_format() == "string"
    assert ChatTemplate(openai, content_format="string").content_format() == "string"
