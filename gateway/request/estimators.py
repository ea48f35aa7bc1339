"""Which ``TokenEstimator`` counts each model's prompts: its own tokenizer, or the character estimate.

Why a value per policy: a tokenizer file is read and parsed once, when a policy is loaded (at
start and at every reload), never per request; ``Estimators`` is built whole from a snapshot and
swapped whole with it (``gateway/service.py``), and a policy whose tokenizer file cannot be read
or parsed is refused, naming the model and the file, with the policy in force kept.

A model without ``tokenizer`` (and a model the estimators do not know, e.g. one added by a reload
a request read after the swap) gets ``default``, the ``CharRatioEstimator``. Models naming the same
file share one tokenizer and its cache. A relative path is read from the policy file's folder.

The same load gives each model with a tokenizer its ``EngineTokenizer`` (the tokenizer and, when
the policy names one, its ``chat_template``): what routing on an engine's KV events needs to
compute the engine's token ids (``gateway/request/engine_tokens.py``). A template that cannot be
read or compiled refuses the policy as a tokenizer does.

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
from gateway.request.chat_template import ChatTemplate, ChatTemplateError
from gateway.request.engine_tokens import EngineTokenizer
from gateway.request.segment_encoder import SegmentEncoder
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
    engine_tokenizers: Mapping[str, EngineTokenizer] = field(default_factory=lambda: MappingProxyType({}))
    """Each model whose tokenizer file is a real tokenizer: it with the model's chat template."""

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
        for path, field_name in _files(snapshot, model.tokenizer):
            try:
                with path.open("rb") as file:
                    file.read(1)
            except OSError as exc:
                problems.append(_problem(model.name, path, exc.strerror or str(exc), field_name))
    return problems


def _files(snapshot: PolicySnapshot, tokenizer: TokenizerPolicy) -> list[tuple[Path, str]]:
    files = [(tokenizer_path(snapshot, tokenizer), "path")]
    if tokenizer.chat_template is not None:
        files.append((_relative(snapshot, tokenizer.chat_template), "chat_template"))
    return files


def _relative(snapshot: PolicySnapshot, name: str) -> Path:
    path = Path(name).expanduser()
    return path if path.is_absolute() else Path(snapshot.source).parent / path


def build_estimators(snapshot: PolicySnapshot, load: TokenizerLoader = TokenizerEstimator.from_file) -> Estimators:
    """Every model's estimator for ``snapshot``, each tokenizer file loaded once; ``TokenizerUnavailable``
    lists every model whose file cannot be read or parsed."""
    loaded: dict[Path, TokenEstimator] = {}
    encoders: dict[Path, SegmentEncoder] = {}
    templates: dict[Path, ChatTemplate] = {}
    by_model: dict[str, TokenEstimator] = {}
    engine_tokenizers: dict[str, EngineTokenizer] = {}
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
        template: ChatTemplate | None = None
        if model.tokenizer.chat_template is not None:
            template_path = _relative(snapshot, model.tokenizer.chat_template)
            if template_path not in templates:
                try:
                    templates[template_path] = ChatTemplate.from_file(template_path)
                except (OSError, ChatTemplateError) as exc:
                    problems.append(_problem(model.name, template_path, str(exc), "chat_template"))
                    continue
            template = templates[template_path]
        estimator = loaded[path]
        if isinstance(estimator, TokenizerEstimator):
            encoder = encoders.get(path) or encoders.setdefault(path, SegmentEncoder(estimator.tokenizer))
            engine_tokenizers[model.name] = EngineTokenizer(estimator.tokenizer, template, encoder)
    if problems:
        raise TokenizerUnavailable(problems)
    return Estimators(by_model=MappingProxyType(by_model), engine_tokenizers=MappingProxyType(engine_tokenizers))


def _problem(model: str, path: Path, reason: str, field_name: str = "path") -> Problem:
    what = "tokenizer" if field_name == "path" else "chat template"
    return Problem(f"models[{model}].tokenizer.{field_name}", f"cannot load {what} '{path}': {reason}")
