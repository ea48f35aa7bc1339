-- A rollout's judge lease, taken or renewed in one step (gateway/rollout/store.py: try_lead).
-- Taken with SET NX PX when free or expired; renewed (PEXPIRE) when the caller holds it already.
--
-- KEYS[1]: the lease ({prefix}rollout:{key}:lease). ARGV[1]: the caller; ARGV[2]: the TTL in ms.
-- Returns 1 when the caller holds the lease after the call, 0 when another holder does.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
