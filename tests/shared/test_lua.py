"""The gateway's Lua scripts are package data files, each read by a module, each run once in a real Redis.

Why: a script kept in a Python string is invisible to a Lua reader, and a syntax error in one
showed only in whichever behaviour test happened to reach it. Now every script is a ``.lua``
file beside the module that runs it, read once at import by ``gateway/shared/lua.py``'s
``lua_script``. The first tests read the source: every ``.lua`` file under ``gateway/`` is read
by some module (no orphan), no Python file holds Lua any more, and every script handed to Redis
(``register_script``, ``Script.of``) comes from ``lua_script``. The others compile every file in
Redis and run every script once against the shared Redis on 127.0.0.1:6379, under a key prefix
of their own, with a minimal valid call, and check the reply has the shape its file documents.
How the scripts behave is tested in depth elsewhere (``tests/limitstore``, ``tests/rollout``,
``tests/fleet``, ``tests/responses``).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

import gateway.fleet.ledger
import gateway.limitstore.scripts
import gateway.responses.sharing
import gateway.rollout.store
from gateway.fleet.ledger import BackendReport, ledger_base
from tests.limitstore.redis_server import REDIS_URL, drop_keys, shared_client, unique_prefix

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = ROOT / "gateway"
LUA_FILES = sorted(GATEWAY.rglob("*.lua"))
PYTHON_FILES = sorted(GATEWAY.rglob("*.py"))
SCRIPT_TAKERS = frozenset({"register_script", "of", "eval"})
"""Calls that hand a script's text to Redis: redis-py's ``register_script`` and ``eval``, and
``response_sharing.Script.of``."""


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def lua_calls(tree: ast.AST) -> Iterator[ast.Call]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name == "lua_script":
                yield node


def files_read(call: ast.Call, where: str) -> list[Path]:
    """The files one ``lua_script("package", "a.lua", ...)`` call reads (all arguments literal)."""
    values = [arg.value if isinstance(arg, ast.Constant) else None for arg in call.args]
    if len(values) < 2 or not all(isinstance(v, str) for v in values):
        pytest.fail(
            f"{where}:{call.lineno}: lua_script takes literal strings, so that this test can tell what it reads"
        )
    package, *names = (str(v) for v in values)
    return [ROOT.joinpath(*package.split("."), name) for name in names]


def scripts_by_module() -> dict[str, set[str]]:
    """Module -> the module-level names bound to a ``lua_script(...)`` call, or imported from a
    module where they are."""
    trees = {module_name(path): ast.parse(path.read_text()) for path in PYTHON_FILES}
    loaded: dict[str, set[str]] = {name: set() for name in trees}
    for name, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and any(lua_calls(node.value)):
                loaded[name].update(target.id for target in node.targets if isinstance(target, ast.Name))
    for name, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module in loaded:
                loaded[name].update(a.asname or a.name for a in node.names if a.name in loaded[node.module])
    return loaded


def test_every_lua_file_under_gateway_is_read_by_some_module() -> None:
    read: set[Path] = set()
    for path in PYTHON_FILES:
        for call in lua_calls(ast.parse(path.read_text())):
            read.update(files_read(call, relative(path)))
    missing = sorted(relative(p) for p in read if not p.is_file())
    assert not missing, f"lua_script reads files that do not exist: {missing}"
    assert LUA_FILES, "the gateway has Lua files"
    orphans = sorted(relative(p) for p in set(LUA_FILES) - read)
    assert not orphans, f".lua files no module reads: {orphans}"


def test_no_python_file_of_the_gateway_holds_lua() -> None:
    holding = sorted(relative(path) for path in PYTHON_FILES if "redis.call" in path.read_text())
    assert not holding, f"Lua in Python source (move it to a .lua file beside the module): {holding}"


def test_every_script_handed_to_redis_comes_from_a_lua_file() -> None:
    loaded = scripts_by_module()
    taken: list[str] = []
    strays: list[str] = []
    for path in PYTHON_FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
                continue
            if node.func.attr not in SCRIPT_TAKERS:
                continue
            if node.func.attr == "of" and not (
                isinstance(node.func.value, ast.Name) and node.func.value.id == "Script"
            ):
                continue
            where = f"{relative(path)}:{node.lineno}"
            first = node.args[0]
            if isinstance(first, ast.Name) and first.id in loaded[module_name(path)]:
                taken.append(where)
            else:
                strays.append(f"{where}: {ast.unparse(first)}")
    assert len(taken) >= 8, f"the ledger's, limit store's, rollout store's and shared responses' scripts: {taken}"
    assert not strays, f"scripts handed to Redis that lua_script did not read: {strays}"


@pytest.mark.parametrize("path", LUA_FILES, ids=[str(p.relative_to(GATEWAY)) for p in LUA_FILES])
def test_every_lua_file_compiles_in_redis(path: Path) -> None:
    with shared_client() as client:
        try:
            client.script_load(path.read_text())
        except redis.ResponseError as error:
            pytest.fail(f"{relative(path)} does not compile: {error}")


# Each script run once: a minimal valid call, and the reply its file documents.

Eval = Callable[[str, list[str], list[Any]], Any]


def limit_store_sync(run: Eval, prefix: str) -> None:
    """One slot of 4 and 10 tokens of a bucket of 100: granted, {refused, wanted, held, in use, held, level}."""
    reply = run(gateway.limitstore.scripts.SYNC, *limit_sync_call(prefix))
    assert reply == [0, 0, 1, 1, b"10", b"90"]


def limit_sync_call(prefix: str) -> tuple[list[str], list[Any]]:
    keys = [f"{prefix}{{acme}}:held", f"{prefix}{{acme}}:leases", f"{prefix}{{acme}}:rpm"]
    slot = ["4", "0", "0", "0", "1", "0"]  # limit, in use, believed, keep, need, want
    bucket = ["rpm", "100.0", "1.0", "0.0", "0.0", "0.0", "0.0", "10.0", "0.0"]  # ... adjust, need, want
    return keys, ["", "", "replica-1", "10.0", "1.0", *slot, *bucket]


def limit_store_in_use(run: Eval, prefix: str) -> None:
    """The slots held fleet-wide: an integer, the one slot a sync just granted."""
    keys, args = limit_sync_call(prefix)
    run(gateway.limitstore.scripts.SYNC, keys, args)
    assert run(gateway.limitstore.scripts.IN_USE, keys[:2], ["", ""]) == 1


def ledger_call(prefix: str) -> tuple[list[str], list[Any]]:
    backend = BackendReport("b", 4, 1000, {}, {}, 0, 0, {}, {}, {})
    base = ledger_base(prefix, "")
    keys = [f"{base}:replicas", f"{base}:backends", f"{base}:epoch", f"{base}:b:b"]
    report = orjson.dumps([backend.as_json()])
    return keys, ["replica-1", 10.0, report, base, 600.0, b"[]", "", "epoch-1", 8]


def fleet_ledger_sync(run: Eval, prefix: str) -> None:
    """JSON: how many processes are live, the epoch, a grant per backend reported, the tombstones."""
    answer = orjson.loads(run(gateway.fleet.ledger.SYNC, *ledger_call(prefix)))
    assert answer["live"] == 1
    assert answer["epoch"] == "epoch-1"
    assert answer["backends"]["b"]["hold"]["req"] == 4, "the only process holds the whole capacity"
    assert answer["tombstones"] in ({}, [])


def fleet_ledger_leave(run: Eval, prefix: str) -> None:
    """The number of processes removed: 1 for a process that had synced."""
    keys, args = ledger_call(prefix)
    run(gateway.fleet.ledger.SYNC, keys, args)
    assert run(gateway.fleet.ledger.LEAVE, keys, ["replica-1", ledger_base(prefix, "")]) == 1


def rollout_lead(run: Eval, prefix: str) -> None:
    """1 while the caller holds the lease after the call, 0 when another one does."""
    keys = [f"{prefix}rollout:r:lease"]
    assert run(gateway.rollout.store.LEAD, keys, ["me", 10_000]) == 1
    assert run(gateway.rollout.store.LEAD, keys, ["me", 10_000]) == 1
    assert run(gateway.rollout.store.LEAD, keys, ["other", 10_000]) == 0


def responses_keys(prefix: str) -> list[str]:
    return [f"{prefix}{{acme}}:responses", f"{prefix}{{acme}}:responses:expiry"]


def responses_publish(run: Eval, prefix: str) -> None:
    """The number of entries dropped: none, under the bound."""
    args = ["field", b'{"backend":"b","model":"m"}', 60_000, 10]
    assert run(gateway.responses.sharing.PUBLISH.text, responses_keys(prefix), args) == 0


def responses_lookup(run: Eval, prefix: str) -> None:
    """{entry, microseconds left} for an entry written, nil for an unknown one."""
    keys, entry = responses_keys(prefix), b'{"backend":"b","model":"m"}'
    run(gateway.responses.sharing.PUBLISH.text, keys, ["field", entry, 60_000, 10])
    found, left = run(gateway.responses.sharing.LOOKUP.text, keys, ["field"])
    assert found == entry
    assert 0 < left <= 60_000_000
    assert run(gateway.responses.sharing.LOOKUP.text, keys, ["unknown"]) is None


def responses_unpublish(run: Eval, prefix: str) -> None:
    """1; the entry is gone."""
    keys = responses_keys(prefix)
    run(gateway.responses.sharing.PUBLISH.text, keys, ["field", b"{}", 60_000, 10])
    assert run(gateway.responses.sharing.UNPUBLISH.text, keys, ["field"]) == 1
    assert run(gateway.responses.sharing.LOOKUP.text, keys, ["field"]) is None


CALLS: dict[str, Callable[[Eval, str], None]] = {
    "the limit store's sync grants a slot and tokens": limit_store_sync,
    "the limit store's in-use count reads the slots held": limit_store_in_use,
    "the fleet ledger's sync grants the only process everything": fleet_ledger_sync,
    "the fleet ledger's leave removes the process": fleet_ledger_leave,
    "the rollout lease is taken, renewed, and refused to another": rollout_lead,
    "a shared response is published": responses_publish,
    "a shared response is looked up": responses_lookup,
    "a shared response is unpublished": responses_unpublish,
}


@pytest.fixture
def prefix() -> Iterator[str]:
    prefix = unique_prefix()
    yield prefix
    drop_keys(REDIS_URL, prefix)


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_every_script_runs_in_redis_and_answers_as_documented(call: Callable[[Eval, str], None], prefix: str) -> None:
    with shared_client() as client:

        def run(script: str, keys: list[str], args: list[Any]) -> Any:
            return client.eval(script, len(keys), *keys, *args)

        call(run, prefix)
