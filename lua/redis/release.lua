#!lua flags=allow-oom
--[[
release: end a lease and forget its record, so that the next begin is attempt 1 again.

KEYS[1]  the record's key
ARGV[1]  the lease's fencing token, 16 bytes
ARGV[2]  '1' when this is the same call sent again after its connection dropped, else '0'

Returns 1 when the record was deleted, 0 when the lease no longer holds it (absent,
completed, or held by another token): then nothing was changed.
A call sent again ('1') also gets 1 when the record is absent: the key is forgotten, which
is what the release was for, whether the first send or the record's expiry did it.
Errors: "IDEM_CORRUPT <why>" when the stored value is not a record; nothing is written.

Publishes an empty message on the channel (or shard channel) named like KEYS[1] after a
write, when that channel has subscribers (waiters for the record): nothing is published
otherwise (prelude.lua's wake).

`allow-oom`: a release only frees memory, so it runs even when the server is out of
memory (a full server must still let workers give their keys back).
]]
local key = KEYS[1]
local _, state = lease_head(key, ARGV[1])
if state == 'corrupt' then
  return redis.error_reply('IDEM_CORRUPT not a record')
end
if state == 'absent' and ARGV[2] == '1' then
  return 1
end
if state ~= 'held' then
  return 0
end
redis.call('DEL', key)
-- Wake the record's waiters (prelude.lua), only if one subscribed.
wake(key)
return 1
