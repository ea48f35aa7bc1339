-- The limit store's clock and number helpers: joined first into sync.lua and in_use.lua
-- (gateway/limitstore/scripts.py), not a script of its own.
--
-- ARGV[1], ARGV[2]: an injected clock's seconds and microseconds, or '' (both) for the server's
-- TIME, so that buckets refill on one clock whichever replica runs the script.
-- Defines: sec, usec (the time as given, strings), t (seconds, a number), num(value) (a field
-- read as a number, 0 when missing), fmt(value) (a number written back without losing digits).
local function now(sec, usec)
  if sec == '' then
    local t = redis.call('TIME')
    return t[1], t[2]
  end
  return sec, usec
end
local sec, usec = now(ARGV[1], ARGV[2])
local t = tonumber(sec) + tonumber(usec) / 1e6
local function num(value)
  return tonumber(value or '0') or 0
end
local function fmt(value)
  return string.format('%.17g', value)
end
