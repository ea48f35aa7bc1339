"""The table of engine kinds (``gateway/engines.py``): complete, right about isolation, and read.

Three things are checked: every ``BackendKind`` has a record with every capability set (a kind
added to the enum and forgotten here fails), the security-relevant facts are stated one by one
(which engines take a ``cache_salt``), and for each capability the code that decides it answers
what the table says, kind by kind (the table is what the gateway uses, not a copy beside it).
"""

from __future__ import annotations

import dataclasses

import pytest

from gateway.dialects.base import Dialect
from gateway.dialects.chat import CHAT
from gateway.dialects.completions import COMPLETIONS
from gateway.dialects.count_tokens import COUNT_TOKENS
from gateway.dialects.embeddings import EMBEDDINGS
from gateway.dialects.messages import MESSAGES
from gateway.dialects.messages_chat import MESSAGES_VIA_CHAT
from gateway.dialects.rerank import RERANK, SCORE
from gateway.dialects.responses import RESPONSES
from gateway.dialects.tokenize import DETOKENIZE, TOKENIZE
from gateway.dispatch.scrape import parse_saturation
from gateway.engines import ENGINES, EngineKind, _check_complete, engine
from gateway.pipeline.migration import can_continue
from gateway.policy.model import Backend, BackendKind, Tenant, UnsaltedMode
from gateway.routing.isolation import CacheSalter, isolates, isolation_fields
from gateway.types import InferenceRequest
from gateway.upstream.body import engine_priority

KINDS = [pytest.param(kind, id=kind.value) for kind in BackendKind]
MODEL = "m"


# --- (1) complete --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_has_a_record_filed_under_its_own_name(kind: BackendKind) -> None:
    assert kind in ENGINES
    assert engine(kind) is ENGINES[kind]
    assert engine(kind).kind is kind


@pytest.mark.parametrize("kind", KINDS)
def test_every_capability_of_every_record_is_set(kind: BackendKind) -> None:
    record = engine(kind)
    unset = [field.name for field in dataclasses.fields(EngineKind) if getattr(record, field.name) is None]
    assert unset == []
    assert all(getattr(record.metrics, f.name) is not None for f in dataclasses.fields(record.metrics))


def test_no_capability_has_a_default_to_forget() -> None:
    defaulted = [
        f.name
        for f in dataclasses.fields(EngineKind)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    ]
    assert defaulted == []


def test_a_kind_without_a_record_is_an_error_not_a_no() -> None:
    with pytest.raises(KeyError, match=r"no record in ENGINES"):
        engine("tgi")  # type: ignore[arg-type]  # a kind the table does not know


def test_a_table_missing_a_kind_is_refused_at_import() -> None:
    partial = {kind: record for kind, record in ENGINES.items() if kind is not BackendKind.SGLANG}
    with pytest.raises(TypeError, match="no record for backend kind"):
        _check_complete(partial)
    misfiled = {**ENGINES, BackendKind.SGLANG: ENGINES[BackendKind.VLLM]}
    with pytest.raises(TypeError, match="describes another kind"):
        _check_complete(misfiled)


# --- (2) the security-relevant facts, one by one --------------------------------------------------


@pytest.mark.parametrize("kind", [BackendKind.VLLM, BackendKind.SGLANG, BackendKind.SIM], ids=lambda k: k.value)
def test_these_engines_take_a_cache_salt(kind: BackendKind) -> None:
    assert engine(kind).salted


@pytest.mark.parametrize("kind", [BackendKind.LLAMACPP, BackendKind.OPENAI], ids=lambda k: k.value)
def test_these_engines_are_not_salted(kind: BackendKind) -> None:
    assert not engine(kind).salted


def test_only_llama_cpp_can_turn_prompt_reuse_off_per_request() -> None:
    assert {kind for kind, record in ENGINES.items() if record.prompt_cache_switch} == {BackendKind.LLAMACPP}


# --- (3) the code reads the table -----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_the_output_bound_field_is_the_record_s(kind: BackendKind) -> None:
    assert CHAT.output_field(kind) == engine(kind).chat_output_field
    assert COMPLETIONS.output_field(kind) == engine(kind).completions_output_field


@pytest.mark.parametrize("mode", [pytest.param(m, id=f"unsalted {m.value}") for m in UnsaltedMode])
@pytest.mark.parametrize("kind", KINDS)
def test_isolation_follows_the_record(kind: BackendKind, mode: UnsaltedMode) -> None:
    record = engine(kind)
    switched_off = record.prompt_cache_switch and mode is UnsaltedMode.NO_PROMPT_CACHE
    assert isolates(kind, mode) is (record.salted or switched_off)
    tenant = Tenant(name="acme", key_hashes=["sha256:" + "0" * 64], models=["*"], default_class="i")
    salter = CacheSalter(b"secret")
    fields = dict(isolation_fields(kind, mode, salter, tenant))
    if record.salted:
        assert fields == {"cache_salt": salter.salt("tenant:acme")}
    elif switched_off:
        assert fields == {"cache_prompt": False}
    else:
        assert fields == {}


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_is_continuable_exactly_on_the_kinds_the_record_says(kind: BackendKind) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}
    request = InferenceRequest(
        request_id="r",
        api=CHAT,
        model=MODEL,
        body=body,
        raw_body=b"",
        stream=True,
        client_wants_usage=False,
        prompt_tokens=10,
        max_tokens=20,
        arrival=0.0,
    )
    assert can_continue(request, kind) is engine(kind).continuable


@pytest.mark.parametrize("kind", KINDS)
def test_the_engine_priority_has_the_record_s_sign(kind: BackendKind) -> None:
    assert engine_priority(kind, 3) == 3 * engine(kind).priority_sign
    assert engine_priority(kind, 0) == 0


SERVED_BY: list[tuple[Dialect, str]] = [
    (CHAT, "serves_chat"),
    (MESSAGES, "serves_chat"),  # natively or translated to chat, which any request may need
    (COMPLETIONS, "serves_completions"),
    (RESPONSES, "serves_responses"),
    (EMBEDDINGS, "serves_embeddings"),
    (TOKENIZE, "serves_tokenizer"),
    (DETOKENIZE, "serves_tokenizer"),
    (RERANK, "serves_rerank"),
    (SCORE, "serves_score"),
    (COUNT_TOKENS, "serves_count_tokens"),
]


@pytest.mark.parametrize(("api", "field"), [pytest.param(api, field, id=api.path) for api, field in SERVED_BY])
@pytest.mark.parametrize("kind", KINDS)
def test_an_api_is_offered_to_the_kinds_whose_record_serves_it(kind: BackendKind, api: Dialect, field: str) -> None:
    assert api.serves(kind) is getattr(engine(kind), field)


@pytest.mark.parametrize("kind", KINDS)
def test_messages_pass_through_only_to_kinds_that_answer_them_natively(kind: BackendKind) -> None:
    backend = Backend(name="b", url="http://127.0.0.1:1", kind=kind, models=[MODEL])
    native = MESSAGES.translation(backend, multi_scope=False) is None
    assert native is engine(kind).native_messages
    assert MESSAGES.translation(backend, multi_scope=True) is MESSAGES_VIA_CHAT


@pytest.mark.parametrize("kind", KINDS)
def test_the_scraper_reads_every_saturation_name_of_the_record(kind: BackendKind) -> None:
    metrics = engine(kind).metrics
    for name in metrics.waiting:
        assert parse_saturation(f'{name}{{model_name="m"}} 7\n'.encode()).waiting == 7.0
    for name in metrics.running:
        assert parse_saturation(f"{name} 5\n".encode()).running == 5.0
    for name in metrics.kv_usage:
        assert parse_saturation(f"{name} 0.25\n".encode()).kv_usage == 0.25
    for name in metrics.counters:
        assert 11.0 in parse_saturation(f"{name} 11\n".encode()).counters


def test_the_scraper_reads_no_name_outside_the_table() -> None:
    page = b"llamacpp:n_busy_slots_per_decode 4\nllamacpp:kv_cache_usage_ratio 0.9\nllamacpp:n_decode_total 8\n"
    signals = parse_saturation(page)
    assert (signals.waiting, signals.running, signals.kv_usage) == (0.0, 0.0, 0.0)
    assert not any(signals.counters)
