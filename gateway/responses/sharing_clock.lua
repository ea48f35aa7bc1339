-- Redis's clock for the shared responses' scripts: joined first into sharing_publish.lua
-- and sharing_lookup.lua (gateway/responses/sharing.py), not a script of its own.
--
-- Defines now: Redis's TIME in microseconds (exact in a double until the year 2255), so that
-- entries written a millisecond apart keep their order.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
