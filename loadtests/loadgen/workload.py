"""The workload file: a typed model of ``loadtests/workloads/*.yaml`` and its loader.

A workload says *what* traffic looks like; the command line says *how much* (rate, duration).
Validation happens once at load and fails with the file and the path inside it, e.g.
``loadtests/workloads/x.yaml: classes.interactive.share: must be between 0 and 1``. Unknown
keys are rejected and nothing falls back to a default silently: shares must sum to 1, a key
read from the environment must be set.

Lengths are in tokens, where a token is one word: the simulator tokenises words and
punctuation, and the prompts generated here are punctuation-free words.

Usage::

    workload = load_workload(Path("loadtests/workloads/demo.yaml"))
    workload.classes["interactive"].slo.ttft_ms   # 500.0
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_SHARE_TOLERANCE = 1e-6


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Fixed(_Strict):
    dist: Literal["fixed"]
    value: int = Field(ge=0)


class Uniform(_Strict):
    """Integers drawn uniformly from [min, max], both included."""

    dist: Literal["uniform"]
    min: int = Field(ge=0)
    max: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Uniform:
        if self.min > self.max:
            raise ValueError("min must not exceed max")
        return self


class Normal(_Strict):
    """Rounded, then clipped to [min, max] (min defaults to 1 so a prompt is never empty)."""

    dist: Literal["normal"]
    mean: float = Field(ge=0)
    std: float = Field(ge=0)
    min: int = Field(default=1, ge=0)
    max: int | None = Field(default=None, ge=0)


class LogNormal(_Strict):
    """Parameterised by its arithmetic ``mean`` (tokens) and ``sigma``, the log-space spread.

    The log-space location is ``ln(mean) − sigma²/2`` so that the mean is what the file says;
    ShareGPT-like prompt lengths fit sigma ≈ 1.
    """

    dist: Literal["lognormal"]
    mean: float = Field(gt=0)
    sigma: float = Field(ge=0)
    min: int = Field(default=1, ge=0)
    max: int | None = Field(default=None, ge=0)

    @property
    def mu(self) -> float:
        return math.log(self.mean) - self.sigma**2 / 2


Length = Annotated[Fixed | Uniform | Normal | LogNormal, Field(discriminator="dist")]


class Slo(_Strict):
    """Service-level objectives of a class; a request meets them only if it succeeded too.

    ``tpot_ms`` is the time per output token after the first, (e2e − ttft)/(tokens − 1).
    For a non-streaming request the first token reaches the client with the whole response,
    so its TTFT is its end-to-end latency.
    """

    ttft_ms: float = Field(gt=0)
    tpot_ms: float = Field(gt=0)
    e2e_ms: float | None = Field(default=None, gt=0)


class TrafficClass(_Strict):
    share: float
    priority: str = Field(min_length=1)
    """Sent as the ``x-priority`` header; the gateway maps it to the engine's priority."""
    slo: Slo
    deadline_s: float | None = Field(default=None, gt=0)
    """Sent as ``x-request-timeout`` (seconds): the gateway may drop the request after it."""
    prompt_tokens: Length | None = None
    """Overrides the workload's ``prompt_tokens`` for this class."""
    output_tokens: Length | None = None

    @field_validator("share")
    @classmethod
    def _share_range(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError("must be between 0 and 1")
        return value


class Tenant(_Strict):
    share: float
    api_key: str | None = Field(default=None, min_length=1)
    api_key_env: str | None = Field(default=None, min_length=1)

    @field_validator("share")
    @classmethod
    def _share_range(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError("must be between 0 and 1")
        return value

    @model_validator(mode="after")
    def _one_key(self) -> Tenant:
        if (self.api_key is None) == (self.api_key_env is None):
            raise ValueError("give exactly one of api_key and api_key_env")
        return self

    def resolve_key(self) -> str:
        if self.api_key is not None:
            return self.api_key
        assert self.api_key_env is not None
        return os.environ[self.api_key_env]


class Arrival(_Strict):
    """``poisson``; ``gamma`` with ``cv`` (coefficient of variation of the gaps, >1 is burstier);
    or ``trace``: replay the ``t_send`` of a JSONL file (relative to the workload file)."""

    process: Literal["poisson", "gamma", "trace"] = "poisson"
    cv: float | None = Field(default=None, gt=0)
    path: str | None = None

    @model_validator(mode="after")
    def _parameters(self) -> Arrival:
        if self.process == "gamma" and self.cv is None:
            raise ValueError("a gamma process needs cv")
        if self.process != "gamma" and self.cv is not None:
            raise ValueError(f"cv applies only to gamma, not {self.process}")
        if (self.process == "trace") != (self.path is not None):
            raise ValueError("path is required for trace, and only for trace")
        return self


class SharedPrefix(_Strict):
    """A system prompt per tenant: identical text for all its requests, different across tenants."""

    system_prompt_tokens: int = Field(default=0, ge=0)


class Conversation(_Strict):
    """Multi-turn chats: turn n+1 resends turns 1..n with the assistant's replies, then a new question.

    The replies are synthetic text of the turn's output length, generated when the turn is
    planned, so that bodies never wait for a response (open loop) and runs are reproducible.
    """

    turns: Length
    active_per_tenant: int = Field(default=4, ge=1)
    """Conversations open at once per tenant and class; each arrival continues one at random."""


class FewShot(_Strict):
    """Templates of question/answer examples, shared by a tenant's requests after its system prompt."""

    templates_per_tenant: int = Field(default=1, ge=1)
    examples: int = Field(ge=1)
    example_tokens: Length


class Workload(_Strict):
    name: str = Field(min_length=1)
    model: str = Field(min_length=1)
    api: Literal["chat", "completions"] = "chat"
    stream: bool = True
    ignore_eos: bool = True
    """With ``max_tokens``, makes output lengths exact (vLLM's ``ignore_eos``)."""
    arrival: Arrival = Arrival()
    classes: dict[str, TrafficClass] = Field(min_length=1)
    tenants: dict[str, Tenant] = Field(min_length=1)
    prompt_tokens: Length
    output_tokens: Length
    prefix: SharedPrefix = SharedPrefix()
    conversation: Conversation | None = None
    fewshot: FewShot | None = None

    @field_validator("classes", "tenants")
    @classmethod
    def _shares_sum_to_one(cls, value: dict[str, Any]) -> dict[str, Any]:
        total = sum(item.share for item in value.values())
        if abs(total - 1) > _SHARE_TOLERANCE:
            raise ValueError(f"shares must sum to 1, not {total:g}")
        return value


class WorkloadError(ValueError):
    """A workload file that cannot be used; the message names the file and the path in it."""


def load_workload(path: Path) -> Workload:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise WorkloadError(f"{path}: not valid YAML: {exc}") from exc
    return parse_workload(raw, source=str(path))


def parse_workload(raw: object, *, source: str) -> Workload:
    if not isinstance(raw, dict):
        raise WorkloadError(f"{source}: the top level must be a mapping")
    try:
        workload = Workload.model_validate(raw)
    except ValidationError as exc:
        raise WorkloadError("\n".join(f"{source}: {line}" for line in _describe(exc))) from exc
    for name, tenant in workload.tenants.items():
        if tenant.api_key_env is not None and tenant.api_key_env not in os.environ:
            raise WorkloadError(
                f"{source}: tenants.{name}.api_key_env: environment variable {tenant.api_key_env} is not set"
            )
    return workload


def _describe(exc: ValidationError) -> list[str]:
    lines = []
    for error in exc.errors():
        # Discriminated unions put the tag in the path ("output_tokens.uniform.min"): kept, it says which.
        loc = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {message}" if loc else message)
    return lines
