"""Which ``TokenEstimator`` counts each model's prompts: its own tokenizer, or the character estimate.

Why a value per policy: a tokenizer file is read and parsed once, when a policy is loaded (at
start and at every reload), never per request; ``Estimators`` is built whole from a snapshot and
swapped whole with it (``gateway/service.py``), and a policy whose tokenizer file cannot be read
or parsed is refused, naming the model and the file, with the policy in force kept.

A model without ``tokenizer`` (and a model the estimators do not know, e.g. one added by a reload
a request read after the swap) gets ``default``, the ``CharRatioEstimator``. Models naming the same
file share one tokenizer and its cache. A relative path is read from the policy file's folder.

Usage::

    estimators = build_estimators(snapshot)            # TokenizerUnavailable: policy refused
    estimators.for_model("meta-llama/Llama-3.1-8B-Instruct").count(text)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from gateway.policy.model import TokenizerPolicy
from gateway.policy.problems import Problem
from gateway.policy.snapshot import PolicySnapshot
from gateway.request.tokenizer import TokenizerEstimator
from gateway.request.tokens import CharRatioEstimator, TokenEstimator

TokenizerLoader = Callable[[Path], TokenEstimator]
"""A tokenizer file to its estimator; raises when the file cannot be read or parsed."""


class TokenizerUnavailable(Exception):
    """Some model's tokenizer file cannot be read or parsed; ``problems`` names each model and file."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(str(problem) for problem in problems))


@dataclass(frozen=True, slots=True)
class Estimators:
    """The estimator of each model with a tokenizer, and the default for every other model."""

    default: TokenEstimator = field(default_factory=CharRatioEstimator)
    by_model: Mapping[str, TokenEstimator] = field(default_factory=lambda: MappingProxyType({}))

    def for_model(self, model: str) -> TokenEstimator:
        return self.by_model.get(model, self.default)


def tokenizer_path(snapshot: PolicySnapshot, tokenizer: TokenizerPolicy) -> Path:
    """``tokenizer.path``, a relative one read from the folder of the policy file (``snapshot.source``)."""
    path = Path(tokenizer.path).expanduser()
    return path if path.is_absolute() else Path(snapshot.source).parent / path


def tokenizer_problems(snapshot: PolicySnapshot) -> list[Problem]:
    """Each model whose tokenizer file cannot be opened (a cheap check, the file is not parsed):
    ``policy validate`` and the loaders say so before anything is built."""
    problems: list[Problem] = []
    for model in snapshot.policy.models:
        if model.tokenizer is None:
            continue
        path = tokenizer_path(snapshot, model.tokenizer)
        try:
            with path.open("rb") as file:
                file.read(1)
        except OSError as exc:
            problems.append(_problem(model.name, path, exc.strerror or str(exc)))
    return problems


def build_estimators(snapshot: PolicySnapshot, load: TokenizerLoader = TokenizerEstimator.from_file) -> Estimators:
    """Every model's estimator for ``snapshot``, each tokenizer file loaded once; ``TokenizerUnavailable``
    lists every model whose file cannot be read or parsed."""
    loaded: dict[Path, TokenEstimator] = {}
    by_model: dict[str, TokenEstimator] = {}
    problems: list[Problem] = []
    for model in snapshot.policy.models:
        if model.tokenizer is None:
            continue
        path = tokenizer_path(snapshot, model.tokenizer)
        if path not in loaded:
            try:
                loaded[path] = load(path)
            except Exception as exc:  # the Rust side raises plain Exception for I/O and parse errors
                problems.append(_problem(model.name, path, str(exc)))
                continue
        by_model[model.name] = loaded[path]
    if problems:
        raise TokenizerUnavailable(problems)
    return Estimators(by_model=MappingProxyType(by_model))


def _problem(model: str, path: Path, reason: str) -> Problem:
    return Problem(f"models[{model}].tokenizer.path", f"cannot load tokenizer '{path}': {reason}")
