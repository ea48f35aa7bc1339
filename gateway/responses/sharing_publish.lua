-- Writes one shared response entry, then drops the tenant's expired entries and its oldest past
-- the bound shared by every replica (gateway/responses/sharing.py; sharing_clock.lua
-- comes first and defines now).
--
-- KEYS[1]: the tenant's hash (id's hash -> entry); KEYS[2]: its sorted set of the same hashes by
-- expiry (microseconds, Redis's clock).
-- ARGV[1]: the id's hash; ARGV[2]: the entry (JSON {backend, model}); ARGV[3]: its ttl (ms);
-- ARGV[4]: the tenant's bound (entries kept at most).
-- Returns how many entries it dropped (at most trim expired and trim past the bound).
local trim = 1000  -- entries one write may drop at most: Lua's unpack takes a few thousand at most
local ttl, bound = tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now + ttl * 1000, ARGV[1])
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, trim)
local over = math.min(redis.call('ZCARD', KEYS[2]) - #gone - bound, trim)
if over > 0 then
  for _, field in ipairs(redis.call('ZRANGE', KEYS[2], #gone, #gone + over - 1)) do
    gone[#gone + 1] = field
  end
end
if #gone > 0 then
  redis.call('HDEL', KEYS[1], unpack(gone))
  redis.call('ZREM', KEYS[2], unpack(gone))
end
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
return #gone
