"""The token ids a request reaches vLLM with (``gateway/request/engine_tokens.py``).

With the byte-level tokenizer (``loadtests/harness/tokenizers.py``: a text's ids are its UTF-8
bytes, ``<|im_start|>`` 256, ``<|im_end|>`` 257, BOS ``<s>`` 258) and the simulator's ChatML
template, the expected ids are written out by hand: ``chatml`` below.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from gateway.kv_events.engine_hashes import EngineBlockHasher, EngineHashing
from gateway.request.chat_template import ChatTemplate
from gateway.request.engine_tokens import EngineTokenizer, engine_prompt_ids
from loadtests.harness.tokenizers import BOS_ID, IM_END_ID, IM_START_ID, byte_level_tokenizer, write_tokenizer

CHATML = Path(__file__).resolve().parents[2] / "loadtests" / "sim" / "chat_template.jinja"
NEWLINE = 10


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate.from_file(CHATML)


def text(value: str) -> list[int]:
    return list(value.encode("utf-8"))


def chatml(*turns: tuple[str, str], generation_prompt: bool = True) -> list[int]:
    ids: list[int] = []
    for role, content in turns:
        ids += [IM_START_ID, *text(f"{role}\n{content}"), IM_END_ID, NEWLINE]
    if generation_prompt:
        ids += [IM_START_ID, *text("assistant\n")]
    return ids


def chat(body: dict[str, Any], tokenizer: Tokenizer, template: ChatTemplate | None) -> list[int] | None:
    return engine_prompt_ids(body, "chat", tokenizer, template)


def test_a_chat_is_rendered_then_tokenized_without_special_tokens(tokenizer: Tokenizer, template: ChatTemplate) -> None:
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo"}]}
    assert chat(body, tokenizer, template) == chatml(("system", "Be brief."), ("user", "Héllo"))


def test_add_special_tokens_and_add_generation_prompt_are_the_requests(
    tokenizer: Tokenizer, template: ChatTemplate
) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert chat({"messages": messages, "add_special_tokens": True}, tokenizer, template) == [
        BOS_ID,
        *chatml(("user", "Hi")),
    ]
    assert chat({"messages": messages, "add_generation_prompt": False}, tokenizer, template) == chatml(
        ("user", "Hi"), generation_prompt=False
    )


def test_text_parts_are_joined_with_newlines_for_a_string_template(
    tokenizer: Tokenizer, template: ChatTemplate
) -> None:
    content = [
        {"type": "text", "text": "one"},
        {"type": "text", "text": None},
        "two",
        {"type": "input_text", "text": "3"},
    ]
    body = {"messages": [{"role": "user", "content": content}]}
    assert chat(body, tokenizer, template) == chatml(("user", "one\ntwo\n3"))


def test_parts_stay_parts_for_a_template_that_loops_over_content(tokenizer: Tokenizer) -> None:
    template = ChatTemplate(
        "{% for m in messages %}{{ m.role }}:"
        "{% for p in m['content'] %}<{{ p.type }}={{ p.text }}>{% endfor %};{% endfor %}"
    )
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, "b"]},
            {"role": "user", "content": "c"},
        ]
    }
    assert chat(body, tokenizer, template) == text("user:<text=a><text=b>;user:<text=c>;")


def test_tools_and_tool_calls_reach_the_template_as_vllm_shapes_them(
    tokenizer: Tokenizer, template: ChatTemplate
) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    body = {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call], "ignored": "x"},
            {
                "role": "tool",
                "tool_call_id": "c1",
                "content": [{"type": "text", "text": "5"}, {"type": "text", "text": "C"}],
            },
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "strict": True}}],
    }
    original = copy.deepcopy(body)
    tools = (
        '{"type": "function", "function": {"name": "weather", "description": null, "parameters": null, "strict": true}}'
    )
    assert chat(body, tokenizer, template) == [
        IM_START_ID,
        *text(f"system\n# Tools\n{tools}\n"),
        IM_END_ID,
        NEWLINE,
        *chatml(("user", "Weather?")),
        *text('\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
        IM_END_ID,
        NEWLINE,
        *chatml(("tool", "5\nC")),
    ]
    assert body == original


def test_arguments_that_are_not_json_become_an_empty_object(tokenizer: Tokenizer, template: ChatTemplate) -> None:
    call = {"type": "function", "function": {"name": "f", "arguments": "not json"}}
    body = {"messages": [{"role": "assistant", "content": "ok", "tool_calls": [call]}], "add_generation_prompt": False}
    ids = chat(body, tokenizer, template)
    assert ids is not None
    assert bytes(i for i in ids if i < 256).decode().count('"arguments": {}') == 1


def test_template_kwargs_reasoning_effort_and_documents(tokenizer: Tokenizer) -> None:
    template = ChatTemplate(
        "{{ mode }}|{{ enable_thinking }}|{{ reasoning_effort }}|{{ documents | length }}|{{ add_generation_prompt }}"
    )
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": {"mode": "m", "add_generation_prompt": False},
        "reasoning_effort": "low",
        "documents": [{"title": "t", "text": "d"}],
    }
    assert chat(body, tokenizer, template) == text("m|True|low|1|True")
    body["chat_template_kwargs"] = {"enable_thinking": False}
    body["reasoning_effort"] = "none"
    assert chat(body, tokenizer, template) == text("|False|none|1|True")


def test_a_completion_prompt_is_encoded_with_special_tokens(tokenizer: Tokenizer) -> None:
    assert engine_prompt_ids({"prompt": "Once"}, "completions", tokenizer, None) == [BOS_ID, *text("Once")]
    body = {"prompt": "Once", "add_special_tokens": False}
    assert engine_prompt_ids(body, "completions", tokenizer, None) == text("Once")
    assert engine_prompt_ids({"prompt": [5, 6, 258]}, "completions", tokenizer, None) == [5, 6, 258]


def test_a_model_tokenizer_may_carry_its_template(tokenizer: Tokenizer, template: ChatTemplate, tmp_path: Path) -> None:
    loaded = Tokenizer.from_file(str(write_tokenizer(tmp_path)))
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    assert engine_prompt_ids(body, "chat", EngineTokenizer(loaded, template)) == chatml(("user", "Hi"))
    assert engine_prompt_ids(body, "chat", EngineTokenizer(loaded)) is None


@pytest.mark.parametrize(
    ("api", "body", "with_template"),
    [
        ("completions", {"prompt": ["a", "b"]}, True),
        ("completions", {"prompt": [[1, 2], [3]]}, True),
        ("completions", {"prompt": [1, True]}, True),
        ("completions", {"prompt": []}, True),
        ("completions", {"prompt": "a", "prompt_embeds": "AAAA"}, True),
        ("completions", {"prompt": "a", "add_special_tokens": "yes"}, True),
        ("chat", {"messages": [{"role": "user", "content": "x"}]}, False),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}, True),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "uuid": "u"}]}]}, True),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, True),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages }}"}, True),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "truncate_prompt_tokens": 4}, True),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": []}, True),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": True}}, True),
        ("chat", {"messages": [{"role": "user", "content": {"text": "x"}}]}, True),
        ("chat", {"messages": ["x"]}, True),
        ("chat", {"messages": "x"}, True),
        ("embeddings", {"input": "x"}, True),
    ],
    ids=[
        "a list of prompts",
        "a list of token lists",
        "a boolean among token ids",
        "an empty token list",
        "prompt embeddings",
        "a flag that is not a bool",
        "chat without a template",
        "an image part",
        "a part with a media uuid",
        "continuing the final message",
        "a request's own template",
        "truncation",
        "an empty tools array",
        "a kwarg transformers consumes",
        "content that is an object",
        "a message that is not an object",
        "messages that are not a list",
        "another API",
    ],
)
def test_what_is_not_reproduced_gives_none(
    api: str, body: dict[str, Any], with_template: bool, tokenizer: Tokenizer, template: ChatTemplate
) -> None:
    assert engine_prompt_ids(body, api, tokenizer, template if with_template else None) is None


def test_a_template_that_raises_gives_none(tokenizer: Tokenizer) -> None:
    strict = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}ok")
    assert chat({"messages": [{"role": "system", "content": "x"}]}, tokenizer, strict) is None
    assert chat({"messages": [{"role": "user", "content": "x"}]}, tokenizer, strict) == text("ok")


def test_a_conversations_next_turn_extends_its_block_chain(tokenizer: Tokenizer, template: ChatTemplate) -> None:
    """The point of it all: turn 2's prompt starts with turn 1's, so its engine blocks do too."""
    first = [{"role": "system", "content": "You are a careful assistant. " * 3}, {"role": "user", "content": "Hi"}]
    second = [*first, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "More"}]
    hasher = EngineBlockHasher(EngineHashing(seed="0", block_size=8))
    ids_1 = chat({"messages": first}, tokenizer, template)
    ids_2 = chat({"messages": second}, tokenizer, template)
    assert ids_1 is not None
    assert ids_2 is not None
    chain_1, chain_2 = hasher.block_hashes(ids_1, cache_salt="t"), hasher.block_hashes(ids_2, cache_salt="t")
    assert len(chain_1) == len(ids_1) // 8 >= 10
    assert chain_2[: len(chain_1)] == chain_1
