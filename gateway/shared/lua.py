"""The gateway's Redis scripts, read once from the ``.lua`` files beside the modules that run them.

Why files, not Python strings: a ``.lua`` file is read, diffed and reviewed as Lua (an editor
highlights it, a linter may check it), its comment block says what it does, its ``KEYS``,
``ARGV`` and reply, and ``tests/shared/test_lua.py`` runs each one against a real Redis, so a
syntax error fails a test of its own. They ship as package data (``pyproject.toml``:
``*.lua`` in every package), and each module reads its files once, at import:

    SYNC = lua_script("gateway.fleet", "ledger.lua")
    SYNC = lua_script("gateway.limitstore", "clock.lua", "purge.lua", "sync.lua")

Redis has no ``require``: a script that needs shared code (a clock, a purge) names the files in
the order they are joined, the shared ones first. Every argument is a literal string, so that
the test can tell every file is read by some module. The text is what Redis runs: ``EVALSHA``
names a script by the SHA-1 of exactly this text.
"""

from __future__ import annotations

from importlib.resources import files


def lua_script(package: str, *names: str) -> str:
    """The text of the files ``names`` of ``package`` (dotted), joined in order: one script."""
    if not names:
        raise ValueError("lua_script needs at least one file")
    folder = files(package)
    return "".join(folder.joinpath(name).read_text(encoding="utf-8") for name in names)
