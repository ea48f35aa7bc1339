-- The fleet's capacity ledger: one process's sync, atomic (gateway/fleet/ledger.py states the rule).
--
-- ARGV: 1 the process's id, 2 its lease (s), 3 its report (JSON), 4 the keys' base (the key prefix
-- and the cell's hash tag: 'gw:{fleet}', or 'gw:{fleet:eu-1}' for cell eu-1), 5 the drain
-- (s), 6 ids to reap (JSON array: processes known dead), 7 the time (s; '' for Redis's own
-- clock), 8 an epoch to create if the ledger has none, 9 how many tenants waiting elsewhere to name.
-- Keys, all under the cell's hash tag: replicas (zset: id -> time of its last sync), backends
-- (set of names), b:<name> (hash: id -> its state), epoch (the ledger's identity).
local me, ttl, report, base = ARGV[1], tonumber(ARGV[2]), cjson.decode(ARGV[3]), ARGV[4]
local drain, reap = tonumber(ARGV[5]), cjson.decode(ARGV[6])
local tenants_reported = tonumber(ARGV[9]) or 8
local now
if ARGV[7] == '' then
  local clock = redis.call('TIME')
  now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
else
  now = tonumber(ARGV[7])
end
local replicas = base .. ':replicas'
local backends = base .. ':backends'
local epoch_key = base .. ':epoch'
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
    redis.call('HDEL', base .. ':b:' .. name, unpack(gone))
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

-- Rule 2, fair across tenants: ``avail`` split max-min fairly by weight among ``names``
-- (each wants ``demand[name]``): every name gets its demand or the common level times its
-- weight, whichever is less, in whole units (the remainder one unit each, largest fraction first). Returns the parts and what is left.
local function fill(avail, names, demand, weight)
  local alloc, active = {}, {}
  for _, name in ipairs(names) do alloc[name] = 0; table.insert(active, name) end
  while avail > 0 and #active > 0 do
    local sum = 0
    for _, name in ipairs(active) do sum = sum + weight[name] end
    local level, rest, met = avail / sum, {}, false
    for _, name in ipairs(active) do
      local need = demand[name] - alloc[name]
      if need <= level * weight[name] then
        alloc[name] = demand[name]
        avail = avail - need
        met = true
      else
        table.insert(rest, name)
      end
    end
    if not met then
      local over = {}
      for _, name in ipairs(rest) do
        local give = math.floor(level * weight[name])
        over[name] = level * weight[name] - give
        alloc[name] = alloc[name] + give
        avail = avail - give
      end
      table.sort(rest, function(a, b) if over[a] ~= over[b] then return over[a] > over[b] end return a < b end)
      for _, name in ipairs(rest) do
        if avail <= 0 then break end
        alloc[name] = alloc[name] + 1
        avail = avail - 1
      end
      rest = {}
    end
    active = rest
  end
  return alloc, avail
end

-- A tenant's part split among its processes, ``parts`` ({id, {use, need, demand}} in id order):
-- first what it uses in each (moving a tenant's slots between its own processes gains nothing
-- and idles a slot for a sync), then what it waits for, then its headroom (room a process keeps
-- for the tenant's next arrival must not idle while the same tenant waits in another); at each
-- step each its whole step when the rest covers them all, else in proportion (rounded down, the
-- remainder one unit each in order).
local function split(alloc, parts, target)
  local given, rest = {}, alloc
  for i, _ in ipairs(parts) do given[i] = 0 end
  for step = 1, 3 do
    if rest <= 0 then break end
    local total = 0
    for i, p in ipairs(parts) do total = total + p[2][step] - given[i] end
    if total <= rest then
      for i, p in ipairs(parts) do given[i] = p[2][step] end
      rest = rest - total
    else
      local more = 0
      for i, p in ipairs(parts) do
        local share = math.floor((p[2][step] - given[i]) * rest / total)
        given[i] = given[i] + share
        more = more + share
      end
      rest = rest - more
      for i, p in ipairs(parts) do
        if rest > 0 and given[i] < p[2][step] then given[i] = given[i] + 1; rest = rest - 1 end
      end
      rest = 0
    end
  end
  for i, p in ipairs(parts) do target[p[1]] = target[p[1]] + given[i] end
end

-- A tenant entry of a report (``TenantUse.as_json``): name, rank, weight, requests, tokens,
-- waiting, waiting tokens, tokens of its latest request, the most it had in flight lately. Its
-- demand in three steps (``split``): what it has in flight; and waiting; and, as headroom, its
-- recent peak if more (requests that come and go need room again soon) plus one request for its
-- next arrival.
local function tenant_demand(state, entry, budget, rank)
  local kind, own = kind_of(budget)
  local tok = kind == 'tok' or kind == 'k'
  local use, want = num(entry[tok and 5 or 4]), num(entry[tok and 7 or 6])
  if own == nil then  -- what the class can use of its waiting (``usable``), as the process's whole
    local all, can = state.want[rank], state.usable[rank]
    local index = tok and 2 or 1
    if all and can and num(all[index]) > 0 then want = math.floor(want * num(can[index]) / num(all[index])) end
  end
  local each = 1
  if tok then
    local count = num(entry[4]) + num(entry[6])
    each = num(entry[8])
    if each <= 0 and count > 0 then each = math.ceil((num(entry[5]) + num(entry[7])) / count) end
  end
  return {use, use + want, math.max(use + want, num(entry[9]) * each) + each}
end

-- Rule 2's targets, fair across tenants, for a budget of requests or tokens (whole or a class's share).
local function fair_targets(cap, states, ids, ranks, budget)
  local kind, own = kind_of(budget)
  local tok = kind == 'tok' or kind == 'k'
  local target, avail = {}, cap
  for _, id in ipairs(ids) do  -- use no tenant accounts for is kept first
    local state, tracked = states[id], 0
    for _, entry in ipairs(state.ten or {}) do
      if own == nil or tostring(entry[2]) == own then tracked = tracked + num(entry[tok and 5 or 4]) end
    end
    target[id] = math.max(used(state, budget) - tracked, 0)
    avail = avail - target[id]
  end
  avail = math.max(avail, 0)
  local groups = {}
  for _, rank in ipairs(ranks) do
    if own == nil or own == rank then
      local names, demand, weight, parts, need = {}, {}, {}, {}, 0
      local function add(name, id, w, levels)
        if levels[3] <= 0 then return end
        if not demand[name] then
          demand[name], weight[name], parts[name] = 0, w, {}
          table.insert(names, name)
        end
        demand[name] = demand[name] + levels[3]
        weight[name] = math.max(weight[name], w)
        need = need + levels[2]
        table.insert(parts[name], {id, levels})
      end
      for _, id in ipairs(ids) do
        local state = states[id]
        if state.ten then
          for _, entry in ipairs(state.ten) do
            if tostring(entry[2]) == rank then
              local name = entry[1] ~= '' and entry[1] or ('\0' .. id)
              add(name, id, math.max(num(entry[3]), 1e-6), tenant_demand(state, entry, budget, rank))
            end
          end
        else
          local want = wanted(state, budget, rank)
          add('\0' .. id, id, 1, {0, want, want})
        end
      end
      table.sort(names)
      table.insert(groups, {names, demand, weight, parts, need})
    end
  end
  -- A rank's headroom comes only from what the lower ranks' use and waiting leave: its own use and
  -- waiting go before theirs (strict class order), but room kept idle for its next arrivals does
  -- not (one process alone keeps none): interactive tenants served lately once held every slot,
  -- idle, for their 10 s while batch waited on another process with its share free.
  local below = 0
  for _, group in ipairs(groups) do below = below + group[5] end
  for _, group in ipairs(groups) do
    if avail <= 0 then break end
    local names, demand, weight, parts, need = group[1], group[2], group[3], group[4], group[5]
    below = below - need
    local budget = math.min(avail, math.max(avail - below, need))
    local alloc, left = fill(budget, names, demand, weight)
    avail = avail - budget + left
    for _, name in ipairs(names) do split(alloc[name], parts[name], target) end
  end
  if avail > 0 then
    local heirs = {}
    for _, id in ipairs(ids) do if not states[id].gone then table.insert(heirs, id) end end
    local each = math.floor(avail / #heirs)
    local rest = avail - each * #heirs
    for i, id in ipairs(heirs) do target[id] = target[id] + each + ((i <= rest) and 1 or 0) end
  end
  return target
end

-- What ``me`` holds from now on (rule 1): its target, within what the others may be using, never
-- below its own use; and the part it is told to enforce: the same, or its target when that is
-- below its use (its tenants hold more than their share: it starts nothing until below it).
local function settle(cap, states, ids, ranks, budget, fair)
  local target
  if fair and string.sub(budget, 1, 1) ~= 'p' then
    target = fair_targets(cap, states, ids, ranks, budget)
  else
    target = targets(cap, states, ids, ranks, budget)
  end
  local others = 0
  for _, id in ipairs(ids) do
    if id ~= me then others = others + counted(states[id], budget) end
  end
  local use = used(states[me], budget)
  local hold = math.max(math.min(target[me], math.max(cap - others, 0)), use)
  if target[me] < use then return hold, target[me] end
  return hold, hold
end

local answer = {live = live, epoch = epoch, tombstones = tombstones, backends = {}}
for _, entry in ipairs(report) do
  local key = base .. ':b:' .. entry.name
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
  states[me] = {use = entry.use, want = entry.want, hold = hold, applied = entry.applied, ten = entry.ten}
  table.insert(ids, me)
  table.sort(ids)
  local seen, ranks, fair = {}, {}, false
  local function rank_seen(rank)
    if not seen[rank] then seen[rank] = true; table.insert(ranks, rank) end
  end
  for _, id in ipairs(ids) do
    for rank, _ in pairs(states[id].want) do rank_seen(rank) end
    for _, tenant in ipairs(states[id].ten or {}) do rank_seen(tostring(tenant[2])); fair = true end
  end
  table.sort(ranks, function(a, b) return tonumber(a) < tonumber(b) end)
  usable(states, ids, entry.cap)
  local new = {pf = {}, sh = {}, sk = {}}
  local told = {pf = {}, sh = {}, sk = {}}
  new.req, told.req = settle(entry.cap.req, states, ids, ranks, 'req', fair)
  new.tok, told.tok = settle(entry.cap.tok, states, ids, ranks, 'tok', fair)
  for rank, bound in pairs(entry.cap.pf) do
    new.pf[rank], told.pf[rank] = settle(bound, states, ids, ranks, 'p' .. rank, fair)
  end
  for rank, bound in pairs(entry.cap.sh) do
    new.sh[rank], told.sh[rank] = settle(bound, states, ids, ranks, 's' .. rank, fair)
  end
  for rank, bound in pairs(entry.cap.sk) do
    new.sk[rank], told.sk[rank] = settle(bound, states, ids, ranks, 'k' .. rank, fair)
  end
  redis.call('HSET', key, me, cjson.encode({use = entry.use, want = entry.want, hold = new, applied = entry.applied,
                                            ten = entry.ten}))
  redis.call('PEXPIRE', key, keep_ms)
  local waiting, prefilling, rate, req, tok, tenants = {}, {}, 0, 0, 0, {}
  local function tenant_waits(rank, name, weight, count)
    if count <= 0 then return end
    local by_name = tenants[rank] or {}
    tenants[rank] = by_name
    local have = by_name[name] or {weight, 0}
    by_name[name] = {math.max(have[1], weight), have[2] + count}
  end
  for _, id in ipairs(ids) do
    if id ~= me then
      local state = states[id]
      rate = rate + num(state.use.rate)
      req = req + num(state.use.req)
      tok = tok + num(state.use.tok)
      for rank, want in pairs(state.want) do
        waiting[rank] = (waiting[rank] or 0) + num(want[1])
        if not state.ten then tenant_waits(rank, '', 1, num(want[1])) end
      end
      for _, tenant in ipairs(state.ten or {}) do
        tenant_waits(tostring(tenant[2]), tenant[1], num(tenant[3]), num(tenant[6]))
      end
      for rank, count in pairs(state.use.pf or {}) do prefilling[rank] = (prefilling[rank] or 0) + num(count) end
    end
  end
  local ten = {}
  for rank, by_name in pairs(tenants) do  -- the busiest tenants waiting elsewhere, the rest summed as ''
    local list = {}
    for name, value in pairs(by_name) do table.insert(list, {name, value[1], value[2]}) end
    table.sort(list, function(a, b) if a[3] ~= b[3] then return a[3] > b[3] end return a[1] < b[1] end)
    local kept, rest = {}, nil
    for i, item in ipairs(list) do
      if i <= tenants_reported and item[1] ~= '' then table.insert(kept, item)
      else
        rest = rest or {'', 0, 0}
        rest[2], rest[3] = rest[2] + item[2], rest[3] + item[3]
      end
    end
    if rest then table.insert(kept, rest) end
    ten[rank] = kept
  end
  answer.backends[entry.name] = {hold = told, waiting = waiting, prefilling = prefilling, rate = rate,
                                 req = req, tok = tok, ten = ten}
end
return cjson.encode(answer)
