"""The Lua scripts of the Redis limit store: one atomic step each (``limitstore/redis.py``).

Every script takes the clock first (``ARGV[1]``, ``ARGV[2]``: an injected clock's seconds and
microseconds, or ``""`` for the server's ``TIME``), so that buckets refill on one clock
whichever replica runs them. All the keys of one call belong to one scope (a tenant) and share
its hash tag: one Redis Cluster slot per call, and no script ever spans two tenants.

**What Redis keeps per tenant** (``limitstore/lease.py`` says what a process does with it):

* ``{t}:leases``, a sorted set ``replica -> lease expiry``: a replica that stops renewing
  loses everything it holds ``ttl`` later (its slots freed, its tokens counted as spent);
* ``{t}:held``, a hash: ``<replica>`` the concurrency slots it holds, ``<replica>|<bucket>``
  the tokens of that bucket leased to it and not yet reported spent; ``|slots`` and
  ``|<bucket>`` the totals over replicas, ``|names`` the buckets ever leased (for the purge),
  ``|wanted`` when an ask was last refused (a replica that learns it gives back its spare);
* ``{t}:<bucket>``, a hash ``{level, s, us}``: the bucket's level, refilled lazily, never
  above ``capacity - leased`` (below).

**The bound, at every instant**: a bucket's level plus every token leased out never exceeds
its capacity (the level's ceiling is ``capacity - leased``), and the slots held never exceed
the limit. A grant moves tokens from the level to a lease; a report of tokens spent removes
them from the lease (lifting the ceiling, from which the level refills at its rate, never at
once); what a replica gives back returns to the level. So the tokens spent fleet-wide in any
window of ``w`` seconds are at most ``capacity + rate * w`` (plus what was given back), the
bound of one token bucket, however the leases are spread. The level is never deleted while
tokens are leased (its key lives at least the lease ``ttl``): a missing level reads as full,
which is true only once every lease is gone and the refill had time to reach the capacity.
"""

from __future__ import annotations

# ARGV[1], ARGV[2]: the injected clock's seconds and microseconds, or "" for the server's TIME.
_NOW = """
local function now(sec, usec)
  if sec == '' then
    local t = redis.call('TIME')
    return t[1], t[2]
  end
  return sec, usec
end
local sec, usec = now(ARGV[1], ARGV[2])
local t = tonumber(sec) + tonumber(usec) / 1e6
local function num(value)
  return tonumber(value or '0') or 0
end
local function fmt(value)
  return string.format('%.17g', value)
end
"""

# KEYS[1]: the held hash; KEYS[2]: the lease zset. Drops every replica whose lease expired.
_PURGE = """
local function purge()
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', t)
  if #expired == 0 then
    return
  end
  local names = redis.call('HGET', KEYS[1], '|names') or ''
  for _, replica in ipairs(expired) do
    local slots = num(redis.call('HGET', KEYS[1], replica))
    if slots ~= 0 then
      redis.call('HSET', KEYS[1], '|slots', math.max(0, num(redis.call('HGET', KEYS[1], '|slots')) - slots))
    end
    redis.call('HDEL', KEYS[1], replica)
    for name in string.gmatch(names, '[^,]+') do
      local field = replica .. '|' .. name
      local held = num(redis.call('HGET', KEYS[1], field))
      if held ~= 0 then
        local total = math.max(0, num(redis.call('HGET', KEYS[1], '|' .. name)) - held)
        redis.call('HSET', KEYS[1], '|' .. name, fmt(total))
      end
      redis.call('HDEL', KEYS[1], field)
    end
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', t)
end
purge()
"""

# One step of one replica for one tenant: report, give back, adjust, ask, renew.
#
# ARGV[3..6]: replica, lease ttl (s), how long a refusal is remembered (s), the slot limit ('':
# no slot section). Slot section ARGV[7..11]: in use (running now, written as the truth),
# believed held, keep, need, want. Then one section of 9 per bucket (KEYS[3..]): name,
# capacity, refill per second, spent (since the last report), believed held, keep, adjust
# (> 0 gives back to the level, < 0 charges it, down to -capacity), need, want.
#
# "believed": what the replica thinks it holds. Redis keeps the smaller of that and its own
# count (a grant whose answer was lost is given back; a lease that expired is not revived),
# but never fewer slots than are running. "need" is all or nothing, over every section: when
# one cannot be granted, none is, and the refusal is remembered in '|wanted'. "want" is a
# prefetch, granted from what is left, never while a refusal is remembered.
#
# Returns {refused (0, 1 for the slot, 1 + i for the i-th bucket), wanted (0/1), slots held,
# slots in use fleet-wide, then per bucket: tokens held, level}.
SYNC = (
    _NOW
    + _PURGE
    + """
local replica, ttl, memory, limit = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local H = KEYS[1]
local wanted = (t - num(redis.call('HGET', H, '|wanted'))) < memory
local refused = 0
local slot, buckets = nil, {}
if limit ~= '' then
  local in_use, believed, keep = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
  local cur = num(redis.call('HGET', H, replica))
  local total = num(redis.call('HGET', H, '|slots'))
  local kept = math.max(in_use, math.min(keep, math.max(in_use, math.min(cur, believed))))
  total = math.max(0, total - cur + kept)
  slot = {kept = kept, total = total, limit = tonumber(limit), need = tonumber(ARGV[10]), want = tonumber(ARGV[11])}
  if slot.need > 0 and total + slot.need > slot.limit then
    refused = 1
  end
end
local names = redis.call('HGET', H, '|names') or ''
local listed = ',' .. names .. ','
for i = 3, #KEYS do
  local j = 12 + (i - 3) * 9
  local name, capacity, rate = ARGV[j], tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2])
  local spent, believed = tonumber(ARGV[j + 3]), tonumber(ARGV[j + 4])
  local keep, adjust = tonumber(ARGV[j + 5]), tonumber(ARGV[j + 6])
  local field = replica .. '|' .. name
  local cur = num(redis.call('HGET', H, field))
  local leased = num(redis.call('HGET', H, '|' .. name))
  local level = capacity - leased
  local state = redis.call('HMGET', KEYS[i], 'level', 's', 'us')
  if state[1] then
    local elapsed = (tonumber(sec) - tonumber(state[2])) + (tonumber(usec) - tonumber(state[3])) / 1e6
    level = math.min(capacity - leased, tonumber(state[1]) + math.max(0, elapsed) * rate)
  end
  local base = math.min(cur, believed)
  local own = math.max(0, base - spent)
  local kept = math.min(keep, own)
  leased = math.max(0, leased - cur + kept)
  level = level + (cur - base) + (own - kept)
  level = math.min(capacity - leased, math.max(-capacity, level + adjust))
  local b = {key = KEYS[i], name = name, field = field, capacity = capacity, rate = rate, kept = kept,
             leased = leased, level = level, need = tonumber(ARGV[j + 7]), want = tonumber(ARGV[j + 8])}
  buckets[i - 2] = b
  if refused == 0 and b.need > 0 and level < b.need then
    refused = i - 1
  end
  if not string.find(listed, ',' .. name .. ',', 1, true) then
    names = (names == '' and name) or (names .. ',' .. name)
    listed = ',' .. names .. ','
    redis.call('HSET', H, '|names', names)
  end
end
if refused ~= 0 then
  redis.call('HSET', H, '|wanted', fmt(t))
  wanted = true
end
local holds = false
local reply = {refused, wanted and 1 or 0}
if slot then
  local grant = 0
  if refused == 0 then
    local free = math.max(0, slot.limit - slot.total - slot.need)
    grant = slot.need + ((wanted and 0) or math.max(0, math.min(slot.want, free)))
  end
  local held = slot.kept + grant
  slot.total = slot.total + grant
  if held > 0 then
    redis.call('HSET', H, replica, held)
    holds = true
  else
    redis.call('HDEL', H, replica)
  end
  redis.call('HSET', H, '|slots', slot.total)
  reply[3], reply[4] = held, slot.total
else
  reply[3], reply[4] = 0, 0
end
for i, b in ipairs(buckets) do
  local grant = 0
  if refused == 0 then
    local spare = math.floor(math.max(0, b.level - b.need))
    grant = b.need + ((wanted and 0) or math.max(0, math.min(b.want, spare)))
  end
  local held = b.kept + grant
  b.leased = b.leased + grant
  b.level = b.level - grant
  if held > 0 then
    redis.call('HSET', H, b.field, fmt(held))
    holds = true
  else
    redis.call('HDEL', H, b.field)
  end
  redis.call('HSET', H, '|' .. b.name, fmt(b.leased))
  redis.call('HSET', b.key, 'level', fmt(b.level), 's', sec, 'us', usec)
  local refill_ms = math.ceil(math.max(0, b.capacity - b.level) / b.rate * 1000)
  redis.call('PEXPIRE', b.key, math.max(refill_ms, math.ceil(ttl * 1000)) + 1000)
  reply[3 + 2 * i], reply[4 + 2 * i] = fmt(held), fmt(b.level)
end
if holds then
  redis.call('ZADD', KEYS[2], t + ttl, replica)
else
  redis.call('ZREM', KEYS[2], replica)
end
redis.call('PEXPIRE', H, math.ceil(ttl * 1000) + 1000)
redis.call('PEXPIRE', KEYS[2], math.ceil(ttl * 1000) + 1000)
return reply
"""
)

# The slots held fleet-wide (running, and spare in some replica's lease).
IN_USE = _NOW + _PURGE + "return num(redis.call('HGET', KEYS[1], '|slots'))\n"
