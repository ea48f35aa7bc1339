"""The Lua scripts of the Redis limit store: one atomic step each (``limitstore/redis.py``).

Every script takes the clock first (``ARGV[1]``, ``ARGV[2]``: an injected clock's seconds and
microseconds, or ``""`` for the server's ``TIME``), so that buckets refill on one clock
whichever replica runs them. All the keys of one call belong to one scope (a tenant) and share
its hash tag: one Redis Cluster slot per call.
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
"""

# Bucket hashes {level, s, us}: the level and the time it was written (refilled lazily).
_BUCKETS = """
local function level_of(key, capacity, rate)
  local state = redis.call('HMGET', key, 'level', 's', 'us')
  if not state[1] then
    return capacity
  end
  local elapsed = (tonumber(sec) - tonumber(state[2])) + (tonumber(usec) - tonumber(state[3])) / 1e6
  return math.min(capacity, tonumber(state[1]) + math.max(0, elapsed) * rate)
end
local function store(key, value, capacity, rate)
  if value >= capacity then
    redis.call('DEL', key)
    return
  end
  redis.call('HSET', key, 'level', string.format('%.17g', value), 's', sec, 'us', usec)
  redis.call('PEXPIRE', key, math.ceil((capacity - value) / rate * 1000) + 1000)
end
"""

# KEYS[1]: hash replica -> slots held; KEYS[2]: zset replica -> lease expiry (seconds).
_SLOTS = (
    _NOW
    + _BUCKETS
    + """
local function purge()
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', t)
  for _, replica in ipairs(expired) do
    redis.call('HDEL', KEYS[1], replica)
  end
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', t)
  end
  local used = 0
  for _, n in ipairs(redis.call('HVALS', KEYS[1])) do
    used = used + tonumber(n)
  end
  return used
end
"""
)

# One admission: KEYS[3..] the buckets to take from; ARGV[3..5]: replica, slot limit ('' for
# none), lease ttl; then per bucket amount, capacity, refill per second. Everything or nothing.
# Returns {refused, level...}: refused 0 (admitted), 1 (the slot) or 1 + the refusing bucket's
# position; each bucket's level after the take (before it, when refused).
ADMIT = (
    _SLOTS
    + """
local replica, limit, ttl = ARGV[3], ARGV[4], tonumber(ARGV[5])
local refused = 0
if limit ~= '' and purge() >= tonumber(limit) then
  refused = 1
end
local levels, amounts = {}, {}
for i = 3, #KEYS do
  local j = 6 + (i - 3) * 3
  local amount = tonumber(ARGV[j])
  local level = level_of(KEYS[i], tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2]))
  levels[i - 2], amounts[i - 2] = level, amount
  if refused == 0 and level < amount then
    refused = i - 1
  end
end
if refused == 0 then
  if limit ~= '' then
    redis.call('HINCRBY', KEYS[1], replica, 1)
    redis.call('ZADD', KEYS[2], t + ttl, replica)
    redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 1000))
    redis.call('PEXPIRE', KEYS[2], math.ceil(ttl * 1000))
  end
  for i = 3, #KEYS do
    local j = 6 + (i - 3) * 3
    levels[i - 2] = levels[i - 2] - amounts[i - 2]
    store(KEYS[i], levels[i - 2], tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2]))
  end
end
local reply = {refused}
for i, level in ipairs(levels) do
  reply[i + 1] = string.format('%.17g', level)
end
return reply
"""
)

# One settlement: ARGV[3..4]: replica, '1' to release one of its slots; then per bucket
# (KEYS[3..]) the adjustment (> 0 gives back, < 0 charges), capacity, refill per second.
# Levels stay within [-capacity, capacity] (see ``limitstore/base.py``). Returns each bucket's
# level after its adjustment. Also what a process charges Redis for an outage ('0': no slot).
SETTLE = (
    _SLOTS
    + """
local reply = {}
if ARGV[4] == '1' then
  local n = redis.call('HINCRBY', KEYS[1], ARGV[3], -1)
  if n <= 0 then
    redis.call('HDEL', KEYS[1], ARGV[3])
    redis.call('ZREM', KEYS[2], ARGV[3])
  end
end
for i = 3, #KEYS do
  local j = 5 + (i - 3) * 3
  local amount, capacity, rate = tonumber(ARGV[j]), tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2])
  local level = level_of(KEYS[i], capacity, rate)
  level = math.min(capacity, math.max(-capacity, level + amount))
  store(KEYS[i], level, capacity, rate)
  reply[i - 2] = string.format('%.17g', level)
end
return reply
"""
)

IN_USE = _SLOTS + "return purge()\n"

# KEYS: pairs (held hash, lease zset); ARGV[3..4]: replica, ttl; ARGV[5..]: per pair, the
# slots this replica holds there (written as the truth), or -1 (an operation is in flight:
# only extend the lease).
RENEW = (
    _NOW
    + """
local replica, ttl = ARGV[3], tonumber(ARGV[4])
for i = 1, #KEYS, 2 do
  local held, leases = KEYS[i], KEYS[i + 1]
  local n = tonumber(ARGV[4 + (i + 1) / 2])
  if n == 0 then
    redis.call('HDEL', held, replica)
    redis.call('ZREM', leases, replica)
  else
    if n > 0 then
      redis.call('HSET', held, replica, n)
    end
    if redis.call('HEXISTS', held, replica) == 1 then
      redis.call('ZADD', leases, t + ttl, replica)
      redis.call('PEXPIRE', held, math.ceil(ttl * 1000))
      redis.call('PEXPIRE', leases, math.ceil(ttl * 1000))
    end
  end
end
return 1
"""
)
