-- A process leaves the fleet's ledger (a graceful exit, nothing left in flight): its holdings are
-- back in the pool at once, not after its lease and drain. ARGV: 1 its id, 2 the keys' base
-- (the key prefix and the cell's hash tag, as ledger.lua's).
local me, base = ARGV[1], ARGV[2]
for _, name in ipairs(redis.call('SMEMBERS', base .. ':backends')) do
  redis.call('HDEL', base .. ':b:' .. name, me)
end
return redis.call('ZREM', base .. ':replicas', me)
