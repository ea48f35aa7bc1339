-- One step of one replica for one tenant: report, give back, adjust, ask, renew
-- (gateway/limitstore/scripts.py joins clock.lua and purge.lua before it, and states the bound
-- this keeps; gateway/limitstore/lease.py says what a process does with the reply).
--
-- KEYS[1]: the tenant's held hash; KEYS[2]: its lease zset; KEYS[3..]: its buckets, one hash each
-- ({level, s, us}).
-- ARGV[1], ARGV[2]: the clock (clock.lua). ARGV[3..6]: replica, lease ttl (s), how long a refusal
-- is remembered (s), the slot limit ('': no slot section). Slot section ARGV[7..11]: in use
-- (running now, written as the truth), believed held, keep, need, want. Then one section of 9 per
-- bucket (KEYS[3..]), from ARGV[12]: name, capacity, refill per second, spent (since the last
-- report), believed held, keep, adjust (> 0 gives back to the level, < 0 charges it, down to
-- -capacity), need, want.
--
-- "believed": what the replica thinks it holds. Redis keeps the smaller of that and its own
-- count (a grant whose answer was lost is given back; a lease that expired is not revived),
-- but never fewer slots than are running. "need" is all or nothing, over every section: when
-- one cannot be granted, none is, and the refusal is remembered in '|wanted'. "want" is a
-- prefetch, granted from what is left, never while a refusal is remembered.
--
-- Returns {refused (0, 1 for the slot, 1 + i for the i-th bucket), wanted (0/1), slots held,
-- slots in use fleet-wide, then per bucket: tokens held, level (both as strings, '%.17g')}.
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
