-- Forgets one shared response entry (gateway/responses/sharing.py: its backend lost it).
--
-- KEYS[1]: the tenant's hash; KEYS[2]: its sorted set by expiry (as sharing_publish.lua).
-- ARGV[1]: the id's hash.
-- Returns 1.
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
