"""``POST /v1/embeddings``: the embeddings dialect.

* **Fields**: the OpenAI embeddings request's and vLLM's pooling extras (``EMBEDDING_EXTRAS``).
  ``stream`` is not an embeddings field: it is let through so that validation can answer
  "Embeddings cannot be streamed" to ``stream: true`` (``false`` reaches the engine, which
  ignores it).
* **Prompt**: ``input``, text or token ids (``gateway/dialects/text_prompt.py``).
* **Output**: none: no output-length field, ``max_tokens`` 0, never streamed, never continued.
  Usage of the answer is its ``usage`` object.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any, final

from gateway.dialects.allowlists import EngineGrants
from gateway.dialects.defaults import OpenAIDialect
from gateway.dialects.engine_fields import check_engine_fields
from gateway.dialects.openai_answers import serves_embeddings, stream_flag, usage_flag
from gateway.dialects.text_prompt import render_text_prompt, text_prompt_tokens
from gateway.errors import InvalidRequest
from gateway.policy.model import BackendKind, ModelPolicy, RequestLimits
from gateway.request.body_fields import check_stream_options, screen_fields
from gateway.request.tokens import TokenEstimator

OPENAI_EMBEDDINGS = frozenset({"model", "input", "encoding_format", "dimensions", "user", "stream"})
EMBEDDING_EXTRAS = frozenset(
    {
        "truncate_prompt_tokens", "add_special_tokens", "embed_dtype", "endianness", "use_activation",
        "normalize", "padding", "truncation_side",
    }
)  # fmt: skip
FIELDS = OPENAI_EMBEDDINGS | EMBEDDING_EXTRAS


@final
class EmbeddingsDialect(OpenAIDialect):
    """The embeddings dialect (module docstring) on the OpenAI defaults (``gateway/dialects/defaults.py``);
    ``EMBEDDINGS`` is its one instance."""

    __slots__ = ()

    name = "embeddings"
    path = "/v1/embeddings"
    operation = "embeddings"
    fields = FIELDS
    prompt_field = "input"
    serves = staticmethod(serves_embeddings)
    output_aliases: tuple[str, ...] = ()

    def output_field(self, kind: BackendKind) -> str | None:
        return None

    def screen(self, body: dict[str, Any], limits: RequestLimits, grants: EngineGrants) -> bool:
        stripped = screen_fields(FIELDS, body, limits)
        check_engine_fields(body, limits)
        check_stream_options(body.get("stream_options"))
        return stripped

    def stream_flags(self, body: dict[str, Any]) -> tuple[bool, bool]:
        if stream_flag(body):
            raise InvalidRequest("Embeddings cannot be streamed.", param="stream")
        return False, usage_flag(body)

    def prompt_tokens(
        self, body: dict[str, Any], model: ModelPolicy, limits: RequestLimits, estimator: TokenEstimator
    ) -> int:
        return text_prompt_tokens("input", body, model, estimator)

    def render(self, body: dict[str, Any]) -> str | array[int]:
        return render_text_prompt(body.get("input"))

    def stream_usage_fields(self, body: dict[str, Any], per_chunk: bool) -> Mapping[str, Any]:
        return {}  # never streamed

    def can_continue(self, body: dict[str, Any]) -> bool:
        return False

    def continue_body(self, body: dict[str, Any], partial: str) -> None:
        raise AssertionError("an embedding is never streamed, so never continued")


EMBEDDINGS = EmbeddingsDialect()
