"""The tokenizer estimator (``gateway/request/tokenizer.py``) and the per-model choice (``estimators.py``).

The tokenizers are built here with ``tokenizers`` and saved to ``tmp_path``: a word-level one
(one token a whitespace-separated word, unknown words one ``[UNK]`` each) whose count is known
by eye, and one that truncates and pads, to show the count ignores both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from gateway.dialects.chat import chat_prompt_tokens
from gateway.policy.loader import PolicyError
from gateway.policy.model import MediaTokens
from gateway.request.estimators import Estimators, TokenizerUnavailable, build_estimators
from gateway.request.tokenizer import TokenizerEstimator
from gateway.request.tokens import CharRatioEstimator, TokenEstimator
from gateway.service import parse_policy
from tests.policy_builder import CHAT_MODEL, OTHER_MODEL, build_policy, model

VOCAB = {"[UNK]": 0, "hello": 1, "world": 2, ",": 3, "!": 4}


def word_tokenizer(**enable: int) -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if "truncate" in enable:
        tokenizer.enable_truncation(max_length=enable["truncate"])
    if "pad" in enable:
        tokenizer.enable_padding(length=enable["pad"], pad_id=0, pad_token="[UNK]")
    return tokenizer


def saved(tokenizer: Tokenizer, folder: Path, name: str = "tokenizer.json") -> Path:
    path = folder / name
    tokenizer.save(str(path))
    return path


class CountingTokenizer:
    """A ``Tokenizer`` that counts its ``encode`` calls (the cache's test)."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.calls = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> object:
        self.calls += 1
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def no_truncation(self) -> None:
        self.inner.no_truncation()

    def no_padding(self) -> None:
        self.inner.no_padding()


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        pytest.param("", 0, id="empty text is no token"),
        pytest.param("hello", 1, id="a known word is one token"),
        pytest.param("hello, world!", 4, id="punctuation is a token of its own"),
        pytest.param("zebra quagga", 2, id="unknown words are one unknown token each"),
        pytest.param(" ".join(["hello"] * 300), 300, id="a long text is counted whole"),
    ],
)
def test_the_count_is_the_tokenizer_s_own(tmp_path: Path, text: str, tokens: int) -> None:
    estimator = TokenizerEstimator.from_file(saved(word_tokenizer(), tmp_path))
    assert estimator.count(text) == tokens


def test_truncation_and_padding_saved_in_the_file_do_not_change_the_count(tmp_path: Path) -> None:
    path = saved(word_tokenizer(truncate=3, pad=50), tmp_path)
    estimator = TokenizerEstimator.from_file(path)
    assert estimator.count("hello world hello world hello") == 5  # not capped at 3, not padded to 50
    assert estimator.count("hello") == 1


def test_a_text_seen_before_is_not_tokenized_again() -> None:
    counting = CountingTokenizer(word_tokenizer())
    estimator = TokenizerEstimator(counting, min_cached_chars=1)  # type: ignore[arg-type]
    history = "hello world " * 100
    assert [estimator.count(history), estimator.count(history), estimator.count(history + "!")] == [200, 200, 201]
    assert counting.calls == 2
    assert (estimator.hits, estimator.misses) == (1, 2)


def test_each_turn_of_a_conversation_tokenizes_only_its_new_message() -> None:
    counting = CountingTokenizer(word_tokenizer())
    estimator = TokenizerEstimator(counting, min_cached_chars=1)  # type: ignore[arg-type]
    messages: list[dict[str, object]] = []
    totals = []
    for turn in range(5):
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": f"hello world {turn}"})
        totals.append(chat_prompt_tokens({"messages": messages}, estimator, MediaTokens()))
    assert counting.calls == 5  # one new message a turn; 15 messages were counted in all
    assert totals == [7 * n for n in range(1, 6)]  # each message: 3 tokens and the chat overhead of 4


def test_the_cache_is_bounded_and_forgets_the_least_recently_used_text() -> None:
    counting = CountingTokenizer(word_tokenizer())
    estimator = TokenizerEstimator(counting, max_entries=2, min_cached_chars=1)  # type: ignore[arg-type]
    for text in ("hello", "world", "hello", "hello world"):  # "world" is the least recent when the third comes
        estimator.count(text)
    calls = counting.calls
    estimator.count("hello")
    assert counting.calls == calls  # kept
    estimator.count("world")
    assert counting.calls == calls + 1  # forgotten


def test_short_texts_skip_the_cache() -> None:
    counting = CountingTokenizer(word_tokenizer())
    estimator = TokenizerEstimator(counting, min_cached_chars=64)  # type: ignore[arg-type]
    estimator.count("hello")
    estimator.count("hello")
    assert (counting.calls, estimator.hits, estimator.misses) == (2, 0, 0)


def policy_with(tmp_path: Path, chat_template: str | None = None, **tokenizers: str) -> str:
    """The test policy, written to ``tmp_path``; ``tokenizers`` maps a model to its tokenizer path;
    ``chat_template`` is the chat model's (with its tokenizer)."""
    names = {"chat": CHAT_MODEL, "other": OTHER_MODEL}
    listed = []
    for key, name in names.items():
        entry: dict[str, str] = {"path": tokenizers[key]} if key in tokenizers else {}
        if key == "chat" and chat_template is not None:
            entry["chat_template"] = chat_template
        listed.append(model(name, max_prompt_tokens=64, **({"tokenizer": entry} if entry else {})))
    return build_policy(models=listed)


def test_a_model_with_a_tokenizer_gets_it_and_the_others_the_character_estimate(tmp_path: Path) -> None:
    saved(word_tokenizer(), tmp_path)
    snapshot = parse_policy(policy_with(tmp_path, chat="tokenizer.json"), str(tmp_path / "policy.yaml"))
    estimators = build_estimators(snapshot)
    chat: TokenEstimator = estimators.for_model(CHAT_MODEL)
    assert isinstance(chat, TokenizerEstimator)
    assert isinstance(estimators.for_model(OTHER_MODEL), CharRatioEstimator)
    assert isinstance(estimators.for_model("a-model-added-later"), CharRatioEstimator)
    assert isinstance(Estimators().for_model(CHAT_MODEL), CharRatioEstimator)  # no policy: the default


def test_models_naming_one_file_share_one_tokenizer(tmp_path: Path) -> None:
    path = str(saved(word_tokenizer(), tmp_path))
    snapshot = parse_policy(policy_with(tmp_path, chat=path, other=path), str(tmp_path / "policy.yaml"))
    estimators = build_estimators(snapshot)
    assert estimators.for_model(CHAT_MODEL) is estimators.for_model(OTHER_MODEL)


def test_a_relative_path_is_read_from_the_policy_file_s_folder(tmp_path: Path) -> None:
    (tmp_path / "tok").mkdir()
    saved(word_tokenizer(), tmp_path / "tok")
    snapshot = parse_policy(policy_with(tmp_path, chat="tok/tokenizer.json"), str(tmp_path / "policy.yaml"))
    assert build_estimators(snapshot).for_model(CHAT_MODEL).count("hello, world") == 3


def test_a_missing_tokenizer_file_refuses_the_policy_naming_the_model_and_the_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as refused:
        parse_policy(policy_with(tmp_path, other="missing.json"), str(tmp_path / "policy.yaml"))
    (problem,) = refused.value.problems
    assert problem.startswith(f"models[{OTHER_MODEL}].tokenizer.path: cannot load tokenizer")
    assert str(tmp_path / "missing.json") in problem


def test_a_file_that_is_not_a_tokenizer_cannot_be_built_into_estimators(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text('{"not": "a tokenizer"}')
    snapshot = parse_policy(policy_with(tmp_path, chat="broken.json"), str(tmp_path / "policy.yaml"))
    with pytest.raises(TokenizerUnavailable) as refused:
        build_estimators(snapshot)
    (problem,) = refused.value.problems
    assert problem.path == f"models[{CHAT_MODEL}].tokenizer.path"
    assert "broken.json" in problem.message


# The chat template beside the tokenizer (engine-side token ids: gateway/request/engine_tokens.py)

CHATML = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def test_a_model_with_a_chat_template_gets_it_with_its_tokenizer_for_the_engines_ids(tmp_path: Path) -> None:
    saved(word_tokenizer(), tmp_path)
    (tmp_path / "chat.jinja").write_text(CHATML)
    text = policy_with(tmp_path, chat_template="chat.jinja", chat="tokenizer.json", other="tokenizer.json")
    estimators = build_estimators(parse_policy(text, str(tmp_path / "policy.yaml")))
    chat, other = estimators.engine_tokenizers[CHAT_MODEL], estimators.engine_tokenizers[OTHER_MODEL]
    assert chat.template is not None
    assert chat.template.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"
    assert other.template is None  # a tokenizer alone: completions only
    assert chat.tokenizer is other.tokenizer  # one file, one tokenizer


def test_a_missing_chat_template_refuses_the_policy_naming_the_model_and_the_file(tmp_path: Path) -> None:
    saved(word_tokenizer(), tmp_path)
    with pytest.raises(PolicyError) as refused:
        parse_policy(
            policy_with(tmp_path, chat_template="nowhere.jinja", chat="tokenizer.json"), str(tmp_path / "policy.yaml")
        )
    (problem,) = refused.value.problems
    assert problem.startswith(f"models[{CHAT_MODEL}].tokenizer.chat_template: cannot load chat template")


def test_a_chat_template_that_does_not_compile_cannot_be_built_into_estimators(tmp_path: Path) -> None:
    saved(word_tokenizer(), tmp_path)
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m['role'] }")
    text = policy_with(tmp_path, chat_template="broken.jinja", chat="tokenizer.json")
    snapshot = parse_policy(text, str(tmp_path / "policy.yaml"))
    with pytest.raises(TokenizerUnavailable) as refused:
        build_estimators(snapshot)
    (problem,) = refused.value.problems
    assert problem.path == f"models[{CHAT_MODEL}].tokenizer.chat_template"
    assert "broken.jinja" in problem.message
