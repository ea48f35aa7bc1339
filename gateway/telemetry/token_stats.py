"""An answer's output timing and usage (``TokenStats``), as the relay measured it.

Why in telemetry: what reads it is telemetry's (goodput judges TTFT and the gaps, the cost meter
charges the tokens, the recorder exports them), and the pipeline, which builds it
(``gateway/pipeline/relay.py``) and keeps it in the request's ``RequestOutcome``
(``gateway/pipeline/outcome.py``), is above this stage: a value of its own here lets telemetry read
a finished request without importing the pipeline.

A ``NamedTuple`` rather than a frozen dataclass: as immutable, and three times cheaper to build,
which matters for a value built once per request (``gateway/pipeline/outcome.py`` says more).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple


class TokenStats(NamedTuple):
    """The output timing and usage of an answer: TTFT from arrival, every inter-chunk gap.

    ``first_output`` is the clock time of the first output chunk (None: no output, or a
    non-streamed answer); ``usage`` is the backend's usage object as reported (None if none).
    """

    arrival: float
    first_output: float | None
    gaps: Sequence[float]
    usage: Mapping[str, Any] | None
    finish_reasons: Sequence[str]

    @property
    def ttft(self) -> float | None:
        return None if self.first_output is None else self.first_output - self.arrival

    def usage_int(self, key: str) -> int | None:
        value = self.usage.get(key) if self.usage else None
        return value if isinstance(value, int) else None

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the engine reused (``usage.prompt_tokens_details.cached_tokens``; the
        dialects put llama.cpp's ``timings.cache_n`` there, ``gateway/dialects/openai_answers.py``).
        None when the usage does not say: no usage, or details missing or ``null``, which vLLM and
        SGLang write both for 0 and when their switch is off, so it is not read as 0 here."""
        details = self.usage.get("prompt_tokens_details") if self.usage else None
        value = details.get("cached_tokens") if isinstance(details, dict) else None
        return value if isinstance(value, int) else None

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens as the backend reported them (0 without usage)."""
        return (self.usage_int("prompt_tokens") or 0) + (self.usage_int("completion_tokens") or 0)
