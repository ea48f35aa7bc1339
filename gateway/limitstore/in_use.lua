-- The slots a tenant holds fleet-wide: running, and spare in some replica's lease
-- (gateway/limitstore/scripts.py joins clock.lua and purge.lua before it).
--
-- KEYS[1]: the tenant's held hash; KEYS[2]: its lease zset (purged first).
-- ARGV[1], ARGV[2]: the clock (clock.lua).
-- Returns the slots held (an integer; 0 when none).
return num(redis.call('HGET', KEYS[1], '|slots'))
