"""The ``Dialect`` protocol's contracts, checked on every registered dialect with its own samples.

One suite over ``DIALECTS`` (as ``tests/limitstore/test_limit_store.py`` runs one over every
``LimitStore``): a new API passes it with its samples (``tests/dialects/samples.py``) or is not
done. Real parts throughout: the policy loader, ``build_request``, the prefix-key chain and the
SSE relay the request path uses.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from starlette.types import Message

from gateway.admission.build import build_request
from gateway.dialects.allowlists import NO_GRANTS
from gateway.dialects.base import Dialect
from gateway.dialects.registry import DIALECTS, register_dialect
from gateway.errors import InvalidRequest
from gateway.pipeline.relay import SseRelay, StreamEnd, TokenTimer
from gateway.policy.body_names import OWNED_FIELDS
from gateway.policy.model import BackendKind, RequestLimits
from gateway.policy.snapshot import PolicySnapshot
from gateway.request.tokens import CharRatioEstimator
from gateway.routing.prefix_keys import prefix_keys
from gateway.service import parse_policy
from gateway.types import InferenceRequest
from tests.dialects.samples import MODEL, SAMPLES, Body, DialectSamples
from tests.fake_clock import FakeClock
from tests.routing.conftest import SECRET, routing_policy, tenant

# The well-known values of gen_ai.operation.name (OpenTelemetry GenAI semantic conventions).
GENAI_OPERATIONS = {
    "chat", "create_agent", "embeddings", "execute_tool", "generate_content", "invoke_agent", "text_completion",
}  # fmt: skip
# "If one of them applies, then that value MUST be used. Otherwise a custom value MAY be used":
# the engines' own endpoints, which no well-known value describes, are named by their operation.
CUSTOM_OPERATIONS = {"tokenize", "detokenize", "rerank", "score", "count_tokens"}
ROOT_PATHS = {"/tokenize", "/detokenize"}
"""The engine endpoints vLLM serves at the root, not under ``/v1/``."""
WORDS = "The quick brown fox jumps over the lazy dog. "

dialects = pytest.mark.parametrize("dialect", list(DIALECTS.values()), ids=lambda d: d.name)


@pytest.fixture(scope="module")
def snapshot() -> PolicySnapshot:
    return parse_policy(routing_policy(), "t.yaml")


def samples_of(dialect: Dialect) -> DialectSamples:
    found = SAMPLES.get(dialect.name)
    assert found is not None, f"dialect {dialect.name!r} has no samples in tests/dialects/samples.py"
    return found


def accept(dialect: Dialect, body: Body, snapshot: PolicySnapshot, limits: RequestLimits | None = None) -> Any:
    """What the request path does with ``body`` up to admission: screen, then validate."""
    limits = limits or snapshot.policy.limits
    dialect.screen(body, limits, NO_GRANTS)
    return build_request(
        api=dialect,
        body=body,
        raw_body=orjson.dumps(body),
        request_id="r",
        arrival=0.0,
        model_policy=snapshot.models[MODEL],
        limits=limits,
        estimator=CharRatioEstimator(),
    )


def refusal(dialect: Dialect, body: Body, snapshot: PolicySnapshot) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        accept(dialect, body, snapshot)
    return caught.value


def estimate(dialect: Dialect, text: str, snapshot: PolicySnapshot) -> int:
    tokens: int = accept(dialect, samples_of(dialect).with_prompt(text), snapshot).prompt_tokens
    return tokens


# --- registration and identity -------------------------------------------------------------


@dialects
def test_every_registered_dialect_has_samples_for_this_suite(dialect: Dialect) -> None:
    samples_of(dialect)


@dialects
def test_a_dialect_is_served_at_its_own_path_under_a_name_no_other_has(dialect: Dialect) -> None:
    assert DIALECTS[dialect.path] is dialect
    assert dialect.path.startswith("/v1/") or dialect.path in ROOT_PATHS
    assert "%" not in dialect.path
    assert [d.name for d in DIALECTS.values()].count(dialect.name) == 1
    assert dialect.name == dialect.name.lower()
    assert dialect.name.isidentifier()


@dialects
def test_its_trace_operation_is_a_genai_operation_name(dialect: Dialect) -> None:
    assert dialect.operation in GENAI_OPERATIONS | CUSTOM_OPERATIONS


def test_a_path_or_a_name_registered_twice_is_refused() -> None:
    chat = DIALECTS["/v1/chat/completions"]
    with pytest.raises(ValueError, match="already registered"):
        register_dialect(chat)
    assert list(DIALECTS.values()).count(chat) == 1


# --- the body ------------------------------------------------------------------------------


@dialects
def test_its_fields_hold_the_model_the_prompt_and_the_aliases_and_never_an_owned_field(dialect: Dialect) -> None:
    assert {"model", dialect.prompt_field, *dialect.output_aliases} <= dialect.fields
    assert not dialect.fields & OWNED_FIELDS


@dialects
@pytest.mark.parametrize("kind", list(BackendKind), ids=lambda k: k.value)
def test_every_backend_kind_gets_the_bound_in_one_of_its_aliases(dialect: Dialect, kind: BackendKind) -> None:
    field = dialect.output_field(kind)
    if dialect.output_aliases:
        assert field in dialect.output_aliases
    else:
        assert field is None


@dialects
def test_a_valid_body_is_accepted_into_a_request_of_that_api(dialect: Dialect, snapshot: PolicySnapshot) -> None:
    body = samples_of(dialect).with_prompt("Hello there")
    assert body.keys() <= dialect.fields
    assert not dialect.screen(copy.deepcopy(body), snapshot.policy.limits, NO_GRANTS), "nothing to drop"
    request = accept(dialect, body, snapshot)
    assert isinstance(request, InferenceRequest)
    assert request.api is dialect
    assert request.prompt_tokens > 0
    model = snapshot.models[MODEL]
    # the body's own bound where the API requires one (Messages' max_tokens), else the model's
    named = [body[alias] for alias in dialect.output_aliases if body.get(alias) is not None]
    assert request.max_tokens == ((named[0] if named else model.max_output_tokens) if dialect.output_aliases else 0)


@dialects
def test_an_unknown_field_is_refused_naming_it(dialect: Dialect, snapshot: PolicySnapshot) -> None:
    error = refusal(dialect, {**samples_of(dialect).with_prompt("Hi"), "no_such_field": 1}, snapshot)
    assert (error.code, error.param) == ("unsupported_field", "no_such_field")
    assert "Unrecognized request argument supplied: no_such_field" in error.message


@dialects
def test_a_field_the_policy_lists_passes(dialect: Dialect, snapshot: PolicySnapshot) -> None:
    # a field the API does not take itself (rerank's and score's own 'documents' is no extra)
    extra = next(name for name in ("documents", "mm_processor_kwargs") if name not in dialect.fields)
    limits = snapshot.policy.limits.model_copy(update={"extra_body_fields": frozenset({extra})})
    body = {**samples_of(dialect).with_prompt("Hi"), extra: [{"title": "t"}]}
    assert accept(dialect, body, snapshot, limits).body[extra] == [{"title": "t"}]


@dialects
def test_an_owned_field_is_dropped_when_the_gateway_sets_it_and_refused_when_it_steers_the_engine(
    dialect: Dialect, snapshot: PolicySnapshot
) -> None:
    body = {**samples_of(dialect).with_prompt("Hi"), "priority": -100}
    assert dialect.screen(body, snapshot.policy.limits, NO_GRANTS), "a field was dropped"
    assert "priority" not in body
    error = refusal(dialect, {**samples_of(dialect).with_prompt("Hi"), "kv_transfer_params": {}}, snapshot)
    assert (error.code, error.param) == ("unsupported_field", "kv_transfer_params")


def _refusals() -> list[Any]:
    return [
        pytest.param(dialect, case, id=f"{dialect.name}: {case.why}")
        for dialect in DIALECTS.values()
        for case in SAMPLES[dialect.name].refused
        if dialect.name in SAMPLES
    ]


@pytest.mark.parametrize(("dialect", "case"), _refusals())
def test_an_invalid_body_gets_a_400_naming_its_field(dialect: Dialect, case: Any, snapshot: PolicySnapshot) -> None:
    error = refusal(dialect, copy.deepcopy(case.body), snapshot)
    assert error.status == 400
    assert (error.code, error.param) == (case.code, case.param)


# --- the estimate --------------------------------------------------------------------------


@dialects
def test_the_estimate_grows_with_the_prompt(dialect: Dialect, snapshot: PolicySnapshot) -> None:
    short, long = estimate(dialect, WORDS, snapshot), estimate(dialect, WORDS * 20, snapshot)
    assert 0 < short < long
    assert long - short >= len(WORDS * 19) // 4, "about four characters a token at least"


@dialects
@pytest.mark.parametrize(
    "text", ["漢字の文章を数える。" * 30, "한국어 문장을 센다. " * 30], ids=["Chinese and Japanese", "Korean"]
)
def test_the_estimate_never_counts_a_cjk_character_as_less_than_a_token(
    dialect: Dialect, text: str, snapshot: PolicySnapshot
) -> None:
    cjk = sum(1 for ch in text if len(ch.encode()) == 3)
    assert estimate(dialect, text, snapshot) >= cjk


# --- prefix keys ---------------------------------------------------------------------------


def keys_of(dialect: Dialect, body: Body, snapshot: PolicySnapshot, tenant_name: str) -> tuple[int, ...]:
    request = accept(dialect, body, snapshot)
    return prefix_keys(request, tenant(snapshot, tenant_name), block_tokens=4, secret=SECRET).blocks


@dialects
def test_two_tenants_identical_prompts_get_unrelated_prefix_keys(dialect: Dialect, snapshot: PolicySnapshot) -> None:
    body = samples_of(dialect).with_prompt(WORDS * 8)
    acme, globex = (keys_of(dialect, copy.deepcopy(body), snapshot, name) for name in ("acme", "globex"))
    assert len(acme) >= 8
    assert not set(acme) & set(globex)
    assert keys_of(dialect, copy.deepcopy(body), snapshot, "acme") == acme, "the same prompt, the same keys"
    shared = (keys_of(dialect, copy.deepcopy(body), snapshot, name) for name in ("shared-a", "shared-b"))
    assert len(set(shared)) == 1, "tenants of one cache scope share keys"


@dialects
def test_a_conversations_next_turn_extends_the_prefix_keys_of_the_previous_one(
    dialect: Dialect, snapshot: PolicySnapshot
) -> None:
    turn, following = samples_of(dialect).turns(WORDS * 4, " Foxes do that. " * 3, "And the dog?")
    first = keys_of(dialect, turn, snapshot, "acme")
    second = keys_of(dialect, following, snapshot, "acme")
    assert len(first) >= 4
    assert len(second) > len(first)
    assert second[: len(first)] == first


# --- the answer ----------------------------------------------------------------------------


class Client:
    """An ASGI ``send`` that keeps what the client got."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def send(self, message: Message) -> None:
        self.messages.append(message)

    @property
    def events(self) -> list[bytes]:
        return b"".join(m["body"] for m in self.messages).split(b"\n\n")[:-1]


async def relay(dialect: Dialect, events: list[Body], *, wants_usage: bool) -> tuple[TokenTimer, Client, StreamEnd]:
    """The events through the request path's relay, the i-th arriving at t = i + 1."""
    clock, client, timer = FakeClock(0.0), Client(), TokenTimer(arrival=0.0)

    async def upstream() -> AsyncIterator[bytes]:
        for i, event in enumerate([*events, "[DONE]"]):
            clock.t = i + 1.0
            yield b"data: " + (event.encode() if isinstance(event, str) else orjson.dumps(event)) + b"\n\n"

    relay = SseRelay(client.send, timer, clock, dialect=dialect, strip_usage=not wants_usage)
    return timer, client, await relay.run(upstream())


@dialects
async def test_a_stream_is_timed_from_its_first_output_and_gives_its_usage_and_finish_reasons(
    dialect: Dialect, snapshot: PolicySnapshot
) -> None:
    samples = samples_of(dialect)
    body = {**samples.with_prompt("Hi"), "stream": True}
    if samples.stream is None:
        error = refusal(dialect, body, snapshot)
        assert (error.code, error.param) == ("invalid_field", "stream")
        return
    assert accept(dialect, body, snapshot).stream
    timer, client, end = await relay(dialect, samples.stream, wants_usage=True)
    assert end is StreamEnd.COMPLETED
    assert timer.first_output == samples.first_output + 1.0
    outputs = sum(dialect.read_chunk(copy.deepcopy(event))[0] for event in samples.stream)
    assert len(timer.gaps) == outputs - 1, "every output event after the first is an inter-token gap"
    assert timer.usage == samples.stream_usage
    assert tuple(timer.finish_reasons) == samples.finish_reasons
    if dialect.ends_with_done:
        assert client.events[-1] == b"data: [DONE]"
    else:  # the API's final event ends the client's stream, as the engine's
        assert b"[DONE]" not in b"".join(client.events)
        assert orjson.loads(client.events[-1].split(b"data: ", 1)[1]) == samples.stream[-1]


@dialects
async def test_a_stream_asks_the_engine_for_usage_with_fields_the_api_accepts(
    dialect: Dialect, snapshot: PolicySnapshot
) -> None:
    samples = samples_of(dialect)
    if samples.stream is None:
        return  # never streamed (the test above checks the refusal)
    body = {**samples.with_prompt("Hi"), "stream": True}
    for per_chunk in (False, True):
        attempt = {**body, **dialect.stream_usage_fields(body, per_chunk)}
        assert accept(dialect, attempt, snapshot).stream
        assert dialect.stream_usage_fields(attempt, per_chunk) == {}, "already asked: nothing more to set"


@dialects
def test_a_whole_answer_is_recognised_and_gives_its_usage(dialect: Dialect) -> None:
    samples = samples_of(dialect)
    assert dialect.is_answer(copy.deepcopy(samples.answer))
    assert not dialect.is_answer({"headers": {"x": "y"}}), "a JSON object that is no answer is the backend's failure"
    assert dialect.answer_usage(copy.deepcopy(samples.answer)) == samples.answer_usage
    assert dialect.answer_usage({}) is None


# --- continuation --------------------------------------------------------------------------


@dialects
def test_a_continuation_is_a_valid_body_whose_prompt_extends_the_original(
    dialect: Dialect, snapshot: PolicySnapshot
) -> None:
    samples = samples_of(dialect)
    body = {**samples.with_prompt(WORDS), **({"stream": True} if samples.stream is not None else {})}
    original = accept(dialect, copy.deepcopy(body), snapshot)
    if not dialect.can_continue(original.body):
        # The relay tracks and splices OpenAI choice chunks only (the streams that end with [DONE]):
        # such an API with a plain text prompt must be continued; a typed-event stream cannot be.
        assert samples.stream is None or not dialect.ends_with_done, "a choice-chunk stream is continued after a break"
        return
    continued = copy.deepcopy(original.body)
    dialect.continue_body(continued, " Foxes are quick.")
    again = accept(dialect, continued, snapshot)
    before, after = dialect.render(original.body), dialect.render(again.body)
    assert isinstance(before, str)
    assert isinstance(after, str)
    assert after.startswith(before)
    assert after.endswith(" Foxes are quick.")
    assert again.prompt_tokens > original.prompt_tokens
