"""Where a canary rollout's state and counts live, shared by the gateway's processes and kept across restarts.

Every process tallies the requests of a rollout's two arms and, once per interval, adds its
counts (``{"candidate:requests": 41, "baseline:errors": 2, ...}``) to the totals of the rollout's
*current step*; one process at a time, the holder of the rollout's *lease*, reads the step's
totals, judges (``gateway/rollout/judge.py``) and saves the new state; every process loads the
state each interval and routes by it. The state is opaque here: a JSON object, stored as given.

**Counts are kept per step**, so that what a process adds late (it still follows the previous
step until its next load) lands in the step it observed, never in the next step's fresh test.
A caller that could come back to a step index it already used (an operator moving a rollout
back) must make the key or the step unique, or it would read the old step's totals again.

**Two layouts, one protocol (``RolloutStore``).**

* ``RedisRolloutStore``, for replicas on several hosts: the state is a JSON string at
  ``{prefix}rollout:{key}:state``, without a TTL (it must outlive every gateway); a step's counts
  are a hash ``{prefix}rollout:{key}:step:{step}``, added to by HINCRBY in one MULTI/EXEC per
  ``add_counts`` (a process's interval counts in all or not at all: the arms never drift apart),
  the hash expiring a day after its last add (old steps clean themselves up, the current one is
  refreshed every interval); the lease is ``{prefix}rollout:{key}:lease``, one Lua script that
  takes it with ``SET NX PX`` or renews it when its holder is the caller. Each call touches one
  key, so a Redis Cluster needs no hash tags. Every call is bounded by ``timeout_s``
  (``BUDGET_S`` unless the caller names one) in the event loop's free time, by the client's
  shared store (``SharedStore.budget``, ``gateway/shared/store.py``).
* ``FileRolloutStore``, for a gateway without Redis (one process, or ``--workers N`` on one
  host): one JSON file per key, ``{"state": ..., "counts": {"<step>": {...}}, "lease":
  {"holder": ..., "until": <epoch s>}}``, changed under an exclusive ``flock`` of a sibling
  ``.lock`` file (processes and threads alike) and replaced whole (temp file, fsync,
  ``os.replace``, fsync of the directory): a crash leaves the old file or the new one, never
  half of one, so readers need no lock. Keys become file names by percent-encoding (no ``/``,
  no leading dot: a key cannot leave the directory); the disk is used from a worker thread
  (``asyncio.to_thread``), never on the event loop.

**When the store is down** (Redis unreachable or slower than ``timeout_s``, a disk error, a
stored value that is not what this module wrote), every call raises ``RolloutStoreUnavailable``
and nothing else. The caller then keeps the state it loaded last (traffic keeps its split) and
does not judge: a rollout never advances, nor rolls back, on partial counts. Counts it could not
add are lost for that interval; an ``add_counts`` that timed out may still have been applied
(all of it: it is one transaction), so re-adding them could count an interval twice.

**The lease** hands judging from process to process. ``try_lead(key, me, ttl_s)`` takes the
lease when it is free or expired, renews it when ``me`` holds it, and answers whether ``me``
holds it now. The leader calls it every interval, so the lease never lapses while it lives
(``ttl_s`` should be a few intervals); when it dies, hangs or loses the store, the lease
expires ``ttl_s`` after its last renewal and the next process to ask takes over, judging from
the stored state and the step's totals, which lose nothing by the change of hands. Leases are
not fences: a leader paused past its TTL may save once more after its successor took over, so a
leader should renew right before it saves. Redis times a lease by its own clock; the file store
by the host's wall clock (``time.time``), shared by the processes of one host.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import quote

import orjson

from gateway.shared.connect import RedisClient
from gateway.shared.lua import lua_script
from gateway.shared.store import FAILURES, SharedStore

T = TypeVar("T")

STEP_TTL_S = 86_400
"""A step's counts expire this long after their last add (Redis)."""
MAX_FILE_NAME = 200
"""Longer encoded keys are named by their SHA-256 instead (file names stop at 255 bytes)."""
BUDGET_S = 0.5
"""A Redis call's budget unless the caller names one, or the store's own (``state.timeout_ms``)
when that is longer. More than a request's: rollouts are loaded, counted and judged once an
interval, off every request's path, so a Redis too slow for requests still takes them, while a
call cut short loses the interval's counts, or its judgement."""


LEAD = lua_script("gateway.rollout", "lead.lua")
"""The judge's lease, taken or renewed in one step: 1 when the caller holds it after the call (``lead.lua``)."""


class RolloutStoreUnavailable(Exception):
    """The store could not answer (down, slow, unreadable): keep the last state, do not judge."""


class RolloutStore(Protocol):
    """A rollout's state, its counts per step and its judge's lease, shared by the gateway's processes.

    ``key`` names a rollout (``judge.rollout_key``); ``step`` is the step its counts belong to.
    Every method raises ``RolloutStoreUnavailable`` when the store cannot answer, and
    ``ValueError``/``TypeError`` for arguments it could never store (an empty key, a state that
    is not JSON, a count that is not an integer).
    """

    async def load(self, key: str) -> dict[str, Any] | None:
        """The state last saved under ``key``, as it was given; None if none ever was."""
        ...

    async def save(self, key: str, state: dict[str, Any]) -> None:
        """Replace the state of ``key``: a JSON object (str keys, finite numbers), kept without expiry."""
        ...

    async def add_counts(self, key: str, step: int, counts: Mapping[str, int]) -> None:
        """Add ``counts`` to the totals of ``step``, atomically (all of them or none)."""
        ...

    async def counts(self, key: str, step: int) -> dict[str, int]:
        """The totals of ``step``, summed over every process's adds (empty when none)."""
        ...

    async def try_lead(self, key: str, holder: str, ttl_s: float) -> bool:
        """Take or renew the judge's lease of ``key`` for ``ttl_s``; True while ``holder`` holds it."""
        ...

    async def aclose(self) -> None: ...


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"a rollout key must be a non-empty string, not {key!r}")
    return key


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a step must be an integer >= 0, not {step!r}")
    return step


def _check_counts(counts: Mapping[str, int]) -> dict[str, int]:
    """The non-zero counts, checked: str names, int amounts."""
    for name, amount in counts.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"a count's name must be a non-empty string, not {name!r}")
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise TypeError(f"count {name!r} must be an int, not {type(amount).__name__}")
    return {name: amount for name, amount in counts.items() if amount}


def _check_lease(holder: str, ttl_s: float) -> None:
    if not isinstance(holder, str) or not holder:
        raise ValueError(f"a lease holder must be a non-empty string, not {holder!r}")
    if not (math.isfinite(ttl_s) and ttl_s > 0):
        raise ValueError(f"a lease TTL must be a positive number of seconds, not {ttl_s!r}")


def _check_json(value: Any, where: str = "state") -> None:
    """Refuse what JSON would not give back as given: non-str keys, NaN or infinities, other types."""
    if isinstance(value, dict):
        for name, item in value.items():
            if not isinstance(name, str):
                raise TypeError(f"{where}: key {name!r} is not a string")
            _check_json(item, f"{where}.{name}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_json(item, f"{where}[{index}]")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: {value} has no JSON form")
    elif not isinstance(value, str | int | bool | None):
        raise TypeError(f"{where}: {type(value).__name__} is not JSON")


def _encode_state(state: dict[str, Any]) -> bytes:
    if not isinstance(state, dict):
        raise TypeError(f"a rollout state must be a dict, not {type(state).__name__}")
    _check_json(state)
    return orjson.dumps(state)


def _decode_state(raw: str | bytes, where: str) -> dict[str, Any]:
    try:
        state = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RolloutStoreUnavailable(f"{where}: what is stored is not JSON") from exc
    if not isinstance(state, dict):
        raise RolloutStoreUnavailable(f"{where}: what is stored is not a JSON object")
    return state


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisRolloutStore:
    """``RolloutStore`` in Redis (module docstring), shared by replicas on any number of hosts.

    ``RedisRolloutStore(shared.client, "gw:")`` on the process's shared client
    (``gateway/shared/store.py``; ``aclose`` leaves it open), or with ``owns_client=True`` on a
    client of its own, which ``aclose`` closes. ``timeout_s`` bounds each call, connection
    included, in the loop's free time (``BUDGET_S`` when None).
    """

    def __init__(
        self, client: RedisClient, prefix: str, timeout_s: float | None = None, *, owns_client: bool = False
    ) -> None:
        self.shared = SharedStore.of(client)
        """The store of ``client`` (``gateway/shared/store.py``): bounds each call, judges how it ended."""
        if timeout_s is None:
            timeout_s = max(BUDGET_S, self.shared.timeout_s)
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, not {timeout_s!r}")
        self.prefix = prefix
        self.timeout_s = timeout_s
        self._client = client
        self._owns_client = owns_client
        self._lead = client.register_script(LEAD)

    def __repr__(self) -> str:
        return f"RedisRolloutStore(prefix={self.prefix!r}, timeout_s={self.timeout_s})"

    def _name(self, key: str, part: str) -> str:
        return f"{self.prefix}rollout:{_check_key(key)}:{part}"

    @asynccontextmanager
    async def _bounded(self, operation: str, key: str) -> AsyncIterator[None]:
        """The one place Redis errors become ``RolloutStoreUnavailable``; at most ``timeout_s``."""
        try:
            async with self.shared.budget(self.timeout_s):
                yield
        except FAILURES as exc:
            detail = f"timed out after {self.timeout_s}s" if isinstance(exc, TimeoutError) else type(exc).__name__
            raise RolloutStoreUnavailable(f"rollout store: {operation} of {key!r} failed ({detail})") from exc

    async def load(self, key: str) -> dict[str, Any] | None:
        name = self._name(key, "state")
        async with self._bounded("load", key):
            raw = await self._client.get(name)
        return None if raw is None else _decode_state(raw, f"load of {key!r}")

    async def save(self, key: str, state: dict[str, Any]) -> None:
        name, blob = self._name(key, "state"), _encode_state(state)
        async with self._bounded("save", key):
            await self._client.set(name, blob)

    async def add_counts(self, key: str, step: int, counts: Mapping[str, int]) -> None:
        name, amounts = self._name(key, f"step:{_check_step(step)}"), _check_counts(counts)
        if not amounts:
            return
        async with self._bounded("add_counts", key), self._client.pipeline(transaction=True) as pipe:
            for field, amount in amounts.items():
                pipe.hincrby(name, field, amount)
            pipe.expire(name, STEP_TTL_S)
            await pipe.execute()

    async def counts(self, key: str, step: int) -> dict[str, int]:
        name = self._name(key, f"step:{_check_step(step)}")
        async with self._bounded("counts", key):
            raw = await self._client.hgetall(name)
        try:
            return {_text(field): int(value) for field, value in raw.items()}
        except ValueError as exc:
            raise RolloutStoreUnavailable(f"counts of {key!r}: a stored count is not an integer") from exc

    async def try_lead(self, key: str, holder: str, ttl_s: float) -> bool:
        _check_lease(holder, ttl_s)
        name = self._name(key, "lease")
        ttl_ms = max(1, math.ceil(ttl_s * 1000))
        async with self._bounded("try_lead", key):
            held = await self._lead(keys=[name], args=[holder, ttl_ms])
        return bool(held)

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


def file_name(key: str) -> str:
    """The file name (without suffix) of ``key``: percent-encoded, so no ``/`` and no leading dot.

    The encoding is one-to-one (distinct keys never share a file); a name past ``MAX_FILE_NAME``
    characters is replaced by ``#`` and the key's SHA-256, which no encoded name starts with."""
    name = quote(_check_key(key), safe="")
    if name.startswith("."):
        name = "%2E" + name[1:]
    if len(name) > MAX_FILE_NAME:
        name = "#" + hashlib.sha256(key.encode()).hexdigest()
    return name


class FileRolloutStore:
    """``RolloutStore`` in one directory (module docstring), for the processes of one host.

    ``FileRolloutStore(Path("/var/lib/gateway/rollouts"))``; the directory is created on the
    first change. Several stores (in one process or many) may share a directory.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def __repr__(self) -> str:
        return f"FileRolloutStore({str(self.directory)!r})"

    def path_of(self, key: str) -> Path:
        """The JSON file of ``key`` (always directly inside the directory)."""
        path = self.directory / f"{file_name(key)}.json"
        if path.parent != self.directory:  # cannot happen with the encoding above; never write elsewhere
            raise ValueError(f"rollout key {key!r} does not name a file inside {self.directory}")
        return path

    async def _run(self, operation: str, key: str, work: Callable[[], T]) -> T:
        """``work()`` in a worker thread; disk errors become ``RolloutStoreUnavailable``."""
        try:
            return await asyncio.to_thread(work)
        except OSError as exc:
            raise RolloutStoreUnavailable(f"rollout store: {operation} of {key!r} failed ({exc})") from exc

    async def load(self, key: str) -> dict[str, Any] | None:
        path = self.path_of(key)
        document = await self._run("load", key, lambda: _read(path))
        state = document.get("state")
        if state is not None and not isinstance(state, dict):
            raise RolloutStoreUnavailable(f"load of {key!r}: the stored state is not a JSON object")
        return state

    async def save(self, key: str, state: dict[str, Any]) -> None:
        path = self.path_of(key)
        _encode_state(state)  # refuse what JSON would change here, not in the worker thread

        def change(document: dict[str, Any]) -> bool:
            document["state"] = state
            return True

        await self._run("save", key, lambda: _update(path, change))

    async def add_counts(self, key: str, step: int, counts: Mapping[str, int]) -> None:
        path, label, amounts = self.path_of(key), str(_check_step(step)), _check_counts(counts)
        if not amounts:
            return

        def change(document: dict[str, Any]) -> bool:
            totals = _section(_section(document, "counts"), label)
            for field, amount in amounts.items():
                totals[field] = _count(totals.get(field, 0)) + amount
            return True

        await self._run("add_counts", key, lambda: _update(path, change))

    async def counts(self, key: str, step: int) -> dict[str, int]:
        path, label = self.path_of(key), str(_check_step(step))
        document = await self._run("counts", key, lambda: _read(path))
        totals = _section(_section(document, "counts"), label)
        return {field: _count(value) for field, value in totals.items()}

    async def try_lead(self, key: str, holder: str, ttl_s: float) -> bool:
        _check_lease(holder, ttl_s)
        path = self.path_of(key)

        def change(document: dict[str, Any]) -> bool:
            """Take or renew the lease (and write it) unless another holder's is still running."""
            now = time.time()
            lease = _section(document, "lease")
            until = lease.get("until", 0)
            if lease.get("holder") not in (None, holder) and isinstance(until, int | float) and until > now:
                return False
            document["lease"] = {"holder": holder, "until": now + ttl_s}
            return True

        return await self._run("try_lead", key, lambda: _update(path, change))

    async def aclose(self) -> None:
        return None


def _section(document: dict[str, Any], name: str) -> dict[str, Any]:
    """``document[name]``, created empty; a stored one that is not an object is unreadable."""
    part = document.setdefault(name, {})
    if not isinstance(part, dict):
        raise RolloutStoreUnavailable(f"rollout file: {name!r} is not a JSON object")
    return part


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RolloutStoreUnavailable(f"rollout file: count {value!r} is not an integer")
    return value


def _read(path: Path) -> dict[str, Any]:
    """The document at ``path`` (empty when there is none). Needs no lock: files are replaced whole."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    return _decode_state(raw, f"rollout file {path.name}")


def _update(path: Path, change: Callable[[dict[str, Any]], bool]) -> bool:
    """Read, ``change`` and (when it answers True) write the document, under the key's exclusive lock.

    Answers what ``change`` answered."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the close, also when the process dies
        document = _read(path)
        changed = change(document)
        if changed:
            _write_atomically(path, orjson.dumps(document))
        return changed
    finally:
        os.close(lock)


def _write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` so that a crash leaves the old file or the new one (lock held)."""
    temporary = path.with_suffix(".json.tmp")
    with open(temporary, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)


def open_rollout_store(
    state_backend: str, client: RedisClient | None, prefix: str, directory: Path, timeout_s: float | None = None
) -> RolloutStore:
    """The store for the policy's ``state.backend``: Redis for ``redis`` (on the process's shared
    client, ``gateway/shared/store.py``; each call bounded by ``timeout_s``, ``BUDGET_S`` when
    None), files in ``directory`` for ``memory`` (or ``file``): one host's processes share a
    directory as replicas share Redis."""
    if state_backend == "redis":
        if client is None:
            raise ValueError("state.backend is redis but no Redis client is open (no Redis URL set)")
        return RedisRolloutStore(client, prefix, timeout_s)
    if state_backend in ("memory", "file"):
        return FileRolloutStore(directory)
    raise ValueError(f"unknown state backend {state_backend!r} (memory, file or redis)")
