-- Record the completed entry staged at KEYS[2] by a plain SET in the same pipeline (so a large
-- body never passes through Lua) for the claim whose token is ARGV[1]: over our own in-flight
-- claim, or on a key that holds nothing (our lease ran out, and nobody claimed the key since)
-- unless the record's tombstone key holds another record's tombstone.
-- KEYS[1] record key; KEYS[2] staged entry; ARGV[1] token (16 bytes); ARGV[2] ttl in ms;
-- on a route that keeps tombstones: KEYS[3] the tombstone's key; when the record leaves one:
-- ARGV[3] the tombstone, ARGV[4] its ttl.
-- The @...@ places are filled in from the record layout in record.rs when the script loads.
-- Returns 1 when moved into place, or when our own completion is already there (a retried call
-- whose first answer was lost); 0 when another claim or record holds the key. The staged entry
-- never outlives it. Publishes on the key's done channel (waiters wake up and look again).
local v = redis.call('GET', KEYS[1])
local written = 1
if v then
  if string.sub(v, @TOKEN_FROM@, @TOKEN_TO@) ~= ARGV[1] then
    written = 0
  elseif string.sub(v, @STATE@, @STATE@) ~= '@IN_FLIGHT@' then
    redis.call('DEL', KEYS[2])
    return 1
  end
elseif KEYS[3] and redis.call('EXISTS', KEYS[3]) == 1 then
  written = 0
end
if written == 0 then
  redis.call('DEL', KEYS[2])
  return 0
end
redis.call('RENAME', KEYS[2], KEYS[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if ARGV[3] then
  redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4])
end
redis.call('@PUBLISH@', KEYS[1] .. '@DONE@', '')
return 1
