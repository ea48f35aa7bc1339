"""A model's chat template (Hugging Face, Jinja), rendered as ``transformers`` renders it.

Why: an engine turns a chat request into text with the model's template and then into token
ids; to know those ids (``gateway/request/engine_tokens.py``: the engine's own prefix-cache
block hashes), the gateway renders the same template the same way.

**As transformers does** (``transformers/utils/chat_template_utils.py``, ``_compile_jinja_template``
and ``render_jinja_template``; ``tokenization_utils_base.py``, ``apply_chat_template``):

* ``jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
  ``loopcontrols`` extension and a ``{% generation %}...{% endgeneration %}`` tag (transformers'
  ``AssistantTracker``: outside training it renders its body unchanged);
* a ``tojson`` filter that does not escape HTML: ``json.dumps(x, ensure_ascii=False, indent=...,
  separators=..., sort_keys=...)``; globals ``raise_exception(message)`` (raises
  ``jinja2.TemplateError``, here a ``ChatTemplateError``) and ``strftime_now(format)`` (local now);
* the template sees ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, then the
  tokenizer's special tokens (``bos_token``, ``eos_token``, ...: only those it defines) with the
  caller's keyword arguments over them (``{**special_tokens_map, **kwargs}``);
* a ``tokenizer_config.json`` names its template as a string, or as a list of
  ``{"name", "template"}``: the ``tool_use`` one when tools are given and it exists, else
  ``default``. Template files beside it win over that key (transformers since v4.47):
  ``chat_template.jinja`` is ``default``, ``additional_chat_templates/NAME.jinja`` is ``NAME``.
  Special tokens are strings or ``AddedToken`` dicts (their ``content``).

**The message content format** (vLLM's ``--chat-template-content-format auto``): a template that
loops over a message's ``content`` takes content as a list of parts (``"openai"``); any other
takes a string (``"string"``). ``content_format`` applies vLLM's detection (a ``for`` over
``message['content']`` or ``message.content``, where ``message`` loops over ``messages`` or a
variable assigned from it) so a caller can shape messages as the engine will.

Errors: a template that does not compile raises ``ChatTemplateError`` at load; one that fails
while rendering (``raise_exception``, a sandbox violation, a type error) raises it at render.
Both name the template's file. The sandbox blocks attribute access to internals
(``__class__``, ``__globals__``, ...) and mutation of the caller's values (``append``, ...).

Usage::

    template = ChatTemplate.from_file("models/qwen/tokenizer_config.json")
    text = template.render([{"role": "user", "content": "Hi"}])    # add_generation_prompt=True
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

ContentFormat = Literal["string", "openai"]
"""How message content reaches the template: one string, or a list of ``{"type": ...}`` parts."""

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens transformers puts in a template's context (``special_tokens_map``)."""

DEFAULT_TEMPLATE = "default"
TOOL_USE_TEMPLATE = "tool_use"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
ADDITIONAL_TEMPLATES_FOLDER = "additional_chat_templates"


class ChatTemplateError(ValueError):
    """A chat template that cannot be read, compiled or rendered; the message names its source."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text for training
    masks with it; rendering is the body unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # the name transformers' templates call it with
    return datetime.now().strftime(format)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One model's chat template(s) and special tokens, compiled once; ``render`` per request.

    ``templates`` maps names to Jinja sources (``"default"`` required; ``"tool_use"`` optional);
    ``source`` names where they came from, for error messages. ``content_format`` is
    ``"auto"`` (vLLM's detection, module docstring) or the engine's explicit setting.
    """

    __slots__ = ("_compiled", "_content_formats", "source", "special_tokens")

    def __init__(
        self,
        templates: str | Mapping[str, str],
        *,
        source: str = "<string>",
        special_tokens: Mapping[str, Any] | None = None,
        content_format: ContentFormat | Literal["auto"] = "auto",
    ) -> None:
        named = {DEFAULT_TEMPLATE: templates} if isinstance(templates, str) else dict(templates)
        if DEFAULT_TEMPLATE not in named:
            raise ChatTemplateError(f"{source}: no {DEFAULT_TEMPLATE!r} chat template among {sorted(named)}")
        if content_format not in ("auto", "string", "openai"):
            raise ChatTemplateError(f"{source}: unknown content format {content_format!r}")
        self.source = source
        self.special_tokens: dict[str, Any] = dict(special_tokens or {})
        env = _environment()
        self._compiled: dict[str, jinja2.Template] = {}
        self._content_formats: dict[str, ContentFormat] = {}
        for name, text in named.items():
            if not isinstance(text, str):
                raise ChatTemplateError(f"{source}: chat template {name!r} is not a string")
            try:
                self._compiled[name] = env.from_string(text)
                ast = env.parse(text)
            except jinja2.TemplateError as exc:
                raise ChatTemplateError(f"{source}: chat template {name!r} does not compile: {exc}") from exc
            self._content_formats[name] = content_format if content_format != "auto" else detect_content_format(ast)

    @classmethod
    def from_file(cls, path: str | Path, *, content_format: ContentFormat | Literal["auto"] = "auto") -> ChatTemplate:
        """A ``.jinja`` file (the template alone) or a ``tokenizer_config.json`` (template and tokens)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ChatTemplateError(f"{path}: cannot be read: {exc}") from exc
        if path.suffix != ".json":
            return cls(text, source=str(path), content_format=content_format)
        try:
            config = json.loads(text)
        except ValueError as exc:
            raise ChatTemplateError(f"{path}: not JSON: {exc}") from exc
        if not isinstance(config, dict):
            raise ChatTemplateError(f"{path}: not a JSON object")
        return cls(
            _config_templates(config, path),
            source=str(path),
            special_tokens=_config_special_tokens(config, path),
            content_format=content_format,
        )

    @property
    def bos_token(self) -> str | None:
        token = self.special_tokens.get("bos_token")
        return token if isinstance(token, str) else None

    @property
    def eos_token(self) -> str | None:
        token = self.special_tokens.get("eos_token")
        return token if isinstance(token, str) else None

    def content_format(self, *, tools: Sequence[Any] | None = None) -> ContentFormat:
        """The content format of the template ``render`` would use with these tools."""
        return self._content_formats[self._name(tools)]

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text; ``kwargs`` are the template's extra variables (over the special tokens)."""
        name = self._name(tools)
        context = {**self.special_tokens, **kwargs}
        try:
            return self._compiled[name].render(
                messages=messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as exc:  # raise_exception, SecurityError, UndefinedError, ...
            raise ChatTemplateError(f"{self.source}: chat template {name!r} failed: {exc}") from exc
        except (TypeError, ValueError, LookupError, ArithmeticError, AttributeError) as exc:
            raise ChatTemplateError(
                f"{self.source}: chat template {name!r} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _name(self, tools: Sequence[Any] | None) -> str:
        if tools is not None and TOOL_USE_TEMPLATE in self._compiled:
            return TOOL_USE_TEMPLATE
        return DEFAULT_TEMPLATE

    def __repr__(self) -> str:
        return f"ChatTemplate(source={self.source!r}, templates={sorted(self._compiled)})"


def _config_templates(config: Mapping[str, Any], path: Path) -> str | dict[str, str]:
    """The template files beside a tokenizer_config.json, which win over its ``chat_template``
    as in transformers: ``chat_template.jinja`` (``default``), ``additional_chat_templates/*.jinja``."""
    files: dict[str, str] = {}
    default_file = path.with_name(CHAT_TEMPLATE_FILE)
    if default_file.is_file():
        files[DEFAULT_TEMPLATE] = default_file.read_text(encoding="utf-8")
    extra_folder = path.with_name(ADDITIONAL_TEMPLATES_FOLDER)
    if extra_folder.is_dir():
        files.update((file.stem, file.read_text(encoding="utf-8")) for file in sorted(extra_folder.glob("*.jinja")))
    if files:
        return files
    value = config.get("chat_template")
    if value is None:
        raise ChatTemplateError(f"{path}: no chat_template, and no {CHAT_TEMPLATE_FILE} beside it")
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(item, dict) and isinstance(item.get("name"), str) and "template" in item for item in value
    ):
        return {item["name"]: item["template"] for item in value}
    raise ChatTemplateError(f"{path}: chat_template is neither a string nor a list of {{name, template}}")


def _config_special_tokens(config: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """The named special tokens a tokenizer_config.json defines (strings, or AddedToken dicts)."""
    tokens: dict[str, Any] = {}
    for key in SPECIAL_TOKEN_KEYS:
        if config.get(key) is not None:
            tokens[key] = _token_content(config[key], key, path)
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list) and extra:
        tokens["additional_special_tokens"] = [
            _token_content(item, "additional_special_tokens", path) for item in extra
        ]
    return tokens


def _token_content(value: Any, key: str, path: Path) -> str:
    if isinstance(value, str):
        return value
    content = value.get("content") if isinstance(value, dict) else None
    if isinstance(content, str):
        return content
    raise ChatTemplateError(f"{path}: {key} is neither a string nor a dict with a string 'content'")


# vLLM's content-format detection (vllm/renderers/hf.py, _detect_content_format), on the AST.


def detect_content_format(ast: jinja2.nodes.Template) -> ContentFormat:
    """``"openai"`` if the template loops over a message's content, else ``"string"``."""
    try:
        message_names = set(_loop_targets(ast, _aliases(ast, "messages"), key=None))
        found = next(_loop_targets(ast, message_names, key="content"), None)
    except _Unsupported:
        return "string"  # vLLM falls back to its default on a shape it cannot read
    return "string" if found is None else "openai"


class _Unsupported(Exception):
    pass


def _is_access(node: jinja2.nodes.Node, names: set[str], key: str | None) -> bool:
    """``name`` (or ``name[key]`` / ``name.key``), possibly under filters, tests or a slice."""
    while True:
        wrapped = isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None
        sliced = isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)
        if not (wrapped or sliced):
            break
        node = node.node  # type: ignore[attr-defined]
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name in names
    if isinstance(node, jinja2.nodes.Getitem):
        is_key = isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    elif isinstance(node, jinja2.nodes.Getattr):
        is_key = node.attr == key
    else:
        return False
    inner = node.node
    return is_key and isinstance(inner, jinja2.nodes.Name) and inner.ctx == "load" and inner.name in names


def _aliases(ast: jinja2.nodes.Template, root: str) -> set[str]:
    """``root`` and every variable assigned from it (or from such a variable), transitively."""
    names, pending = {root}, [root]
    while pending:
        current = {pending.pop()}
        for assign in ast.find_all(jinja2.nodes.Assign):
            if _is_access(assign.node, current, key=None):
                if not isinstance(assign.target, jinja2.nodes.Name):
                    raise _Unsupported
                if assign.target.name not in names:
                    names.add(assign.target.name)
                    pending.append(assign.target.name)
    return names


def _loop_targets(ast: jinja2.nodes.Template, names: set[str], key: str | None) -> Iterator[str]:
    for loop in ast.find_all(jinja2.nodes.For):
        if _is_access(loop.iter, names, key):
            if not isinstance(loop.target, jinja2.nodes.Name):
                raise _Unsupported
            yield loop.target.name
