"""What every member of every registered dialect is, pinned: the function, the constant or the method.

Recorded from the dialects before their OpenAI defaults moved to one base (issue 29, step 5:
``gateway/dialects/defaults.py``) and unchanged by the move, so it proves the move changed no
member of any dialect: a shared function or constant must be that very object (``is``), a scalar
that value, and a method the one a dialect class defines, bound to the dialect (by its qualified
name: ``WholeAnswerOnly.output_field`` is the one no-output dialects share). The table says
where each member comes from, so it reads as the map of what a dialect states and what it
shares; a dialect that changes a member on purpose changes its row here, and a new dialect or a
new protocol member adds its entries (the first two tests fail until it does).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MethodType
from typing import Any

import pytest

from gateway import errors
from gateway.dialects import (
    chat,
    completions,
    count_tokens,
    embeddings,
    messages,
    openai_answers,
    rerank,
    responses,
    tokenize,
)
from gateway.dialects.base import Dialect
from gateway.dialects.messages import MESSAGES
from gateway.dialects.registry import DIALECTS
from gateway.request.output_length import OUTPUT_LENGTH_FIELDS
from gateway.upstream import errors as upstream_errors
from tests.dialects.test_base import protocol_members


@dataclass(frozen=True)
class Method:
    """A method a dialect class defines (``qualname``), read as bound to the dialect itself."""

    qualname: str


EXPECTED: dict[str, dict[str, Any]] = {
    "chat": {
        "name": "chat",
        "path": "/v1/chat/completions",
        "operation": "chat",
        "fields": chat.FIELDS,
        "prompt_field": "messages",
        "output_aliases": OUTPUT_LENGTH_FIELDS,
        "sse_event_names": False,
        "ends_with_done": True,
        "keeps_state": False,
        "error_event": errors.sse_error_event,
        "error_body": openai_answers.openai_error_body,
        "serves": openai_answers.serves_chat,
        "translation": openai_answers.no_translation,
        "answer_id": openai_answers.no_answer_id,
        "previous_id": openai_answers.no_previous_id,
        "output_field": Method("ChatDialect.output_field"),
        "screen": Method("ChatDialect.screen"),
        "stream_flags": Method("ChatDialect.stream_flags"),
        "prompt_tokens": Method("ChatDialect.prompt_tokens"),
        "render": Method("ChatDialect.render"),
        "stream_usage_fields": openai_answers.stream_usage_fields,
        "read_chunk": openai_answers.read_choices_chunk,
        "is_answer": upstream_errors.is_openai_answer,
        "answer_usage": openai_answers.answer_usage,
        "can_continue": Method("ChatDialect.can_continue"),
        "continue_body": Method("ChatDialect.continue_body"),
    },
    "completions": {
        "name": "completions",
        "path": "/v1/completions",
        "operation": "text_completion",
        "fields": completions.FIELDS,
        "prompt_field": "prompt",
        "output_aliases": OUTPUT_LENGTH_FIELDS,
        "sse_event_names": False,
        "ends_with_done": True,
        "keeps_state": False,
        "error_event": errors.sse_error_event,
        "error_body": openai_answers.openai_error_body,
        "serves": openai_answers.serves_completions,
        "translation": openai_answers.no_translation,
        "answer_id": openai_answers.no_answer_id,
        "previous_id": openai_answers.no_previous_id,
        "output_field": Method("CompletionsDialect.output_field"),
        "screen": Method("CompletionsDialect.screen"),
        "stream_flags": Method("CompletionsDialect.stream_flags"),
        "prompt_tokens": Method("CompletionsDialect.prompt_tokens"),
        "render": Method("CompletionsDialect.render"),
        "stream_usage_fields": openai_answers.stream_usage_fields,
        "read_chunk": openai_answers.read_choices_chunk,
        "is_answer": upstream_errors.is_openai_answer,
        "answer_usage": openai_answers.answer_usage,
        "can_continue": Method("CompletionsDialect.can_continue"),
        "continue_body": Method("CompletionsDialect.continue_body"),
    },
    "embeddings": {
        "name": "embeddings",
        "path": "/v1/embeddings",
        "operation": "embeddings",
        "fields": embeddings.FIELDS,
        "prompt_field": "input",
        "output_aliases": (),
        "sse_event_names": False,
        "ends_with_done": True,
        "keeps_state": False,
        "error_event": errors.sse_error_event,
        "error_body": openai_answers.openai_error_body,
        "serves": openai_answers.serves_embeddings,
        "translation": openai_answers.no_translation,
        "answer_id": openai_answers.no_answer_id,
        "previous_id": openai_answers.no_previous_id,
        "output_field": Method("EmbeddingsDialect.output_field"),
        "screen": Method("EmbeddingsDialect.screen"),
        "stream_flags": Method("EmbeddingsDialect.stream_flags"),
        "prompt_tokens": Method("EmbeddingsDialect.prompt_tokens"),
        "render": Method("EmbeddingsDialect.render"),
        "stream_usage_fields": Method("EmbeddingsDialect.stream_usage_fields"),
        "read_chunk": openai_answers.read_choices_chunk,
        "is_answer": upstream_errors.is_openai_answer,
        "answer_usage": openai_answers.answer_usage,
        "can_continue": Method("EmbeddingsDialect.can_continue"),
        "continue_body": Method("EmbeddingsDialect.continue_body"),
    },
    "responses": {
        "name": "responses",
        "path": "/v1/responses",
        "operation": "chat",
        "fields": responses.FIELDS,
        "prompt_field": "input",
        "output_aliases": responses.OUTPUT_ALIASES,
        "sse_event_names": True,
        "ends_with_done": False,
        "keeps_state": True,
        "error_event": Method("ResponsesDialect.error_event"),
        "error_body": openai_answers.openai_error_body,
        "serves": openai_answers.serves_responses,
        "translation": openai_answers.no_translation,
        "answer_id": Method("ResponsesDialect.answer_id"),
        "previous_id": Method("ResponsesDialect.previous_id"),
        "output_field": Method("ResponsesDialect.output_field"),
        "screen": Method("ResponsesDialect.screen"),
        "stream_flags": Method("ResponsesDialect.stream_flags"),
        "prompt_tokens": Method("ResponsesDialect.prompt_tokens"),
        "render": Method("ResponsesDialect.render"),
        "stream_usage_fields": Method("ResponsesDialect.stream_usage_fields"),
        "read_chunk": Method("ResponsesDialect.read_chunk"),
        "is_answer": Method("ResponsesDialect.is_answer"),
        "answer_usage": Method("ResponsesDialect.answer_usage"),
        "can_continue": Method("ResponsesDialect.can_continue"),
        "continue_body": Method("ResponsesDialect.continue_body"),
    },
    "messages": {
        "name": "messages",
        "path": "/v1/messages",
        "operation": "chat",
        "fields": messages.FIELDS,
        "prompt_field": "messages",
        "output_aliases": messages.OUTPUT_ALIASES,
        "sse_event_names": True,
        "ends_with_done": False,
        "keeps_state": False,
        "error_event": Method("MessagesDialect.error_event"),
        "error_body": Method("MessagesDialect.error_body"),
        "serves": openai_answers.serves_chat,
        "translation": Method("MessagesDialect.translation"),
        "answer_id": openai_answers.no_answer_id,
        "previous_id": openai_answers.no_previous_id,
        "output_field": Method("MessagesDialect.output_field"),
        "screen": Method("MessagesDialect.screen"),
        "stream_flags": Method("MessagesDialect.stream_flags"),
        "prompt_tokens": Method("MessagesDialect.prompt_tokens"),
        "render": Method("MessagesDialect.render"),
        "stream_usage_fields": Method("MessagesDialect.stream_usage_fields"),
        "read_chunk": Method("MessagesDialect.read_chunk"),
        "is_answer": Method("MessagesDialect.is_answer"),
        "answer_usage": Method("MessagesDialect.answer_usage"),
        "can_continue": Method("MessagesDialect.can_continue"),
        "continue_body": Method("MessagesDialect.continue_body"),
    },
    "count_tokens": {
        "name": "count_tokens",
        "path": "/v1/messages/count_tokens",
        "operation": "count_tokens",
        "fields": count_tokens.COUNT_TOKENS_FIELDS,
        "prompt_field": "messages",
        "output_aliases": (),
        "sse_event_names": False,
        "ends_with_done": True,
        "keeps_state": False,
        "error_event": MESSAGES.error_event,
        "error_body": MESSAGES.error_body,
        "serves": count_tokens.serves_counting,
        "translation": openai_answers.no_translation,
        "answer_id": openai_answers.no_answer_id,
        "previous_id": openai_answers.no_previous_id,
        "output_field": Method("WholeAnswerOnly.output_field"),
        "screen": Method("CountTokensDialect.screen"),
        "stream_flags": Method("CountTokensDialect.stream_flags"),
        "prompt_tokens": Method("CountTokensDialect.prompt_tokens"),
        "render": Method("CountTokensDialect.render"),
        "stream_usage_fields": Method("WholeAnswerOnly.stream_usage_fields"),
        "read_chunk": openai_answers.read_choices_chunk,
        "is_answer": Method("CountTokensDialect.is_answer"),
        "answer_usage": Method("CountTokensDialect.answer_usage"),
        "can_continue": Method("WholeAnswerOnly.can_continue"),
        "continue_body": Method("WholeAnswerOnly.continue_body"),
    },
    "tokenize": {
        "name": "tokenize",
        "path": "/tokenize",
        "operation": "tokenize",
        "fields": tokenize.TOKENIZE_FIELDS,
        "prompt_field": "prompt",
        "output_aliases": (),
        "sse_event_names": False,
        "ends_with_done": True,
        "keeps_state": False,
        "error_event": errors.sse_error_event,
        "error_body": openai_answers.openai_error_body,
        "serves": tokenize.serves_tokenizer,
        "translation": openai_answers.no_translation,
        "answer_id": openai_answers.no_answer_id,
        "previous_id": openai_answers.no_previous_id,
        "output_field": Method("WholeAnswerOnly.output_field"),
        "screen": Method("TokenizeDialect.screen"),
        "stream_flags": Method("TokenizeDialect.stream_flags"),
        "prompt_tokens": Method("TokenizeDialect.prompt_tokens"),
        "render": Method("TokenizeDialect.render"),
        "stream_usage_fields": Method("WholeAnswerOnly.stream_usage_fields"),
        "read_chunk": openai_answers.read_choices_chunk,
        "is_answer": Method("TokenizeDialect.is_answer"),
        "answer_usage": Method("TokenizeDialect.answer_usage"),
        "can_continue": Method("WholeAnswerOnly.can_continue"),
        "continue_body": Method("WholeAnswerOnly.continue_body"),
    },
    "detokenize": {
        "name": "detokenize",
        "path": "/detokenize",
        "operation": "detokenize",
        "fields": tokenize.DETOKENIZE_FIELDS,
        "prompt_field": "tokens",
        "output_aliases": (),
        "sse_event_names": False,
        "ends_with_done": True,
        "keeps_state": False,
        "error_event": errors.sse_error_event,
        "error_body": openai_answers.openai_error_body,
        "serves": tokenize.serves_tokenizer,
        "translation": openai_answers.no_translation,
        "answer_id": openai_answers.no_answer_id,
        "previous_id": openai_answers.no_previous_id,
        "output_field": Method("WholeAnswerOnly.output_field"),
        "screen": Method("DetokenizeDialect.screen"),
        "stream_flags": Method("DetokenizeDialect.stream_flags"),
        "prompt_tokens": Method("DetokenizeDialect.prompt_tokens"),
        "render": Method("DetokenizeDialect.render"),
        "stream_usage_fields": Method("WholeAnswerOnly.stream_usage_fields"),
        "read_chunk": openai_answers.read_choices_chunk,
        "is_answer": Method("DetokenizeDialect.is_answer"),
        "answer_usage": Method("DetokenizeDialect.answer_usage"),
        "can_continue": Method("WholeAnswerOnly.can_continue"),
        "continue_body": Method("WholeAnswerOnly.continue_body"),
    },
    "rerank": {
        "name": "rerank",
        "path": "/v1/rerank",
        "operation": "rerank",
        "fields": rerank.RERANK_FIELDS,
        "prompt_field": "query",
        "output_aliases": (),
        "sse_event_names": False,
        "ends_with_done": True,
        "keeps_state": False,
        "error_event": errors.sse_error_event,
        "error_body": openai_answers.openai_error_body,
        "serves": rerank._serves_rerank,
        "translation": openai_answers.no_translation,
        "answer_id": openai_answers.no_answer_id,
        "previous_id": openai_answers.no_previous_id,
        "output_field": Method("WholeAnswerOnly.output_field"),
        "screen": Method("RerankDialect.screen"),
        "stream_flags": Method("RerankDialect.stream_flags"),
        "prompt_tokens": Method("RerankDialect.prompt_tokens"),
        "render": Method("RerankDialect.render"),
        "stream_usage_fields": Method("WholeAnswerOnly.stream_usage_fields"),
        "read_chunk": openai_answers.read_choices_chunk,
        "is_answer": Method("RerankDialect.is_answer"),
        "answer_usage": rerank.pooling_usage,
        "can_continue": Method("WholeAnswerOnly.can_continue"),
        "continue_body": Method("WholeAnswerOnly.continue_body"),
    },
    "score": {
        "name": "score",
        "path": "/v1/score",
        "operation": "score",
        "fields": rerank.SCORE_FIELDS,
        "prompt_field": "queries",
        "output_aliases": (),
        "sse_event_names": False,
        "ends_with_done": True,
        "keeps_state": False,
        "error_event": errors.sse_error_event,
        "error_body": openai_answers.openai_error_body,
        "serves": rerank._serves_score,
        "translation": openai_answers.no_translation,
        "answer_id": openai_answers.no_answer_id,
        "previous_id": openai_answers.no_previous_id,
        "output_field": Method("WholeAnswerOnly.output_field"),
        "screen": Method("ScoreDialect.screen"),
        "stream_flags": Method("ScoreDialect.stream_flags"),
        "prompt_tokens": Method("ScoreDialect.prompt_tokens"),
        "render": Method("ScoreDialect.render"),
        "stream_usage_fields": Method("WholeAnswerOnly.stream_usage_fields"),
        "read_chunk": openai_answers.read_choices_chunk,
        "is_answer": Method("ScoreDialect.is_answer"),
        "answer_usage": rerank.pooling_usage,
        "can_continue": Method("WholeAnswerOnly.can_continue"),
        "continue_body": Method("WholeAnswerOnly.continue_body"),
    },
}


MEMBERS = sorted(protocol_members(Dialect))


def test_the_table_has_a_row_for_every_registered_dialect() -> None:
    assert sorted(EXPECTED) == sorted(dialect.name for dialect in DIALECTS.values())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_row_names_every_member_of_the_protocol_and_nothing_else(name: str) -> None:
    assert sorted(EXPECTED[name]) == MEMBERS


@pytest.mark.parametrize(
    ("dialect", "member"),
    [(dialect, member) for dialect in DIALECTS.values() for member in MEMBERS],
    ids=lambda value: value if isinstance(value, str) else value.name,
)
def test_every_member_is_what_the_table_says(dialect: Dialect, member: str) -> None:
    expected = EXPECTED[dialect.name][member]
    actual = getattr(dialect, member)
    if isinstance(expected, Method):
        assert isinstance(actual, MethodType), f"{dialect.name}.{member} is {actual!r}, not a method"
        assert actual.__self__ is dialect
        assert actual.__func__.__qualname__ == expected.qualname
    elif isinstance(expected, MethodType):  # another dialect's method, shared (count_tokens' errors are Messages')
        assert actual == expected
    elif isinstance(expected, bool | str) or expected == ():
        assert type(actual) is type(expected)
        assert actual == expected
    else:  # a shared function or constant: that very object
        assert actual is expected, f"{dialect.name}.{member} is {actual!r}, not {expected!r}"
