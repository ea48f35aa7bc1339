-- Reads one shared response entry and how long it has left on Redis's clock
-- (gateway/responses/sharing.py; sharing_clock.lua comes first and defines now).
--
-- KEYS[1]: the tenant's hash; KEYS[2]: its sorted set by expiry (as sharing_publish.lua).
-- ARGV[1]: the id's hash.
-- Returns {entry (JSON {backend, model}), microseconds left}, or nil when there is none or it expired.
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if not entry then
  return false
end
local left = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[1]) or 0) - now
if left <= 0 then
  return false
end
return {entry, left}
