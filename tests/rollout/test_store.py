"""Where a rollout's state and counts live (``gateway/rollout/store.py``), against the real parts.

The conformance suite runs over both stores, each time with two store objects on one backing
(two Redis connections under one key prefix, two ``FileRolloutStore`` on one directory): what
two gateway processes would open. Then what only one store does: the file store's locking
across processes and its file names, Redis's key layout and its failures, bounded in time.
No test sleeps to synchronise: each waits for a condition, up to a deadline.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from gateway.rollout.store import (
    STEP_TTL_S,
    FileRolloutStore,
    RedisRolloutStore,
    RolloutStore,
    RolloutStoreUnavailable,
    file_name,
    open_rollout_store,
)
from tests.limitstore.redis_server import REDIS_URL, drop_keys, eventually, unique_prefix
from tests.servers import free_port

KEY = "meta-llama/llama-3.1-8b:0123456789ab"  # a group name may hold '/' and ':'
STATE: dict[str, Any] = {
    "key": KEY,
    "step": 2,
    "status": "progressing",
    "step_started_at": 1_733_000_000.125,
    "updated_at": 1_733_000_060.5,
    "reason": "promoted: no signal worse (π ≈ 0.05)",
    "by": "canary",
    "evidence": {"errors": -0.25, "slow_ttft": 0.0},
    "history": [1, 5, None, True, {"nested": ["x"]}],
    "big": 2**53 + 1,
}
Operation = Callable[[RolloutStore], Awaitable[object]]
OPERATIONS: dict[str, Operation] = {
    "load": lambda store: store.load(KEY),
    "save": lambda store: store.save(KEY, STATE),
    "add_counts": lambda store: store.add_counts(KEY, 0, {"candidate:requests": 1}),
    "counts": lambda store: store.counts(KEY, 0),
    "try_lead": lambda store: store.try_lead(KEY, "p1", 10.0),
}


def redis_store(url: str, prefix: str, timeout_s: float) -> RedisRolloutStore:
    """A Redis store on a client of its own (no retries: a failure answers at once), closed with it."""
    client = aioredis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
    )
    return RedisRolloutStore(client, prefix, timeout_s, owns_client=True)


class Backing:
    """One place the state lives (a Redis prefix, or a directory) and the stores opened on it."""

    def __init__(self, kind: str, directory: Path) -> None:
        self.kind = kind
        self.prefix = unique_prefix()
        self.directory = directory
        self.stores: list[RolloutStore] = []

    def new(self) -> RolloutStore:
        """Another store on the same backing: what another process would open."""
        store: RolloutStore
        store = redis_store(REDIS_URL, self.prefix, 2.0) if self.kind == "redis" else FileRolloutStore(self.directory)
        self.stores.append(store)
        return store

    async def corrupt(self, key: str) -> None:
        """Put something under ``key`` that the store never writes."""
        if self.kind == "redis":
            client = aioredis.Redis.from_url(REDIS_URL)
            await client.set(f"{self.prefix}rollout:{key}:state", b"{not json")
            await client.aclose()
        else:
            path = FileRolloutStore(self.directory).path_of(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"{not json")

    async def close(self) -> None:
        for store in self.stores:
            await store.aclose()
        if self.kind == "redis":
            drop_keys(REDIS_URL, self.prefix)


@pytest.fixture(params=["redis", "file"], ids=["in Redis", "in files"])
async def backing(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backing]:
    shared = Backing(request.param, tmp_path / "rollouts")
    try:
        yield shared
    finally:
        await shared.close()


# The conformance suite: every store.


async def test_a_saved_state_loads_back_as_given_from_another_store(backing: Backing) -> None:
    first, second = backing.new(), backing.new()
    await first.save(KEY, STATE)
    assert await second.load(KEY) == STATE


async def test_a_key_never_saved_has_no_state(backing: Backing) -> None:
    assert await backing.new().load("never-saved") is None


async def test_a_save_replaces_the_state_whole(backing: Backing) -> None:
    store = backing.new()
    await store.save(KEY, STATE)
    await store.save(KEY, {"step": 3})
    assert await store.load(KEY) == {"step": 3}


async def test_counts_of_two_stores_add_up(backing: Backing) -> None:
    first, second = backing.new(), backing.new()
    await first.add_counts(KEY, 1, {"candidate:requests": 3, "candidate:errors": 1})
    await second.add_counts(KEY, 1, {"candidate:requests": 4, "baseline:requests": 40})
    expected = {"candidate:requests": 7, "candidate:errors": 1, "baseline:requests": 40}
    assert await first.counts(KEY, 1) == expected
    assert await second.counts(KEY, 1) == expected


async def test_concurrent_adds_from_two_stores_lose_nothing(backing: Backing) -> None:
    first, second = backing.new(), backing.new()
    counts = {"candidate:requests": 1, "baseline:requests": 10}
    await asyncio.gather(*(store.add_counts(KEY, 0, counts) for store in [first, second] * 50))
    assert await first.counts(KEY, 0) == {"candidate:requests": 100, "baseline:requests": 1000}


async def test_counts_of_different_steps_and_keys_are_separate(backing: Backing) -> None:
    store = backing.new()
    await store.add_counts(KEY, 0, {"candidate:requests": 1})
    await store.add_counts(KEY, 1, {"candidate:requests": 2})
    await store.add_counts("other-group:abc", 0, {"candidate:requests": 5})
    assert await store.counts(KEY, 0) == {"candidate:requests": 1}
    assert await store.counts(KEY, 1) == {"candidate:requests": 2}
    assert await store.counts(KEY, 2) == {}
    assert await store.counts("other-group:abc", 0) == {"candidate:requests": 5}


async def test_counts_and_the_state_do_not_touch_each_other(backing: Backing) -> None:
    store = backing.new()
    await store.save(KEY, STATE)
    await store.add_counts(KEY, 2, {"baseline:slo_misses": 3, "baseline:errors": 0})
    assert await store.try_lead(KEY, "p1", 10.0)
    assert await store.load(KEY) == STATE
    assert await store.counts(KEY, 2) == {"baseline:slo_misses": 3}  # a zero adds nothing


async def test_the_first_holder_gets_the_lease_and_the_second_does_not(backing: Backing) -> None:
    first, second = backing.new(), backing.new()
    assert await first.try_lead(KEY, "p1", 30.0)
    assert not await second.try_lead(KEY, "p2", 30.0)
    assert await first.try_lead(KEY, "p1", 30.0), "the holder renews"
    assert not await second.try_lead(KEY, "p2", 30.0)


async def test_a_renewal_extends_the_lease(backing: Backing) -> None:
    first, second = backing.new(), backing.new()
    assert await first.try_lead(KEY, "p1", 0.2)
    assert await first.try_lead(KEY, "p1", 60.0)
    # A probe lease taken after the renewal with the first TTL: once it lapsed, so would have the first.
    assert await first.try_lead("probe:abc", "x", 0.2)
    await eventually(lambda: second.try_lead("probe:abc", "y", 60.0), what="the probe lease to lapse")
    assert not await second.try_lead(KEY, "p2", 60.0)


async def test_an_expired_lease_goes_to_the_next_process(backing: Backing) -> None:
    first, second = backing.new(), backing.new()
    assert await first.try_lead(KEY, "p1", 0.2)
    assert not await second.try_lead(KEY, "p2", 60.0)
    await eventually(lambda: second.try_lead(KEY, "p2", 60.0), what="the lease to pass to p2")
    assert not await first.try_lead(KEY, "p1", 60.0), "the old holder cannot renew a lease it lost"


async def test_a_stored_value_it_never_wrote_makes_the_store_unavailable(backing: Backing) -> None:
    await backing.corrupt(KEY)
    with pytest.raises(RolloutStoreUnavailable):
        await backing.new().load(KEY)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda s: s.save(KEY, {1: "an int key"}), TypeError),
        (lambda s: s.save(KEY, {"llr": float("inf")}), ValueError),
        (lambda s: s.save(KEY, {"when": object()}), TypeError),
        (lambda s: s.save("", STATE), ValueError),
        (lambda s: s.add_counts(KEY, 0, {"candidate:requests": 1.5}), TypeError),
        (lambda s: s.add_counts(KEY, -1, {"candidate:requests": 1}), ValueError),
        (lambda s: s.try_lead(KEY, "", 10.0), ValueError),
        (lambda s: s.try_lead(KEY, "p1", 0.0), ValueError),
    ],
    ids=[
        "a state with a non-string key",
        "a state with an infinity",
        "a state with a non-JSON value",
        "an empty rollout key",
        "a count that is not an integer",
        "a negative step",
        "an empty lease holder",
        "a lease of no time",
    ],
)
async def test_what_could_not_be_stored_as_given_is_refused_and_nothing_is_stored(
    backing: Backing, call: Operation, error: type[Exception]
) -> None:
    store = backing.new()
    with pytest.raises(error):
        await call(store)
    assert await store.load(KEY) is None
    assert await store.counts(KEY, 0) == {}
    assert await store.try_lead(KEY, "p1", 10.0), "no lease was taken"


# The file store.

CHILD = """
import asyncio, sys, time
from pathlib import Path
from gateway.rollout.store import FileRolloutStore

directory, go, adds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + 60
while not go.exists():  # start together, to contend for the lock
    if time.monotonic() > deadline:
        sys.exit("never told to go")
    time.sleep(0.001)


async def main() -> None:
    store = FileRolloutStore(directory)
    counts = {"candidate:requests": 1, "baseline:requests": 2}
    await asyncio.gather(*(store.add_counts(sys.argv[4], 0, counts) for _ in range(adds)))


asyncio.run(main())
"""


async def test_processes_adding_at_once_lose_nothing(tmp_path: Path) -> None:
    directory, go, processes, adds = tmp_path / "rollouts", tmp_path / "go", 4, 25
    argv = [sys.executable, "-c", CHILD, str(directory), str(go), str(adds), KEY]
    children = [await asyncio.create_subprocess_exec(*argv) for _ in range(processes)]
    try:
        await asyncio.to_thread(go.touch)
        async with asyncio.timeout(60):
            codes = [await child.wait() for child in children]
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()
    assert codes == [0] * processes
    total = processes * adds
    expected = {"candidate:requests": total, "baseline:requests": 2 * total}
    assert await FileRolloutStore(directory).counts(KEY, 0) == expected


@pytest.mark.parametrize(
    "key",
    ["../escape", "../../etc/passwd", "/absolute", "..", ".", ".hidden", "a/../../b", "nul\x00byte", "x" * 300],
    ids=[
        "a parent",
        "two parents",
        "an absolute path",
        "dot dot",
        "dot",
        "a hidden name",
        "a nested escape",
        "a NUL",
        "a name too long",
    ],
)
async def test_a_key_never_leaves_the_directory(tmp_path: Path, key: str) -> None:
    directory = tmp_path / "a" / "rollouts"
    store = FileRolloutStore(directory)
    await store.save(key, {"key": key})
    await store.add_counts(key, 0, {"candidate:requests": 1})
    assert await store.try_lead(key, "p1", 10.0)
    assert await store.load(key) == {"key": key}
    assert {path.parent for path in files_under(tmp_path)} == {directory}
    assert not any(path.name.startswith(".") for path in files_under(directory))


def files_under(directory: Path) -> list[Path]:
    return [path for path in directory.rglob("*") if path.is_file()]


def test_distinct_keys_never_share_a_file() -> None:
    keys = ["a/b", "a%2Fb", "a:b", "a%3Ab", ".x", "%2Ex", "x" * 300, "x" * 301, "group:0123"]
    assert len({file_name(key) for key in keys}) == len(keys)


async def test_a_state_file_is_replaced_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    store = FileRolloutStore(tmp_path)
    await store.save(KEY, STATE)
    await store.add_counts(KEY, 2, {"candidate:requests": 1})
    names = sorted(path.name for path in files_under(tmp_path))
    stem = file_name(KEY)
    assert names == [f"{stem}.json", f"{stem}.lock"]


# The Redis store.


async def test_redis_keeps_the_documented_layout() -> None:
    prefix = unique_prefix()
    store = redis_store(REDIS_URL, prefix, 2.0)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await store.save(KEY, STATE)
        await store.add_counts(KEY, 3, {"candidate:requests": 2})
        assert await store.try_lead(KEY, "p1", 30.0)
        base = f"{prefix}rollout:{KEY}"
        assert await client.ttl(f"{base}:state") == -1, "the state never expires"
        assert 0 < await client.ttl(f"{base}:step:3") <= STEP_TTL_S
        assert await client.hgetall(f"{base}:step:3") == {b"candidate:requests": b"2"}
        assert await client.get(f"{base}:lease") == b"p1"
        assert 0 < await client.pttl(f"{base}:lease") <= 30_000
    finally:
        await store.aclose()
        await client.aclose()
        drop_keys(REDIS_URL, prefix)


async def assert_unavailable_within(store: RolloutStore, seconds: float) -> None:
    for name, operation in OPERATIONS.items():
        started = time.monotonic()
        with pytest.raises(RolloutStoreUnavailable):
            await operation(store)
        assert time.monotonic() - started < seconds, f"{name} took too long"


async def test_an_unreachable_redis_is_unavailable_at_once() -> None:
    store = redis_store(f"redis://127.0.0.1:{free_port()}/0", unique_prefix(), 0.5)
    try:
        await assert_unavailable_within(store, 2.0)
    finally:
        await store.aclose()


@asynccontextmanager
async def silent_server() -> AsyncIterator[int]:
    """A loopback server that accepts connections, reads everything and never answers: a hung Redis."""
    writers: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


async def test_a_redis_that_never_answers_is_unavailable_within_the_timeout() -> None:
    async with silent_server() as port:
        client = aioredis.Redis(host="127.0.0.1", port=port)  # no socket timeouts: the store bounds each call
        store = RedisRolloutStore(client, unique_prefix(), 0.3)
        try:
            await assert_unavailable_within(store, 2.0)
        finally:
            await store.aclose()
            await client.aclose()


# Choosing a store.


async def test_the_state_backend_chooses_the_store(tmp_path: Path) -> None:
    files = open_rollout_store("memory", None, "gw:", tmp_path, 0.05)
    assert isinstance(files, FileRolloutStore)
    assert files.directory == tmp_path
    client = aioredis.Redis.from_url(REDIS_URL)
    shared = open_rollout_store("redis", client, "gw:", tmp_path, 0.05)
    assert isinstance(shared, RedisRolloutStore)
    await shared.aclose()
    assert await client.ping()  # the shared client stays open: its owner closes it
    await client.aclose()
    with pytest.raises(ValueError, match="no Redis client"):
        open_rollout_store("redis", None, "gw:", tmp_path, 0.05)
    with pytest.raises(ValueError, match="unknown state backend"):
        open_rollout_store("etcd", None, "gw:", tmp_path, 0.05)
