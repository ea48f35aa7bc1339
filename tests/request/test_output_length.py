"""One output bound per request; each backend kind gets exactly the one field it obeys.

Three levels: the pure rules (``gateway/request/output_length.py``); a gateway whose five backends
of every kind are one recording fake backend, to see the body each kind is sent; and a model
capped at 64 tokens in front of the simulated engine (which obeys ``max_tokens`` like vLLM),
across clamp/reject, with and without ``default_max_tokens``, chat and completions, streamed
and not: never a 5xx, and never more than 64 tokens generated.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.dialects.base import Dialect
from gateway.dialects.chat import CHAT
from gateway.dialects.completions import COMPLETIONS
from gateway.dialects.embeddings import EMBEDDINGS
from gateway.errors import InvalidRequest
from gateway.policy.model import BackendKind
from gateway.request.output_length import fit_output_length, obeyed_field, output_length_edits, requested_output_length
from loadtests.sim import build_engine_app
from tests.conftest import KEY_ACME, run_gateway
from tests.fake_backend import FakeBackend
from tests.policy_builder import OMIT, backend, build_policy, model
from tests.servers import serve_in_thread

ALIASES = ("max_tokens", "max_completion_tokens", "n_predict")


@pytest.mark.parametrize(
    ("kind", "api", "field"),
    [
        pytest.param(BackendKind.VLLM, CHAT, "max_tokens", id="vLLM chat reads max_tokens in every version"),
        pytest.param(BackendKind.VLLM, COMPLETIONS, "max_tokens", id="vLLM completions reads max_tokens only"),
        pytest.param(BackendKind.SGLANG, CHAT, "max_tokens", id="SGLang chat reads max_tokens"),
        pytest.param(BackendKind.LLAMACPP, CHAT, "n_predict", id="llama.cpp reads n_predict before max_tokens"),
        pytest.param(BackendKind.LLAMACPP, COMPLETIONS, "n_predict", id="llama.cpp completions too"),
        pytest.param(BackendKind.OPENAI, CHAT, "max_completion_tokens", id="OpenAI chat wants the new field"),
        pytest.param(BackendKind.OPENAI, COMPLETIONS, "max_tokens", id="OpenAI completions has only max_tokens"),
        pytest.param(BackendKind.SIM, CHAT, "max_tokens", id="the simulator reads max_tokens"),
        pytest.param(BackendKind.VLLM, EMBEDDINGS, None, id="embeddings have no output bound"),
    ],
)
def test_each_kind_and_api_has_one_obeyed_field(kind: BackendKind, api: Dialect, field: str | None) -> None:
    assert obeyed_field(kind, api) == field
    edits = output_length_edits(kind, api, 12)
    if field is None:
        assert edits == {}
    else:
        assert edits == {**dict.fromkeys(ALIASES), field: 12}


def test_fitting_removes_every_alias_and_sets_the_obeyed_field() -> None:
    body: dict[str, Any] = {"model": "m", "max_tokens": 3000, "max_completion_tokens": 1, "n_predict": 7}
    assert fit_output_length(body, BackendKind.LLAMACPP, CHAT, 64)
    assert body == {"model": "m", "n_predict": 64}
    assert not fit_output_length(body, BackendKind.LLAMACPP, CHAT, 64), "already fitted: no re-serialisation"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param({}, (None, None), id="no bound"),
        pytest.param({"max_tokens": None, "max_completion_tokens": None}, (None, None), id="nulls are absent"),
        pytest.param({"max_completion_tokens": 5}, (5, "max_completion_tokens"), id="the new field"),
        pytest.param({"max_tokens": 5, "n_predict": 5}, (5, "max_tokens"), id="equal aliases agree"),
    ],
)
def test_the_requested_bound_is_read_from_every_alias(body: dict[str, Any], expected: tuple[int | None, str]) -> None:
    assert requested_output_length(body) == expected


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        pytest.param(
            {"max_completion_tokens": 1, "max_tokens": 3000}, "conflicting_max_tokens", "max_tokens", id="1 vs 3000"
        ),
        pytest.param({"max_tokens": 0}, "invalid_field", "max_tokens", id="zero"),
        pytest.param({"n_predict": -2}, "invalid_field", "n_predict", id="llama.cpp's until-context-full"),
        pytest.param({"max_tokens": 8.0}, "invalid_field", "max_tokens", id="a float"),
        pytest.param({"max_completion_tokens": True}, "invalid_field", "max_completion_tokens", id="a boolean"),
    ],
)
def test_a_bad_or_ambiguous_bound_is_refused(body: dict[str, Any], code: str, param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        requested_output_length(body)
    assert (refused.value.code, refused.value.param) == (code, param)


KINDS = [kind.value for kind in BackendKind]


@pytest.fixture(scope="module")
def every_kind() -> Iterator[tuple[str, FakeBackend]]:
    """A gateway with one backend of each kind (model ``m-<kind>``), all the same recording fake."""
    fake = FakeBackend()
    with serve_in_thread(fake) as backend_url:
        text = build_policy(
            version="kinds",
            limits={"max_tokens_over_limit": "clamp"},
            classes={"batch": OMIT},
            models=[model(f"m-{k}", max_output_tokens=64) for k in KINDS],
            backends=[backend(f"b-{k}", backend_url, [f"m-{k}"], kind=k) for k in KINDS],
            tenants={"globex": OMIT},
            retry={"max_retries": 0},
        )
        with run_gateway(text) as url:
            yield url, fake


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("path", "fields", "bound"),
    [
        pytest.param("/v1/chat/completions", {"max_completion_tokens": 1000}, 64, id="chat-over-the-cap"),
        pytest.param("/v1/chat/completions", {}, 64, id="chat-without-a-bound"),
        pytest.param("/v1/completions", {"max_completion_tokens": 9, "max_tokens": 9}, 9, id="completions-two-aliases"),
        pytest.param("/v1/completions", {"n_predict": 3}, 3, id="completions-n_predict"),
    ],
)
def test_each_kind_is_sent_only_the_field_it_obeys(
    every_kind: tuple[str, FakeBackend], kind: str, path: str, fields: dict[str, int], bound: int
) -> None:
    url, fake = every_kind
    body: dict[str, Any] = {"model": f"m-{kind}", **fields}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"})
    response = httpx.post(url + path, json=body, headers={"authorization": f"Bearer {KEY_ACME}"}, timeout=10)
    assert response.status_code == 200, response.text
    received = fake.received[-1].body
    field = obeyed_field(BackendKind(kind), CHAT if "chat" in path else COMPLETIONS)
    assert {k: received[k] for k in ALIASES if k in received} == {field: bound}


CAP = 64


@pytest.fixture(scope="module")
def simulated_engine() -> Iterator[str]:
    app = build_engine_app("llama-3.1-8b-h100", model="private/model", time_scale=0.001)
    with serve_in_thread(app) as url:
        yield url


def capped_policy(engine_url: str, mode: str, default: int | None) -> str:
    fields = {"default_max_tokens": default} if default else {}
    return build_policy(
        version="capped",
        limits={"max_tokens_over_limit": mode},
        classes={"batch": OMIT},
        models=[model("private/model", max_output_tokens=CAP, **fields)],
        backends=[backend("sim", engine_url, ["private/model"])],
        tenants={"globex": OMIT},
    )


ASKS = [{}, {"max_tokens": 100}, {"max_completion_tokens": 100}, {"max_tokens": CAP}, {"max_completion_tokens": 5}]


def generated_tokens(response: httpx.Response, stream: bool) -> int:
    if not stream:
        return int(response.json()["usage"]["completion_tokens"])
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usages = [orjson.loads(e)["usage"] for e in events[:-1] if orjson.loads(e).get("usage")]
    return int(usages[-1]["completion_tokens"])


@pytest.mark.parametrize("default", [None, 16], ids=["no-default", "default-16"])
@pytest.mark.parametrize("mode", ["clamp", "reject"])
def test_a_model_capped_at_64_never_answers_5xx_nor_generates_past_its_cap(
    simulated_engine: str, mode: str, default: int | None
) -> None:
    seen: list[tuple[str, bool, dict[str, int], int, int]] = []
    with run_gateway(capped_policy(simulated_engine, mode, default)) as url:
        for path, stream, ask in itertools.product(["/v1/chat/completions", "/v1/completions"], [False, True], ASKS):
            body: dict[str, Any] = {"model": "private/model", "stream": stream, "ignore_eos": True, **ask}
            if stream:
                body["stream_options"] = {"include_usage": True}
            body.update({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"})
            response = httpx.post(url + path, json=body, headers={"authorization": f"Bearer {KEY_ACME}"}, timeout=30)
            asked = next(iter(ask.values()), None)
            if mode == "reject" and asked is not None and asked > CAP:
                assert response.status_code == 400, response.text
                assert response.json()["error"]["code"] == "max_tokens_too_large"
                continue
            assert response.status_code == 200, (path, stream, ask, response.text)
            generated = generated_tokens(response, stream)
            seen.append((path, stream, ask, generated, asked or default or CAP))
    for path, stream, ask, generated, expected in seen:
        assert generated == min(expected, CAP), (path, stream, ask, generated)
