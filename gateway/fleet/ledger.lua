-- The fleet's capacity ledger: one process's sync, atomic (gateway/fleet/ledger.py states the rule).
--
-- ARGV: 1 the process's id, 2 its lease (s), 3 its report (JSON), 4 the key prefix, 5 the drain
-- (s), 6 ids to reap (JSON array: processes known dead), 7 the time (s; '' for Redis's own
-- clock), 8 an epoch to create if the ledger has none.
-- Keys, all under the {fleet} hash tag: replicas (zset: id -> time of its last sync), backends
-- (set of names), b:<name> (hash: id -> its state), epoch (the ledger's identity).
local me, ttl, report, prefix = ARGV[1], tonumber(ARGV[2]), cjson.decode(ARGV[3]), ARGV[4]
local drain, reap = tonumber(ARGV[5]), cjson.decode(ARGV[6])
local now
if ARGV[7] == '' then
  local clock = redis.call('TIME')
  now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
else
  now = tonumber(ARGV[7])
end
local replicas = prefix .. '{fleet}:replicas'
local backends = prefix .. '{fleet}:backends'
local epoch_key = prefix .. '{fleet}:epoch'
local keep_ms = math.ceil((ttl + drain) * 1000) + 60000

local epoch = redis.call('GET', epoch_key)
if not epoch then
  epoch = ARGV[8]
  redis.call('SET', epoch_key, epoch)
end
redis.call('PEXPIRE', epoch_key, keep_ms)

-- Rule 3: silent past its lease, a process is a tombstone (it holds what it may still use);
-- past its drain too, or known dead, it is gone.
local silent = now - ttl
local gone = redis.call('ZRANGEBYSCORE', replicas, '-inf', now - ttl - drain)
for _, id in ipairs(reap) do
  local seen = redis.call('ZSCORE', replicas, id)
  if seen and tonumber(seen) <= silent and id ~= me then table.insert(gone, id) end
end
if #gone > 0 then
  for _, name in ipairs(redis.call('SMEMBERS', backends)) do
    redis.call('HDEL', prefix .. '{fleet}:b:' .. name, unpack(gone))
  end
  redis.call('ZREM', replicas, unpack(gone))
end
redis.call('ZADD', replicas, now, me)
redis.call('PEXPIRE', replicas, keep_ms)
redis.call('PEXPIRE', backends, keep_ms)
local live = redis.call('ZCOUNT', replicas, '(' .. silent, '+inf')
local tombstones = redis.call('ZRANGEBYSCORE', replicas, '-inf', silent)
local buried = {}
for _, id in ipairs(tombstones) do buried[id] = true end

local function num(value) return tonumber(value) or 0 end

-- A budget is 'req', 'tok', 'p<rank>' (a paced class's prefills), 's<rank>' or 'k<rank>' (a shared
-- class's requests or tokens). What ``state`` uses, waits for (at ``rank``) and holds of it:
local field = {p = 'pf', s = 'sh', k = 'sk'}
local function kind_of(budget)
  if budget == 'req' or budget == 'tok' then return budget, nil end
  return string.sub(budget, 1, 1), string.sub(budget, 2)
end
local function part(table_, budget)
  local kind, rank = kind_of(budget)
  if rank == nil then return num(table_[kind]) end
  return num((table_[field[kind]] or {})[rank])
end
local function used(state, budget) return part(state.use, budget) end
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
-- Rule 1: what a process may be using until its next sync: the part granted last, or the part it
-- said it enforces, whichever is larger (it applies a grant only once the answer reaches it).
local function counted(state, budget)
  return math.max(part(state.hold, budget), part(state.applied or {}, budget))
end
local function count_all(state)
  local out = {req = counted(state, 'req'), tok = counted(state, 'tok'), pf = {}, sh = {}, sk = {}}
  for _, kind in ipairs({'pf', 'sh', 'sk'}) do
    local prefix_ = ({pf = 'p', sh = 's', sk = 'k'})[kind]
    local ranks = {}
    for rank, _ in pairs(state.hold[kind] or {}) do ranks[rank] = true end
    for rank, _ in pairs((state.applied or {})[kind] or {}) do ranks[rank] = true end
    for rank, _ in pairs(ranks) do out[kind][rank] = counted(state, prefix_ .. rank) end
  end
  return out
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

-- Rule 2: the targets of every process for one budget.
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
    local heirs = {}
    for _, id in ipairs(ids) do if not states[id].gone then table.insert(heirs, id) end end
    local each = math.floor(free / #heirs)
    local rest = free - each * #heirs
    for i, id in ipairs(heirs) do target[id] = target[id] + each + ((i <= rest) and 1 or 0) end
  end
  return target
end

-- What ``me`` holds from now on (rule 1): its target, within what the others may be using, never
-- below its own use.
local function settle(cap, states, ids, ranks, budget)
  local target = targets(cap, states, ids, ranks, budget)
  local others = 0
  for _, id in ipairs(ids) do
    if id ~= me then others = others + counted(states[id], budget) end
  end
  local hold = math.min(target[me], math.max(cap - others, 0))
  return math.max(hold, used(states[me], budget))
end

local answer = {live = live, epoch = epoch, tombstones = tombstones, backends = {}}
for _, entry in ipairs(report) do
  local key = prefix .. '{fleet}:b:' .. entry.name
  redis.call('SADD', backends, entry.name)
  local states, ids, mine = {}, {}, nil
  local stored = redis.call('HGETALL', key)
  for i = 1, #stored, 2 do
    local id, state = stored[i], cjson.decode(stored[i + 1])
    if id == me then mine = state else
      if buried[id] then  -- holds what it may still use, wants nothing
        local held = count_all(state)
        held.rate = 0
        state = {use = held, want = {}, hold = held, applied = held, gone = true}
      end
      states[id] = state
      table.insert(ids, id)
    end
  end
  local hold = mine and mine.hold or {req = 0, tok = 0, pf = {}, sh = {}, sk = {}}
  states[me] = {use = entry.use, want = entry.want, hold = hold, applied = entry.applied}
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
  redis.call('HSET', key, me, cjson.encode({use = entry.use, want = entry.want, hold = new, applied = entry.applied}))
  redis.call('PEXPIRE', key, keep_ms)
  local waiting, prefilling, rate, req, tok = {}, {}, 0, 0, 0
  for _, id in ipairs(ids) do
    if id ~= me then
      rate = rate + num(states[id].use.rate)
      req = req + num(states[id].use.req)
      tok = tok + num(states[id].use.tok)
      for rank, want in pairs(states[id].want) do waiting[rank] = (waiting[rank] or 0) + num(want[1]) end
      for rank, count in pairs(states[id].use.pf or {}) do prefilling[rank] = (prefilling[rank] or 0) + num(count) end
    end
  end
  answer.backends[entry.name] = {hold = new, waiting = waiting, prefilling = prefilling, rate = rate,
                                 req = req, tok = tok}
end
return cjson.encode(answer)
