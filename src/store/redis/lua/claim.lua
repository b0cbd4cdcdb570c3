-- Claim a key as in flight, or return what it holds. One round trip.
-- KEYS[1] record key; ARGV[1] encoded in-flight entry; ARGV[2] lease in ms.
-- Returns nil when claimed, else {stored entry bytes, its remaining time to live in ms}.
local v = redis.call('GET', KEYS[1])
if v then
  return {v, redis.call('PTTL', KEYS[1])}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
