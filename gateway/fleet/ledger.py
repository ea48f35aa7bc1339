"""The fleet's capacity ledger in Redis: who holds how much of each backend, moved by demand.

Every process (a worker, a replica) calls ``sync`` every ``fleet.sync_interval_s`` with, for each
backend, what it uses now (requests in flight, their tokens, prefills by class), what waits in
its queues (requests and tokens by class rank) and what it enforces now (``applied``: its part
as last applied). One Lua script (``ledger.lua``), atomic, answers with what it may hold from
now on. Budgets: requests (``max_concurrent``), tokens (``max_tokens_in_flight``), each paced
class's prefills (``max_prefilling``), and each class's requests and tokens when its
``max_share`` is below 1 (``floor(max_share x capacity)``). The share is a budget of its own
because a share taken of each process's part would not hold across processes: a part that
shrinks keeps the class's requests already in flight, and the other process's part grows meanwhile.

1. **Invariant: what every process may be using sums to at most the capacity, at every
   instant.** A process may be using, until its next sync, the larger of the part granted at
   its last sync and the part it said it enforces (``applied``): a grant takes effect only when
   its answer reaches the process, and the process goes on with its old part meanwhile (it may
   even start requests after its report was written). So that larger value is what the others
   are told is taken. A process grows only into what no one may be using; the part stored for
   it is never less than it uses (a request in flight is never taken back), so shrinking waits
   for its requests to end; the part it is told to enforce may be less (rule 2), which only
   stops it starting requests. This is what the ledger once missed: a part shrunk in Redis was given to another
   process while its owner, its answer still on the way, started requests on it (5 on a
   capacity of 4, in 7 of 19 runs of three processes).
2. **Target**: what each process should hold, fair across tenants. A process reports, per
   backend, each of its busiest tenants (``TenantUse``: class rank, weight, requests and tokens
   in flight and waiting; at most ``TENANTS_REPORTED``, the rest summed into one entry, and
   tenants served lately with nothing in flight or waiting, so that their next arrival finds
   room). Use nobody accounts for by tenant (a process that reports none, a tombstone) is kept
   first. Then, class rank by class rank, highest first, the budget left is split among the
   tenants **max-min fairly by weight**, fleet-wide (a tenant's demand is what it has in flight
   and waiting, summed over the processes, plus headroom for its next arrivals: its recent
   peak in flight where that is more, and one request;
   a class with a ``max_share`` counts its waiting requests only up to what its share leaves
   free fleet-wide: demand it could not use is no demand, and would take the headroom an
   arrival of a higher class elsewhere needs; and a rank's headroom comes only from what the
   lower ranks' use and waiting leave: idle room kept for interactive arrivals once held every
   slot, for the 10 s its tenants counted as served lately, while batch waited elsewhere with its
   share free, which one process alone never does); a tenant's part is split among its processes:
   first what it uses in each (moving a tenant's slots between its own processes gains nothing
   and idles each slot for a sync), then what it waits for, then headroom (which must not idle
   while the same tenant waits elsewhere), each step in proportion when it does not fit
   (rounded down, the remainder one unit each in order). A
   process's target is the sum of its tenants' parts; what is left after every class is split
   evenly among the live processes, as headroom. The same inputs give every process the same
   targets, whichever syncs first. Before, parts moved by each process's demand: a flood of 16
   streams on one replica took the capacity a light tenant on another needed (its time to
   first byte went from 25 ms to 1,047 ms), while one process's fair queue would have served it.
   A target may be *below* what the process uses (its tenants hold more than their share): the
   process is told its target and starts nothing until its requests fall below it, while the
   ledger goes on counting what it uses (rule 1: the part stored is never below the use), so
   that the slots it frees go, one sync later, to the tenants that wait elsewhere. Paced
   classes' prefill budgets still move by each process's demand (they are held for one
   prefill's time).
3. **Leases, tombstones, drain.** A process that has not synced for ``lease_ttl_s``
   (``fleet.entry_ttl_s``) may be dead, or alive and cut off from Redis. Alive, it goes on
   starting requests within its part for ``fleet.outage_s``, then stops, by its own clock
   (``Quota.until``, measured from when it *sent* its last successful sync, so never later than
   the ledger's); the requests it started run on until they end, at the latest at their
   deadline. So the ledger keeps it as a *tombstone*: it holds what it may be using (rule 1's
   larger part), wants nothing, and gets no headroom, for ``drain_s`` more (``outage_s`` plus
   the longest deadline, ``Policy.fleet_drain_s``); then it is gone.
   A process known dead is gone at once: a process on the same host sees a tombstone's process
   has exited and names it in its next sync (``reap``), and a process that exits gracefully
   leaves (``leave``). An expiry that returned a live process's part after the lease, as this
   ledger once did, let another process start requests beside those still running.
4. **Epoch.** The ledger has an identity, created with it; a Redis that lost its keys (a
   restart without persistence) answers with a new one, and a process that sees the epoch
   change keeps within the part it had for ``drain_s`` (``coordinator.py``): the new ledger
   does not know what the others may still be using.

The answer also says what the others wait for and prefill, by class rank, so that a process
does not start a class while another process has a higher class waiting for the same backend,
nor a paced class's prefill while a higher class prefills there (strict class order across
processes, as stale as one sync interval); who waits there, by class and tenant (the busiest
``TENANTS_REPORTED``, the rest summed), so that a process estimates a request's wait in the
fleet's fair order; and how many requests per second the others send
there, so that a process estimates how fast its queue drains from the fleet's rate, not its
own part's (a process with a small part would otherwise refuse as ``deadline_unmeetable`` a
request that the next slot freed anywhere would serve); and the requests and tokens the others
have in flight there, so that routing weighs the fleet's load on each backend (its bounded-load
rule rounds up to whole requests: on one replica's part alone it would exclude a backend that
holds a single request).

All keys carry the cell's hash tag, so that a Redis Cluster keeps them on one slot: ``{fleet}``,
or ``{fleet:<cell>}`` for a named ``fleet.cell``. **Cells** are how a fleet grows past what one
ledger serves: a sync reads every process's entry of the backends it reports, so one ledger's
cost grows with the square of its processes (``deploy/README.md``, "Redis for many replicas").
Each cell is a group of replicas with engines of its own and a ledger of its own, on its own
slot, so a cluster spreads cells over its shards; the tenant limits stay fleet-wide (their keys
carry the tenant's tag, not the cell's).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.clock import Clock
from gateway.dispatch.quota import NO_SHARE, TENANTS_REPORTED, Quota, Share, TenantUse
from gateway.shared.connect import RedisClient
from gateway.shared.lua import lua_script
from gateway.shared.store import SharedStore

SYNC = lua_script("gateway.fleet", "ledger.lua")
LEAVE = lua_script("gateway.fleet", "leave.lua")


@dataclass(frozen=True, slots=True)
class BackendReport:
    """One backend as one process sees it: capacity, use now, and what waits in its queues."""

    name: str
    max_requests: int
    max_tokens: int
    max_prefills: Mapping[int, int]
    """The prefill bound of each paced class, by rank."""
    max_shares: Mapping[int, Share]
    """What each class with a ``max_share`` below 1 may hold, by rank: its share of the capacity."""
    requests: int
    tokens: int
    prefilling: Mapping[int, int]
    class_use: Mapping[int, Share]
    """Requests and tokens in flight by class rank (for the shared classes' budgets)."""
    waiting: Mapping[int, tuple[int, int]]
    """Requests and their tokens waiting in this process's queues for this backend, by class rank."""
    rate: float = 0.0
    """Requests per second this process has sent to this backend lately."""
    applied: Quota | None = None
    """The part this process enforces now (None: nothing yet)."""
    tenants: Sequence[TenantUse] = ()
    """Its tenants' use and demand (rule 2); none: the process's use is kept, its demand is one tenant's."""

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "cap": {
                "req": self.max_requests,
                "tok": self.max_tokens,
                "pf": _keyed(self.max_prefills),
                "sh": _keyed({rank: share.requests for rank, share in self.max_shares.items()}),
                "sk": _keyed({rank: share.tokens for rank, share in self.max_shares.items()}),
            },
            "use": {
                "req": self.requests,
                "tok": self.tokens,
                "pf": _keyed(self.prefilling),
                "sh": _keyed({rank: self.class_use.get(rank, NO_SHARE).requests for rank in self.max_shares}),
                "sk": _keyed({rank: self.class_use.get(rank, NO_SHARE).tokens for rank in self.max_shares}),
                "rate": round(self.rate, 3),
            },
            "want": {str(rank): [count, tokens] for rank, (count, tokens) in self.waiting.items() if count},
            "applied": _applied(self.applied),
        }
        if self.tenants:
            out["ten"] = [tenant.as_json() for tenant in self.tenants]
        return out


@dataclass(frozen=True, slots=True)
class LedgerGrant:
    """What the ledger lets this process hold of one backend, and what the others are doing there."""

    requests: int
    tokens: int
    prefills: Mapping[int, int]
    shares: Mapping[int, Share]
    """What each shared class may hold through this process, by rank."""
    others_waiting: Mapping[int, int]
    """Requests other processes have waiting for this backend, by class rank."""
    others_prefilling: Mapping[int, int]
    others_rate: float = 0.0
    """Requests per second the other processes send to this backend."""
    others_requests: int = 0
    others_tokens: int = 0
    """Requests and tokens the other processes have in flight on this backend (routing weighs them)."""
    others_tenants: Mapping[int, Mapping[str, tuple[float, int]]] = field(default_factory=dict)
    """The other processes' waiting requests by class rank and tenant: (weight, count) (the
    tenants they reported; '' sums the rest). A wait estimate places a request among them in fair order."""


@dataclass(frozen=True, slots=True)
class Sync:
    """The answer to one ``sync``: a grant per reported backend, how many processes are live, the
    ledger's epoch, and the processes that are tombstones (silent past their lease)."""

    live: int
    grants: Mapping[str, LedgerGrant]
    epoch: str = ""
    tombstones: tuple[str, ...] = ()


class FleetLedger:
    """Talks to the ledger's scripts (module docstring) for one process, ``replica``.

    ``clock``: when given, the scripts take their time from it instead of Redis's (tests drive
    leases and drains on a ``FakeClock``). ``cell``: the ``fleet.cell`` this process is in ('': the
    one unnamed cell, whose keys are those of the ledger before cells). ``store``: the shared
    store of ``client`` (``gateway/shared/store.py``), which bounds the coordinator's calls here."""

    def __init__(
        self,
        client: RedisClient,
        *,
        key_prefix: str,
        replica: str,
        lease_ttl_s: float,
        drain_s: float = 600.0,
        clock: Clock | None = None,
        cell: str = "",
    ) -> None:
        self.client = client
        self.store = SharedStore.of(client)
        self.key_prefix = key_prefix
        self.base = ledger_base(key_prefix, cell)
        self.replica = replica
        self.lease_ttl_s = lease_ttl_s
        self.drain_s = drain_s
        self.clock = clock
        self._script = client.register_script(SYNC)
        self._leave = client.register_script(LEAVE)
        self._reported: set[str] = set()  # the backends this process has reported: its hashes to leave

    async def sync(self, report: Sequence[BackendReport], reap: Sequence[str] = ()) -> Sync:
        """One sync: ``report`` for every backend; ``reap`` names tombstones known dead."""
        argv: list[str | float | bytes] = [
            self.replica,
            self.lease_ttl_s,
            orjson.dumps([b.as_json() for b in report]),
            self.base,
            self.drain_s,
            orjson.dumps(list(reap)),
            "" if self.clock is None else repr(self.clock.now()),
            os.urandom(8).hex(),  # the epoch of a ledger this sync creates: new each time, never one seen before
            TENANTS_REPORTED,
        ]
        self._reported.update(b.name for b in report)
        raw = await self._script(keys=self._keys(b.name for b in report), args=argv)
        answer = orjson.loads(raw)
        grants = {name: _grant(entry) for name, entry in (answer.get("backends") or {}).items()}
        tombstones = answer.get("tombstones")
        return Sync(
            int(answer["live"]),
            grants,
            str(answer.get("epoch") or ""),
            tuple(tombstones) if isinstance(tombstones, list) else (),
        )

    async def leave(self) -> None:
        """Take this process out of the ledger (a graceful exit: nothing of it in flight any more)."""
        await self._leave(keys=self._keys(sorted(self._reported)), args=[self.replica, self.base])

    def _keys(self, backends: Iterable[str]) -> list[str]:
        """The keys a script declares, all under the cell's tag: a Redis Cluster client routes
        the script to that slot's shard by them. The scripts also touch the hashes of backends
        other processes reported (reaping, leaving), named in the ledger's own set; they are in
        the same slot, so on the same shard, though not declared."""
        fleet = f"{self.base}:"
        return [f"{fleet}replicas", f"{fleet}backends", f"{fleet}epoch", *(f"{fleet}b:{name}" for name in backends)]


def ledger_base(key_prefix: str, cell: str) -> str:
    """The start of every key of ``cell``'s ledger: the key prefix and the cell's hash tag."""
    return f"{key_prefix}{{fleet:{cell}}}" if cell else f"{key_prefix}{{fleet}}"


def _applied(quota: Quota | None) -> dict[str, Any]:
    if quota is None:
        return {"req": 0, "tok": 0, "pf": {}, "sh": {}, "sk": {}}
    return {
        "req": quota.requests,
        "tok": quota.tokens,
        "pf": _keyed(quota.prefills),
        "sh": _keyed({rank: share.requests for rank, share in quota.shares.items()}),
        "sk": _keyed({rank: share.tokens for rank, share in quota.shares.items()}),
    }


def _keyed(values: Mapping[int, int]) -> dict[str, int]:
    return {str(rank): value for rank, value in values.items()}


def _ints(values: Any) -> dict[int, int]:
    """A JSON object of rank -> number (cjson encodes an empty one as ``{}`` or ``[]``)."""
    if not isinstance(values, dict):
        return {}
    return {int(rank): int(value) for rank, value in values.items()}


def _grant(entry: dict[str, Any]) -> LedgerGrant:
    hold = entry["hold"]
    return LedgerGrant(
        requests=int(hold["req"]),
        tokens=int(hold["tok"]),
        prefills=_ints(hold.get("pf")),
        shares=_shares(_ints(hold.get("sh")), _ints(hold.get("sk"))),
        others_waiting=_ints(entry.get("waiting")),
        others_prefilling=_ints(entry.get("prefilling")),
        others_rate=float(entry.get("rate") or 0.0),
        others_requests=int(entry.get("req") or 0),
        others_tokens=int(entry.get("tok") or 0),
        others_tenants=_tenants(entry.get("ten")),
    )


def _tenants(values: Any) -> dict[int, dict[str, tuple[float, int]]]:
    """rank -> [[tenant, weight, count], ...] (cjson: an empty object may come as ``[]``)."""
    if not isinstance(values, dict):
        return {}
    return {
        int(rank): {str(name): (float(weight), int(count)) for name, weight, count in entries}
        for rank, entries in values.items()
        if isinstance(entries, list)
    }


def _shares(requests: Mapping[int, int], tokens: Mapping[int, int]) -> dict[int, Share]:
    return {rank: Share(count, tokens.get(rank, 0)) for rank, count in requests.items()}
