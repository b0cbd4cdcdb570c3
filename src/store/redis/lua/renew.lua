-- Extend our in-flight claim's lease, fenced by the claim token.
-- KEYS[1] record key; ARGV[1] token (16 bytes); ARGV[2] lease in ms.
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, @STATE@, @STATE@) == '@IN_FLIGHT@' and string.sub(v, @TOKEN_FROM@, @TOKEN_TO@) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
