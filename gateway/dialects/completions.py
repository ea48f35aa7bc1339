"""``POST /v1/completions``: the (legacy) text completions dialect.

* **Fields**: the OpenAI completions request's, the engines' sampling and structured-output
  extras (``body_fields.SAMPLING_EXTRAS``) and every output-length alias.
* **Nested rules**: the engine features' bounds (``stop``, ``logit_bias``, ``logprobs``, ...:
  ``engine_fields.py``); ``stream_options`` (``body_fields.check_stream_options``).
* **Prompt**: ``prompt``, text or token ids (``gateway/dialects/text_prompt.py``); nothing else
  (vLLM's ``prompt_embeds``, tensors the engine loads as they come, is not a field here).
* **Rendering for prefix keys**: the text as is, token ids as their 4-byte array; a
  continuation (prompt plus partial answer) extends the original's.
* **Output bound**: vLLM, SGLang, OpenAI and the simulator obey ``max_tokens``, llama.cpp
  ``n_predict`` (``EngineKind.completions_output_field`` in ``gateway/engines.py``;
  ``gateway/request/output_length.py`` says why).
* **Served by** every kind whose record says so (``EngineKind.serves_completions``).
* **Answer**: OpenAI choice chunks when streamed, ``choices`` when whole
  (``gateway/dialects/openai_answers.py``).
* **Continuation**: the prompt plus the partial text, when the prompt is one string and the
  answer does not echo it (an echoed prompt would be echoed twice).
"""

from __future__ import annotations

from array import array
from typing import Any, final

from gateway.dialects.allowlists import EngineGrants
from gateway.dialects.defaults import OpenAIDialect
from gateway.dialects.engine_fields import check_engine_fields
from gateway.dialects.openai_answers import serves_completions, stream_flag, usage_flag
from gateway.dialects.text_prompt import render_text_prompt, text_prompt_tokens
from gateway.engines import engine
from gateway.policy.model import BackendKind, ModelPolicy, RequestLimits
from gateway.request.body_fields import OUTPUT_LENGTH_ALIASES, SAMPLING_EXTRAS, check_stream_options, screen_fields
from gateway.request.output_length import OUTPUT_LENGTH_FIELDS
from gateway.request.tokens import TokenEstimator

OPENAI_COMPLETIONS = frozenset(
    {
        "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
        "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p",
        "user",
    }
)  # fmt: skip
FIELDS = OPENAI_COMPLETIONS | SAMPLING_EXTRAS | OUTPUT_LENGTH_ALIASES


@final
class CompletionsDialect(OpenAIDialect):
    """The completions dialect (module docstring) on the OpenAI defaults (``gateway/dialects/defaults.py``);
    ``COMPLETIONS`` is its one instance."""

    __slots__ = ()

    name = "completions"
    path = "/v1/completions"
    operation = "text_completion"
    fields = FIELDS
    prompt_field = "prompt"
    serves = staticmethod(serves_completions)
    output_aliases = OUTPUT_LENGTH_FIELDS

    def output_field(self, kind: BackendKind) -> str | None:
        return engine(kind).completions_output_field

    def screen(self, body: dict[str, Any], limits: RequestLimits, grants: EngineGrants) -> bool:
        stripped = screen_fields(FIELDS, body, limits)
        check_engine_fields(body, limits)
        check_stream_options(body.get("stream_options"))
        return stripped

    def stream_flags(self, body: dict[str, Any]) -> tuple[bool, bool]:
        return stream_flag(body), usage_flag(body)

    def prompt_tokens(
        self, body: dict[str, Any], model: ModelPolicy, limits: RequestLimits, estimator: TokenEstimator
    ) -> int:
        return text_prompt_tokens("prompt", body, model, estimator)

    def render(self, body: dict[str, Any]) -> str | array[int]:
        return render_text_prompt(body.get("prompt"))

    def can_continue(self, body: dict[str, Any]) -> bool:
        return isinstance(body.get("prompt"), str) and not body.get("echo")

    def continue_body(self, body: dict[str, Any], partial: str) -> None:
        body["prompt"] = body["prompt"] + partial


COMPLETIONS = CompletionsDialect()
