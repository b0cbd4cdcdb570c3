-- Claim a key as in flight, or return what it holds; a key whose record has expired but whose
-- tombstone lives is not free: the tombstone is returned instead. One round trip.
-- KEYS[1] record key; KEYS[2] its tombstone (same hash slot); ARGV[1] encoded in-flight entry;
-- ARGV[2] lease in ms.
-- Returns nil when claimed, else {stored entry bytes, its remaining time to live in ms}.
local v = redis.call('GET', KEYS[1])
if v then
  return {v, redis.call('PTTL', KEYS[1])}
end
local t = redis.call('GET', KEYS[2])
if t then
  return {t, redis.call('PTTL', KEYS[2])}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
