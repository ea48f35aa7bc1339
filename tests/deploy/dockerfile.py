"""A Dockerfile read as Docker reads it, for the image and compose checks (no Docker engine here)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field


@dataclass
class Stage:
    """One ``FROM`` of the Dockerfile and its instructions, as (KEYWORD, arguments) pairs."""

    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for word, args in self.instructions if word == keyword]

    def one(self, keyword: str) -> str:
        found = self.all(keyword)
        assert len(found) == 1, f"stage {self.name or self.base}: {len(found)} {keyword} instructions, not 1"
        return found[0]


def dockerfile_stages(text: str) -> list[Stage]:
    """The stages, with ``ARG`` defaults declared before the first ``FROM`` substituted into it
    (as Docker does); comment lines dropped, continued lines joined."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line.removesuffix("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            logical.append(pending)
            pending = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), words[0])
            stages.append(Stage(base, words[2] if len(words) == 3 and words[1].upper() == "AS" else None))
        else:
            assert stages, f"{keyword} before the first FROM"
            stages[-1].instructions.append((keyword, rest))
    return stages


def exec_form(args: str) -> list[str]:
    """A JSON-array instruction's argv; fails on the shell form (``ENTRYPOINT cmd args``)."""
    try:
        argv = json.loads(args)
    except json.JSONDecodeError:
        argv = None
    assert isinstance(argv, list), f"not the exec (JSON array) form: {args}"
    assert all(isinstance(word, str) for word in argv), args
    return argv
