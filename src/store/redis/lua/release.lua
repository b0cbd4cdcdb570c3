-- Delete our in-flight claim so a retry runs again, fenced by the claim token.
-- KEYS[1] record key; ARGV[1] token (16 bytes). Publishes on the key's done channel.
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, @STATE@, @STATE@) == '@IN_FLIGHT@' and string.sub(v, @TOKEN_FROM@, @TOKEN_TO@) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('@PUBLISH@', KEYS[1] .. '@DONE@', '')
  return 1
end
return 0
