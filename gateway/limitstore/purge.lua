-- The limit store's purge of expired leases: joined after clock.lua into sync.lua and in_use.lua
-- (gateway/limitstore/scripts.py), not a script of its own; it runs as soon as it is read.
--
-- KEYS[1]: the tenant's held hash; KEYS[2]: its lease zset (replica -> lease expiry).
-- Drops every replica whose lease expired at t: its slots come off '|slots', the tokens it held
-- of each bucket (the names in '|names') come off that bucket's '|<bucket>' total, and its
-- fields and its lease go. Returns nothing.
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
