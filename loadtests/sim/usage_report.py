"""How a simulated engine reports a request's usage and the prompt tokens it reused.

The gateway reads the reuse on every attempt (``prompt_tokens_details.cached_tokens``) and each
engine writes it its own way, so the simulator can answer in three formats (``inference-gateway
sim --answer-format``), all on the same chunks and bodies (``protocol.py``): only the usage
object and llama.cpp's ``timings`` differ.

* **vllm** (the default), vLLM's ``UsageInfo`` (keys ``prompt_tokens``, ``total_tokens``,
  ``completion_tokens``, ``prompt_tokens_details``, in that order), as vLLM started with
  ``--enable-prompt-tokens-details`` (``--no-prompt-tokens-details``: as vLLM without it). The
  count is reported only when above 0 (vLLM tests ``num_cached_tokens`` for truth): a whole answer
  is ``model_dump()``-ed, so it has ``"prompt_tokens_details": null`` when nothing was reused or
  the flag is off; a stream's final usage chunk is dumped with ``exclude_none``, so there the key
  is absent instead. The per-chunk usage of ``continuous_usage_stats`` never has it. vLLM reuses
  whole blocks: the count is a multiple of the block size (16).
* **llamacpp**, llama.cpp's server since PR #19361 (Feb 2026): ``usage`` is
  ``completion_tokens``, ``prompt_tokens``, ``total_tokens``, ``prompt_tokens_details:
  {"cached_tokens": n}``, always, even at 0, and each answer carries a top-level ``timings``
  object (``result_timings::to_json``): ``cache_n`` (prompt tokens reused), ``prompt_n`` (prompt
  tokens processed: the others), the prompt's and the generation's milliseconds, per-token
  milliseconds and tokens per second (``null`` where llama.cpp divides by 0: its JSON writes an
  infinity as null). In a stream the timings ride the last chunk llama.cpp sends: the usage chunk
  with ``stream_options.include_usage``, else the ``finish_reason`` chunk. llama.cpp knows neither
  vLLM's ``"usage": null`` on content chunks nor ``continuous_usage_stats``: both are left out.
* **llamacpp-legacy**, llama.cpp before that PR: the same without ``prompt_tokens_details``; the
  reuse is only in ``timings.cache_n``.

The milliseconds are the engine clock's (``TokenStream``'s stamps): the prompt's from the
request's arrival to its first token (queueing included, which llama.cpp leaves out), the
generation's from the first token to the end.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from loadtests.sim.protocol import usage
from loadtests.sim.stream import TokenStream


class AnswerFormat(enum.Enum):
    """Whose usage shapes the engine writes (module docstring)."""

    VLLM = "vllm"
    LLAMACPP = "llamacpp"
    LLAMACPP_LEGACY = "llamacpp-legacy"


@dataclass(frozen=True, slots=True)
class UsageReport:
    """The usage objects and ``timings`` of one engine's answers (module docstring)."""

    answer_format: AnswerFormat = AnswerFormat.VLLM
    prompt_tokens_details: bool = True
    """vLLM's ``--enable-prompt-tokens-details``; the llama.cpp formats ignore it."""

    @property
    def vllm(self) -> bool:
        """vLLM's stream extras apply: ``"usage": null`` on content chunks and ``continuous_usage_stats``."""
        return self.answer_format is AnswerFormat.VLLM

    def whole(self, prompt: int, completion: int, cached: int) -> dict[str, Any]:
        """The usage of a whole (non-streamed) chat or completions answer."""
        if self.vllm:
            use = usage(prompt, completion)
            use["prompt_tokens_details"] = self._vllm_details(cached)
            return use
        return self._llamacpp(prompt, completion, cached)

    def final(self, prompt: int, completion: int, cached: int) -> dict[str, Any]:
        """The usage of a stream's usage chunk (``stream_options.include_usage``)."""
        if self.vllm:
            use = usage(prompt, completion)
            details = self._vllm_details(cached)
            if details is not None:  # exclude_none: absent rather than null
                use["prompt_tokens_details"] = details
            return use
        return self._llamacpp(prompt, completion, cached)

    def timings(self, stream: TokenStream) -> dict[str, Any] | None:
        """llama.cpp's ``timings`` of a finished request; None in vLLM's format."""
        if self.vllm:
            return None
        cached, predicted = stream.cached_tokens, stream.num_tokens
        processed = stream.prompt_tokens - cached
        end = max(stream.end_at, stream.first_at)
        prompt_ms = (stream.first_at - stream.arrival) * 1e3
        predicted_ms = (end - stream.first_at) * 1e3
        return {
            "cache_n": cached,
            "prompt_n": processed,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": _ratio(prompt_ms, processed),
            "prompt_per_second": _ratio(1e3 * processed, prompt_ms),
            "predicted_n": predicted,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": _ratio(predicted_ms, predicted),
            "predicted_per_second": _ratio(1e3 * predicted, predicted_ms),
        }

    def timings_on_finish(self, include_usage: bool) -> bool:
        """Whether the ``finish_reason`` chunk carries the timings: llama.cpp without a usage chunk."""
        return not include_usage and not self.vllm

    def _vllm_details(self, cached: int) -> dict[str, int] | None:
        return {"cached_tokens": cached} if self.prompt_tokens_details and cached else None

    def _llamacpp(self, prompt: int, completion: int, cached: int) -> dict[str, Any]:
        use: dict[str, Any] = {
            "completion_tokens": completion,
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
        }
        if self.answer_format is AnswerFormat.LLAMACPP:
            use["prompt_tokens_details"] = {"cached_tokens": cached}
        return use


def _ratio(numerator: float, denominator: float) -> float | None:
    """``numerator / denominator``, or None (llama.cpp's JSON null for an infinity) when dividing by 0."""
    return numerator / denominator if denominator else None
