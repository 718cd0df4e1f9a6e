#!lua
--[[
complete: store a lease's outcome and end the lease, if the lease still holds the record.

KEYS[1]  the record's key
ARGV[1]  the lease's fencing token, 16 bytes
ARGV[2]  the completed record's tag: 'c' (raw body), 'z' (LZ4 body) or 'h' (body dropped)
ARGV[3]  the completion's metadata: compact (first byte 0x80 and up) or length-prefixed
         (its length, 4 bytes, big-endian, then idem_core::encode_meta); codec.rs has both
ARGV[4]  the body as stored
ARGV[5]  how long the completed record is kept, in milliseconds (>= 1)
ARGV[6]  '1' when this is the same call sent again after its connection dropped, else '0'

Returns 1 when the completion replaced the in-progress record, 0 when the lease no longer
holds it (absent, completed, or held by another token): then nothing was changed.
A call sent again ('1') also gets 1 when the record already holds exactly this completion:
the first send did it and only its reply was lost.
Errors: "IDEM_CORRUPT <why>" when the stored value is not a record; nothing is written.

The record written is the tag, the fingerprint and attempt carried over from the
in-progress record (36 bytes), ARGV[3] and ARGV[4]: the script never looks into the
metadata or the body. Only the in-progress record's 59 bytes are read. All checks come
before the only write.

Publishes an empty message on the channel (or shard channel) named like KEYS[1] after a
write, when that channel has subscribers (waiters for the record): nothing is published
otherwise (prelude.lua's wake).

The shebang has no flags: Redis counts the script as a writer and refuses it with OOM,
before it runs, when the server is out of memory.
]]
local key = KEYS[1]
local head, state = lease_head(key, ARGV[1])
if state == 'corrupt' then
  return redis.error_reply('IDEM_CORRUPT not a record')
end
if state == 'settled' and ARGV[6] == '1' and string.sub(head, 1, 1) == ARGV[2] then
  local record = redis.call('GET', key)
  if string.sub(record, 38) == ARGV[3] .. ARGV[4] then
    return 1
  end
end
if state ~= 'held' then
  return 0
end
-- ARGV[5] goes as the string it came as: tonumber() would make Redis format the number
-- back into a string for SET (about 0.5 µs of its time a call, measured).
redis.call('SET', key, ARGV[2] .. string.sub(head, 24, 59) .. ARGV[3] .. ARGV[4], 'PX', ARGV[5])
-- Wake the record's waiters (prelude.lua), only if one subscribed.
wake(key)
return 1
