"""The fleet's capacity ledger in Redis: who holds how much of each backend, moved by demand.

Every process (a worker, a replica) calls ``sync`` every ``fleet.sync_interval_s`` with, for each
backend, what it uses now (requests in flight, their tokens, prefills by class) and what waits
in its queues (requests and tokens by class rank). One Lua script, atomic, answers with what it
may hold from now on. The rule, per budget (requests, tokens, each paced class's prefills):

Budgets: requests (``max_concurrent``), tokens (``max_tokens_in_flight``), each paced class's
prefills (``max_prefilling``), and each class's requests and tokens when its ``max_share`` is
below 1 (``floor(max_share x capacity)``). The share is a budget of its own because a share
taken of each process's part would not hold across processes: a part that shrinks keeps the
class's requests already in flight, and the other process's part grows meanwhile.

1. **Invariant**: the holdings of all live processes sum to at most the capacity. A process
   grows only into what no one holds; it never holds less than it uses (a request in flight is
   never taken back), so shrinking waits for its requests to end.
2. **Target**: what each process should hold. Everyone keeps what it uses; the rest is given
   by class rank, highest class first (a class with a ``max_share`` counts its waiting requests
   only up to what its share leaves free fleet-wide: demand it could not use is no demand, and
   would take the headroom an arrival of a higher class elsewhere needs): all of a rank's
   waiting demand when it fits, else in
   proportion to each process's demand (rounded down, the remainder one unit each in process
   order); what is left after every class is split evenly, as headroom for new arrivals. The
   same inputs give every process the same targets, whichever syncs first.
3. **Leases**: a process's entry expires ``lease_ttl_s`` (``fleet.entry_ttl_s``) after its
   last sync; the next sync of anyone purges it, and its holdings return to the pool. A
   process that dies stops holding capacity within ``fleet.lease_ttl_s``.

The answer also says what the others wait for and prefill, by class rank, so that a process
does not start a class while another process has a higher class waiting for the same backend,
nor a paced class's prefill while a higher class prefills there (strict class order across
processes, as stale as one sync interval); and how many requests per second the others send
there, so that a process estimates how fast its queue drains from the fleet's rate, not its
own part's (a process with a small part would otherwise refuse as ``deadline_unmeetable`` a
request that the next slot freed anywhere would serve); and the requests and tokens the others
have in flight there, so that routing weighs the fleet's load on each backend (its bounded-load
rule rounds up to whole requests: on one replica's part alone it would exclude a backend that
holds a single request).

All keys carry the ``{fleet}`` hash tag, so that a Redis Cluster keeps them on one slot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from gateway.fleet.quota import NO_SHARE, Share

SYNC = r"""
local me, ttl, report, prefix = ARGV[1], tonumber(ARGV[2]), cjson.decode(ARGV[3]), ARGV[4]
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local replicas = prefix .. '{fleet}:replicas'
local backends = prefix .. '{fleet}:backends'
local keep_ms = math.ceil(ttl * 4000)

local expired = redis.call('ZRANGEBYSCORE', replicas, '-inf', now)
if #expired > 0 then
  for _, name in ipairs(redis.call('SMEMBERS', backends)) do
    redis.call('HDEL', prefix .. '{fleet}:b:' .. name, unpack(expired))
  end
  redis.call('ZREM', replicas, unpack(expired))
end
redis.call('ZADD', replicas, now + ttl, me)
redis.call('PEXPIRE', replicas, keep_ms)
redis.call('PEXPIRE', backends, keep_ms)
local live = redis.call('ZCARD', replicas)

local function num(value) return tonumber(value) or 0 end

-- A budget is 'req', 'tok', 'p<rank>' (a paced class's prefills), 's<rank>' or 'k<rank>' (a shared
-- class's requests or tokens). What ``state`` uses, waits for (at ``rank``) and holds of it:
local field = {p = 'pf', s = 'sh', k = 'sk'}
local function kind_of(budget)
  if budget == 'req' or budget == 'tok' then return budget, nil end
  return string.sub(budget, 1, 1), string.sub(budget, 2)
end
local function used(state, budget)
  local kind, rank = kind_of(budget)
  if rank == nil then return num(state.use[kind]) end
  return num((state.use[field[kind]] or {})[rank])
end
local function wanted(state, budget, rank)
  local kind, own = kind_of(budget)
  local want = (own == nil and state.usable or state.want)[rank]
  if not want then return 0 end
  if kind == 'req' then return num(want[1]) end
  if kind == 'tok' then return num(want[2]) end
  if own ~= rank then return 0 end
  if kind == 'k' then return num(want[2]) end
  return num(want[1])
end
local function held(state, budget)
  local kind, rank = kind_of(budget)
  local hold = state.hold
  if rank == nil then return num(hold[kind]) end
  return num((hold[field[kind]] or {})[rank])
end

-- What each process waits for that its class can use: a shared class's waiting requests count
-- only up to what its share leaves free fleet-wide, split in proportion. Batch queued past its
-- share would otherwise take, as demand, the headroom an interactive arrival elsewhere needs.
local function usable(states, ids, cap)
  for _, id in ipairs(ids) do states[id].usable = states[id].want end
  for rank, bound in pairs(cap.sh or {}) do
    local used_req, used_tok, want_req, want_tok = 0, 0, 0, 0
    for _, id in ipairs(ids) do
      local state = states[id]
      used_req = used_req + num((state.use.sh or {})[rank])
      used_tok = used_tok + num((state.use.sk or {})[rank])
      local want = state.want[rank]
      if want then
        want_req = want_req + num(want[1])
        want_tok = want_tok + num(want[2])
      end
    end
    local room_req = math.max(bound - used_req, 0)
    local room_tok = math.max(num((cap.sk or {})[rank]) - used_tok, 0)
    if want_req > room_req or want_tok > room_tok then
      local part_req = want_req > 0 and math.min(room_req / want_req, 1) or 0
      local part_tok = want_tok > 0 and math.min(room_tok / want_tok, 1) or 0
      for _, id in ipairs(ids) do
        local want = states[id].want[rank]
        if want then
          local copy = {}
          for other, value in pairs(states[id].usable) do copy[other] = value end
          copy[rank] = {math.floor(num(want[1]) * part_req), math.floor(num(want[2]) * part_tok)}
          states[id].usable = copy
        end
      end
    end
  end
end

-- Targets of every process for one budget (module docstring, rule 2).
local function targets(cap, states, ids, ranks, budget)
  local target, used_total = {}, 0
  for _, id in ipairs(ids) do
    target[id] = used(states[id], budget)
    used_total = used_total + target[id]
  end
  local free = math.max(cap - used_total, 0)
  for _, rank in ipairs(ranks) do
    if free <= 0 then break end
    local total = 0
    for _, id in ipairs(ids) do total = total + wanted(states[id], budget, rank) end
    if total > 0 then
      if total <= free then
        for _, id in ipairs(ids) do target[id] = target[id] + wanted(states[id], budget, rank) end
        free = free - total
      else
        local given = 0
        for _, id in ipairs(ids) do
          local share = math.floor(wanted(states[id], budget, rank) * free / total)
          target[id] = target[id] + share
          given = given + share
        end
        local rest = free - given
        for _, id in ipairs(ids) do
          if rest <= 0 then break end
          if wanted(states[id], budget, rank) > 0 then
            target[id] = target[id] + 1
            rest = rest - 1
          end
        end
        free = 0
      end
    end
  end
  if free > 0 then
    local each = math.floor(free / #ids)
    local rest = free - each * #ids
    for i, id in ipairs(ids) do target[id] = target[id] + each + ((i <= rest) and 1 or 0) end
  end
  return target
end

-- What ``me`` holds from now on (rule 1): its target, within what the others leave, never below its use.
local function settle(cap, states, ids, ranks, budget)
  local target = targets(cap, states, ids, ranks, budget)
  local others = 0
  for _, id in ipairs(ids) do
    if id ~= me then others = others + held(states[id], budget) end
  end
  local hold = math.min(target[me], math.max(cap - others, 0))
  return math.max(hold, used(states[me], budget))
end

local answer = {live = live, backends = {}}
for _, entry in ipairs(report) do
  local key = prefix .. '{fleet}:b:' .. entry.name
  redis.call('SADD', backends, entry.name)
  local states, ids, mine = {}, {}, nil
  local stored = redis.call('HGETALL', key)
  for i = 1, #stored, 2 do
    local state = cjson.decode(stored[i + 1])
    if stored[i] == me then mine = state else
      states[stored[i]] = state
      table.insert(ids, stored[i])
    end
  end
  local hold = mine and mine.hold or {req = 0, tok = 0, pf = {}, sh = {}, sk = {}}
  states[me] = {use = entry.use, want = entry.want, hold = hold}
  table.insert(ids, me)
  table.sort(ids)
  local seen = {}
  local ranks = {}
  for _, id in ipairs(ids) do
    for rank, _ in pairs(states[id].want) do
      if not seen[rank] then seen[rank] = true; table.insert(ranks, rank) end
    end
  end
  table.sort(ranks, function(a, b) return tonumber(a) < tonumber(b) end)
  usable(states, ids, entry.cap)
  local new = {req = settle(entry.cap.req, states, ids, ranks, 'req'),
               tok = settle(entry.cap.tok, states, ids, ranks, 'tok'), pf = {}, sh = {}, sk = {}}
  for rank, bound in pairs(entry.cap.pf) do
    new.pf[rank] = settle(bound, states, ids, ranks, 'p' .. rank)
  end
  for rank, bound in pairs(entry.cap.sh) do
    new.sh[rank] = settle(bound, states, ids, ranks, 's' .. rank)
  end
  for rank, bound in pairs(entry.cap.sk) do
    new.sk[rank] = settle(bound, states, ids, ranks, 'k' .. rank)
  end
  states[me].hold = new
  states[me].usable = nil
  redis.call('HSET', key, me, cjson.encode(states[me]))
  redis.call('PEXPIRE', key, keep_ms)
  local waiting, prefilling, rate, req, tok = {}, {}, 0, 0, 0
  for _, id in ipairs(ids) do
    if id ~= me then
      rate = rate + num(states[id].use.rate)
      req = req + num(states[id].use.req)
      tok = tok + num(states[id].use.tok)
      for rank, want in pairs(states[id].want) do waiting[rank] = (waiting[rank] or 0) + num(want[1]) end
      for rank, count in pairs(states[id].use.pf) do prefilling[rank] = (prefilling[rank] or 0) + num(count) end
    end
  end
  answer.backends[entry.name] = {hold = new, waiting = waiting, prefilling = prefilling, rate = rate,
                                 req = req, tok = tok}
end
return cjson.encode(answer)
"""


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

    def as_json(self) -> dict[str, Any]:
        return {
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
        }


@dataclass(frozen=True, slots=True)
class Grant:
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


@dataclass(frozen=True, slots=True)
class Sync:
    """The answer to one ``sync``: a grant per reported backend, and how many processes are live."""

    live: int
    grants: Mapping[str, Grant]


class FleetLedger:
    """Talks to the ledger's script (module docstring) for one process, ``replica``."""

    def __init__(self, client: aioredis.Redis, *, key_prefix: str, replica: str, lease_ttl_s: float) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self.replica = replica
        self.lease_ttl_s = lease_ttl_s
        self._script = client.register_script(SYNC)

    async def sync(self, report: Sequence[BackendReport]) -> Sync:
        argv: list[str | float | bytes] = [
            self.replica,
            self.lease_ttl_s,
            orjson.dumps([b.as_json() for b in report]),
            self.key_prefix,
        ]
        raw = await self._script(keys=[], args=argv)
        answer = orjson.loads(raw)
        grants = {name: _grant(entry) for name, entry in (answer.get("backends") or {}).items()}
        return Sync(int(answer["live"]), grants)


def _keyed(values: Mapping[int, int]) -> dict[str, int]:
    return {str(rank): value for rank, value in values.items()}


def _ints(values: Any) -> dict[int, int]:
    """A JSON object of rank -> number (cjson encodes an empty one as ``{}`` or ``[]``)."""
    if not isinstance(values, dict):
        return {}
    return {int(rank): int(value) for rank, value in values.items()}


def _grant(entry: dict[str, Any]) -> Grant:
    hold = entry["hold"]
    return Grant(
        requests=int(hold["req"]),
        tokens=int(hold["tok"]),
        prefills=_ints(hold.get("pf")),
        shares=_shares(_ints(hold.get("sh")), _ints(hold.get("sk"))),
        others_waiting=_ints(entry.get("waiting")),
        others_prefilling=_ints(entry.get("prefilling")),
        others_rate=float(entry.get("rate") or 0.0),
        others_requests=int(entry.get("req") or 0),
        others_tokens=int(entry.get("tok") or 0),
    )


def _shares(requests: Mapping[int, int], tokens: Mapping[int, int]) -> dict[int, Share]:
    return {rank: Share(count, tokens.get(rank, 0)) for rank, count in requests.items()}
