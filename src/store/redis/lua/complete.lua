-- Record the completed entry for the claim whose token is ARGV[1]: over our own in-flight claim,
-- or on a key that holds nothing (our lease ran out, and nobody claimed the key since) unless
-- the record's tombstone key holds another record's tombstone.
-- KEYS[1] record key; ARGV[1] token (16 bytes); ARGV[2] encoded entry; ARGV[3] ttl in ms;
-- on a route that keeps tombstones: KEYS[2] the tombstone's key; when the record leaves one:
-- ARGV[4] the tombstone, ARGV[5] its ttl.
-- The @...@ places are filled in from the record layout in record.rs when the script loads.
-- Returns 1 when written, or when our own completion is already there (a retried call whose
-- first answer was lost); 0 when another claim or record holds the key. Publishes on the key's
-- done channel (waiters wake up and look again).
local v = redis.call('GET', KEYS[1])
if v then
  if string.sub(v, @TOKEN_FROM@, @TOKEN_TO@) ~= ARGV[1] then
    return 0
  end
  if string.sub(v, @STATE@, @STATE@) ~= '@IN_FLIGHT@' then
    return 1
  end
elseif KEYS[2] and redis.call('EXISTS', KEYS[2]) == 1 then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
if ARGV[4] then
  redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[5])
end
redis.call('@PUBLISH@', KEYS[1] .. '@DONE@', '')
return 1
