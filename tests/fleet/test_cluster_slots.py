"""Every Redis call of the gateway fits one Redis Cluster hash slot.

A Redis Cluster serves a multi-key command, a transaction or a script only when all its keys
hash to one slot (``CROSSSLOT`` otherwise), and a cluster client routes a script by the keys it
declares: a key the script touches without declaring it may live on another shard. So the keys
of each tenant carry its hash tag (``gw:{acme}:rpm``), and the ledger's its cell's (``{fleet}``,
``{fleet:c1}``: the simulated processes here are in two cells).

Real parts: three simulated gateway processes of ``loadtests/proofs/fleet_scale.py`` (the real limit
store and ``TenantLimiter``, fleet coordinator and ledger, prefix view, response affinity and
rollout store, each with its own clients) against a private ``redis-server``. Every command
the gateway's connections send is recorded on the way out (``pack_command``), and every command
a script runs inside Redis is read from ``MONITOR``; slots are computed by redis-py's
``key_slot``. Every script is loaded beforehand, so that each one runs by ``EVALSHA`` and its
declared keys are read from the command.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from redis.asyncio.connection import AbstractConnection
from redis.crc import key_slot

from loadtests.proofs.fleet_scale import Shared, SimConfig, SimProcess, script_names, script_texts
from tests.limitstore.redis_server import RedisProcess

NO_KEYS = frozenset(
    {"PING", "TIME", "SCRIPT", "HELLO", "CLIENT", "MULTI", "EXEC", "DISCARD", "INFO", "SELECT", "AUTH", "COMMAND"}
)
ALL_KEYS = frozenset({"DEL", "UNLINK", "EXISTS", "MGET", "TOUCH", "WATCH"})
SCRIPTS = frozenset({"EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "FCALL", "FCALL_RO"})


def text(value: Any) -> str:
    return bytes(value).decode(errors="replace") if isinstance(value, bytes | bytearray | memoryview) else str(value)


def keys_of(args: list[str]) -> list[str]:
    """The keys of one command (the key specs of the commands the gateway sends)."""
    name = args[0].split(" ")[0].upper()  # redis-py packs "SCRIPT EXISTS" as one argument
    if name in NO_KEYS or len(args) < 2:
        return []
    if name in SCRIPTS:
        return args[3 : 3 + int(args[2])]
    if name in ("XREAD", "XREADGROUP"):
        streams = [a.upper() for a in args].index("STREAMS")
        rest = args[streams + 1 :]
        return rest[: len(rest) // 2]
    if name in ALL_KEYS:
        return args[1:]
    if name == "MSET":
        return args[1::2]
    return [args[1]]


def slots(keys: list[str]) -> set[int]:
    return {key_slot(key.encode()) for key in keys}


@dataclass
class Recorded:
    """What the gateway sent, and what its scripts did in Redis."""

    commands: list[tuple[int, list[str]]] = field(default_factory=list)
    """(connection, command) in the order packed: a transaction's commands are contiguous."""
    scripts: list[tuple[str, list[str], list[str]]] = field(default_factory=list)
    """(script name, declared keys, keys its commands touched) of each script run, from MONITOR."""

    def transactions(self) -> list[list[list[str]]]:
        """The commands of each MULTI ... EXEC, per connection."""
        open_: dict[int, list[list[str]]] = {}
        done: list[list[list[str]]] = []
        for connection, args in self.commands:
            name = args[0].upper()
            if name == "MULTI":
                open_[connection] = []
            elif name == "EXEC" and connection in open_:
                done.append(open_.pop(connection))
            elif connection in open_:
                open_[connection].append(args)
        return done


def watch(port: int, recorded: Recorded, stop: threading.Event, ready: threading.Event) -> None:
    """MONITOR: each script run (``EVALSHA`` from a client) and the commands it ran (``lua``)."""
    names = script_names()
    current: tuple[str, list[str], list[str]] | None = None
    with redis.Redis(port=port) as client, client.monitor() as monitor:
        ready.set()
        while not stop.is_set():  # woken by any command: the fixture sends one after setting ``stop``
            line = monitor.next_command()
            tokens = line["command"].split(" ")
            if line["client_type"] == "lua" and current is not None:
                current[2].extend(keys_of(tokens))
            elif tokens[0].upper() in SCRIPTS:
                assert tokens[0].upper().startswith("EVALSHA"), f"a script sent by EVAL, not loaded: {line}"
                current = (names.get(tokens[1], tokens[1]), keys_of(tokens), [])
                recorded.scripts.append(current)
            else:
                current = None


def every_path(url: str) -> SimConfig:
    """Three simulated processes in two cells, whose requests take every path that writes a key."""
    return SimConfig(
        urls=dict.fromkeys(("limits", "ledger", "prefix", "responses"), url),
        key_prefix="gw:",
        processes=3,
        rate=25.0,
        hold_s=0.05,
        tenants=4,
        backends=2,
        blocks=4,
        responses_share=0.5,
        followup_share=0.5,
        rollouts=1,
        limit_headroom=2.0,
        rollout_interval_s=0.2,
        sealed_ids=False,  # the shared map's scripts run only without sealed response ids
        fleet_cells=2,
    )


async def run_fleet(server: RedisProcess) -> None:
    """Three simulated processes for two seconds, with every path that writes a key."""
    config = every_path(server.url)
    shared = Shared()
    sims = [SimProcess(i, config, shared) for i in range(3)]
    await asyncio.gather(*(sim.start() for sim in sims))
    await asyncio.sleep(2.0)
    sim = sims[0]
    tenant = sim.tenants[0]
    await sim.limiter.charge_rejected(tenant)
    await sim.store.slots_in_use(tenant.name)
    if shared.ids:
        creator, name, response_id = shared.ids[-1]
        sims[creator].affinity.forget(response_id, name)
        await sims[creator].affinity.shared_now()
    await asyncio.gather(*(sim.stop() for sim in sims))
    assert shared.counts["requests"] > 20, "requests went through every path"
    assert shared.counts["followups_elsewhere"] > 0, "a follow-up looked a response up in Redis"


@pytest.fixture(scope="module")
def recorded() -> Iterator[Recorded]:
    server = RedisProcess()
    server.start()
    result = Recorded()
    pack = AbstractConnection.pack_command

    def recording(self: AbstractConnection, *args: Any) -> list[bytes]:
        result.commands.append((id(self), [text(a) for a in args]))
        return pack(self, *args)

    stop, ready = threading.Event(), threading.Event()
    monitor = threading.Thread(target=watch, args=(server.port, result, stop, ready), daemon=True)
    try:
        with server.client() as client:
            for source in script_texts().values():
                client.script_load(source)
        monitor.start()
        assert ready.wait(10), "MONITOR started"
        AbstractConnection.pack_command = recording  # type: ignore[method-assign]
        try:
            asyncio.run(run_fleet(server))
        finally:
            AbstractConnection.pack_command = pack  # type: ignore[method-assign]
        deadline = time.monotonic() + 5
        while len(result.scripts) < 10 and time.monotonic() < deadline:
            time.sleep(0.01)
        yield result
    finally:
        stop.set()
        if monitor.is_alive():
            with server.client() as client:
                client.ping()
            monitor.join(5)
        server.stop()


def test_every_command_and_script_of_the_gateway_keeps_its_keys_in_one_slot(recorded: Recorded) -> None:
    sent = {args[0].upper() for _, args in recorded.commands}
    assert {"EVALSHA", "XADD", "XREAD", "MULTI"} <= sent, f"every kind of call was made: {sorted(sent)}"
    spread = [args[:5] for _, args in recorded.commands if len(slots(keys_of(args))) > 1]
    assert not spread, f"commands whose keys span several slots: {spread[:5]}"


def test_every_transaction_keeps_its_keys_in_one_slot(recorded: Recorded) -> None:
    transactions = recorded.transactions()
    assert transactions, "the rollout store's add_counts ran a MULTI ... EXEC"
    spread = [t for t in transactions if len(slots([k for args in t for k in keys_of(args)])) > 1]
    assert not spread, f"transactions across slots: {spread[:3]}"


def test_every_key_a_script_touches_is_in_the_slot_of_its_declared_keys(recorded: Recorded) -> None:
    names = {name for name, _, _ in recorded.scripts}
    assert {"ledger.SYNC", "sharing.PUBLISH", "sharing.LOOKUP", "store.LEAD"} <= names, names
    spread = sorted({name for name, declared, touched in recorded.scripts if len(slots(declared + touched)) > 1})
    assert not spread, f"scripts whose keys span several slots: {spread}"


def test_every_key_a_script_touches_is_declared(recorded: Recorded) -> None:
    undeclared = sorted({name for name, declared, touched in recorded.scripts if not set(touched) <= set(declared)})
    assert not undeclared, f"scripts that touch keys they do not declare: {undeclared}"
