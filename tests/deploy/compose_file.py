"""``deploy/compose.yaml`` read the way Docker Compose reads it, for tests that cannot run Docker.

What Compose does before it starts anything, and the tests need: ``${VAR:-default}``
interpolation (``interpolate``), bind mounts resolved against the file's directory
(``Stack.mounts``, ``Stack.host_path``), published ports (``Stack.published``), and each
container's command line: the image's ``ENTRYPOINT`` (from the Dockerfile the service builds,
or ``PULLED_ENTRYPOINTS`` for a pulled image) followed by the service's ``command``, which
replaces the image's ``CMD`` (``Stack.argv``). ``set_flag`` rewrites one flag of such a
command line (a container's address to a loopback one, a mounted path to a temporary copy).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.conftest import DEPLOY
from tests.deploy.dockerfile import dockerfile_stages, exec_form

COMPOSE = DEPLOY / "compose.yaml"

PULLED_ENTRYPOINTS: dict[str, list[str]] = {
    # /bin/prometheus; its flags are the service's command.
    "prom/prometheus": ["prometheus"],
    # docker-entrypoint.sh runs a command that starts with redis-server as given (as user redis).
    "redis": [],
}
"""The ``ENTRYPOINT`` of each image the stack pulls, as far as the tests run it (Grafana: not run)."""

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_]\w*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<bare>[A-Za-z_]\w*))"
)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """``value`` (a parsed compose file or part of it) with Compose's interpolation applied to every
    string: ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: _substitute(m, env), value)
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    return value


def _substitute(match: re.Match[str], env: Mapping[str, str]) -> str:
    if match["escaped"]:
        return "$"
    name = match["braced"] or match["bare"]
    value, op, arg = env.get(name), match["op"], match["arg"]
    unset = value is None or (op is not None and op.startswith(":") and value == "")
    if op in (":-", "-") and unset:
        return arg
    if op in (":?", "?") and unset:
        raise ValueError(f"{name}: {arg}")
    return value or ""


@dataclass(frozen=True, slots=True)
class Mount:
    """One entry of a service's ``volumes``: a bind mount (``source`` a host path) or a named volume."""

    target: str
    source: Path | None
    volume: str | None
    read_only: bool


@dataclass(frozen=True, slots=True)
class Published:
    host_ip: str
    host_port: int
    container_port: int


@dataclass(frozen=True, slots=True)
class ImageConfig:
    """What ``docker run`` takes from an image: its base, ``ENTRYPOINT`` and ``CMD`` (exec form),
    and whether it declares a ``HEALTHCHECK``."""

    base: str
    entrypoint: list[str] | None
    cmd: list[str] | None
    healthcheck: bool


def parse_dockerfile(text: str, base_config: ImageConfig | None = None) -> ImageConfig:
    """The final stage of a Dockerfile; ``base_config`` is the image its ``FROM`` names, when known
    (what the stage does not set, it inherits). The stack accepts only the exec form of
    ``ENTRYPOINT`` and ``CMD``: a shell in front of the process would not pass SIGTERM on."""
    stage = dockerfile_stages(text)[-1]
    entrypoint, cmd, healthcheck = None, None, False
    for keyword, rest in stage.instructions:
        if keyword == "ENTRYPOINT":
            entrypoint, cmd = exec_form(rest), None  # a new ENTRYPOINT resets an inherited CMD
        elif keyword == "CMD":
            cmd = exec_form(rest)
        elif keyword == "HEALTHCHECK":
            healthcheck = not rest.upper().startswith("NONE")
    if base_config is not None:
        if entrypoint is None:
            entrypoint, cmd = base_config.entrypoint, base_config.cmd if cmd is None else cmd
        healthcheck = healthcheck or base_config.healthcheck
    return ImageConfig(stage.base, entrypoint, cmd, healthcheck)


class Stack:
    """The interpolated compose file (``load``) and what Compose derives from it."""

    def __init__(self, document: dict[str, Any], path: Path = COMPOSE) -> None:
        self.document = document
        self.path = path
        self.services: dict[str, dict[str, Any]] = document["services"]

    def mounts(self, service: str) -> list[Mount]:
        found = []
        for entry in self.services[service].get("volumes", []):
            assert isinstance(entry, str), f"{service}: use the short syntax SOURCE:TARGET[:ro] ({entry!r})"
            source, target, *mode = entry.split(":")
            read_only = mode == ["ro"]
            if source.startswith((".", "/")):
                found.append(Mount(target, (self.path.parent / source).resolve(), None, read_only))
            else:
                found.append(Mount(target, None, source, read_only))
        return found

    def host_path(self, service: str, container_path: str) -> Path:
        """Where ``container_path`` of ``service`` is on this machine, through its bind mounts."""
        for mount in sorted(self.mounts(service), key=lambda m: -len(m.target)):
            inside = Path(container_path)
            if mount.source is not None and inside.is_relative_to(mount.target):
                return mount.source / inside.relative_to(mount.target)
        raise AssertionError(f"{service}: {container_path} is not in a bind mount")

    def published(self, service: str) -> list[Published]:
        ports = []
        for entry in self.services[service].get("ports", []):
            host_ip, host_port, container_port = str(entry).split(":")
            ports.append(Published(host_ip, int(host_port), int(container_port)))
        return ports

    def environment(self, service: str) -> dict[str, str]:
        env = self.services[service].get("environment", {})
        assert isinstance(env, dict), f"{service}: environment as a mapping"
        return {name: str(value) for name, value in env.items()}

    def depends_on(self, service: str) -> dict[str, str]:
        """The services ``service`` waits for, with the condition (``service_started`` when unsaid)."""
        deps = self.services[service].get("depends_on", {})
        if isinstance(deps, list):
            return dict.fromkeys(deps, "service_started")
        return {name: spec.get("condition", "service_started") for name, spec in deps.items()}

    def image(self, service: str) -> ImageConfig | None:
        """The image the service builds (None for a pulled one)."""
        build = self.services[service].get("build")
        if build is None:
            return None
        if isinstance(build, str):
            build = {"context": build}
        context = (self.path.parent / build["context"]).resolve()
        base = None
        inline = build.get("dockerfile_inline")
        if inline is not None:
            contexts = build.get("additional_contexts", {})
            first = dockerfile_stages(inline)[-1].base
            source = contexts.get(first, "")
            if source.startswith("service:"):
                base = self.image(source.removeprefix("service:"))
            return parse_dockerfile(inline, base)
        return parse_dockerfile((context / build.get("dockerfile", "Dockerfile")).read_text())

    def argv(self, service: str) -> list[str]:
        """The container's command line: the entrypoint, then ``command`` (or the image's ``CMD``)."""
        spec = self.services[service]
        image = self.image(service)
        if image is not None:
            entrypoint, cmd = image.entrypoint or [], image.cmd or []
        else:
            name = spec["image"].rsplit(":", 1)[0]
            assert name in PULLED_ENTRYPOINTS, f"{service}: the entrypoint of {name} is not known here"
            entrypoint, cmd = PULLED_ENTRYPOINTS[name], []
        if "entrypoint" in spec:
            entrypoint, cmd = _words(spec["entrypoint"]), []
        if "command" in spec:
            cmd = _words(spec["command"])
        return [*entrypoint, *cmd]

    def start_order(self) -> list[str]:
        """The services in an order Compose may start them (each after what it depends on)."""
        order: list[str] = []

        def visit(name: str, path: tuple[str, ...]) -> None:
            assert name not in path, f"depends_on cycle: {' -> '.join((*path, name))}"
            for dependency in self.depends_on(name):
                visit(dependency, (*path, name))
            if name not in order:
                order.append(name)

        for name in self.services:
            visit(name, ())
        return order


def _words(value: str | Sequence[str]) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else list(value)


def load(env: Mapping[str, str] | None = None, path: Path = COMPOSE) -> Stack:
    """``path`` parsed and interpolated with ``env`` (empty by default: every default applies)."""
    return Stack(interpolate(yaml.safe_load(path.read_text()), env or {}), path)


def set_flag(argv: Sequence[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag`` (``--flag value`` or ``--flag=value``, every occurrence) set to
    ``value``; appended when absent."""
    out: list[str] = []
    found = False
    words = iter(argv)
    for word in words:
        if word == flag:
            out += [flag, value]
            next(words, None)
            found = True
        elif word.startswith(flag + "="):
            out.append(f"{flag}={value}")
            found = True
        else:
            out.append(word)
    return out if found else [*out, flag, value]


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The last value of ``flag`` in ``argv`` (either form); None when absent."""
    value = None
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value
