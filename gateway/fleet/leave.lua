-- A process leaves the fleet's ledger (a graceful exit, nothing left in flight): its holdings are
-- back in the pool at once, not after its lease and drain. ARGV: 1 its id, 2 the key prefix.
local me, prefix = ARGV[1], ARGV[2]
for _, name in ipairs(redis.call('SMEMBERS', prefix .. '{fleet}:backends')) do
  redis.call('HDEL', prefix .. '{fleet}:b:' .. name, me)
end
return redis.call('ZREM', prefix .. '{fleet}:replicas', me)
