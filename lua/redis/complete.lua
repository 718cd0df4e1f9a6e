#!lua
--[[
complete: store a lease's outcome and end the lease, if the lease still holds the record.

KEYS[1]  the record's key
ARGV[1]  'P' and the lease's fencing token (17 bytes): what an in-progress record held by
         this lease starts with
ARGV[2]  the completed record: in mode 'w' whole (tag, fingerprint, expiry, attempt,
         metadata, body: the layout of crates/idem-redis/src/codec.rs); in mode 'c' only its
         tag, then the expiry (4 bytes), the metadata and the body, and the fingerprint and
         attempt are carried over from the in-progress record
ARGV[3]  how long the completed record is kept, in milliseconds (>= 1)
ARGV[4]  the mode: 'w' or 'c', upper case ('W', 'C') when this is the same call sent again
         after its connection dropped

Returns 1 when the completion replaced the in-progress record, 0 when the lease no longer
holds it (absent, completed, or held by another token): then nothing was changed.
A call sent again also gets 1 when the record already holds this completion (the same
record but for its expiry, which a call sent again may put a second later): the first send
did it and only its reply was lost.
Errors: "IDEM_CORRUPT <why>" when the stored value is not a record; nothing is written.

Mode 'w' is the common path, for a lease that carries its request's fingerprint (the store
set it at begin): one GETRANGE of the record's first 17 bytes, compared with ARGV[1] (one
string comparison decides that the record is in progress under this token), then the SET.
It runs before the prelude (the store places prelude.lua at the `--@prelude` line below),
so that on one server it returns before the prelude's three functions are made (2.8 µs a
call against 2.95, measured alone on 100,000 records). Every other case goes through
prelude.lua's lease_head, which reads the 59 bytes of an in-progress record. All checks
come before the only write.

On Redis Cluster, publishes an empty message on the shard channel named like KEYS[1] after
a write, when that channel has subscribers (waiters for the record): nothing is published
otherwise (prelude.lua's wake). On one server the script publishes nothing: the store sends
a plain `PUBSUB NUMSUB KEYS[1]` right behind it in the same round trip and publishes itself
when it counts a subscriber (a redis.call costs the server about a microsecond; the plain
command a fifth of that). A waiter that subscribes after the count looks at the record
after subscribing, and finds it completed.

The shebang has no flags: Redis counts the script as a writer and refuses it with OOM,
before it runs, when the server is out of memory.
]]
local key, mode = KEYS[1], ARGV[4]
-- The common path first, before the prelude's functions are even made: a lease that carries
-- its fingerprint ('w') and still holds the record. On one server it ends here.
local written = mode == 'w' and redis.call('GETRANGE', key, 0, 16) == ARGV[1]
if written then
  -- ARGV[3] goes as the string it came as: tonumber() would make Redis format the number
  -- back into a string for SET (about 0.5 µs of its time a call, measured).
  redis.call('SET', key, ARGV[2], 'PX', ARGV[3])
  if not SHARDED then
    return 1
  end
end
--@prelude
if not written then
  local whole = mode == 'w' or mode == 'W'
  local head, state = lease_head(key, string.sub(ARGV[1], 2))
  if state == 'corrupt' then
    return redis.error_reply('IDEM_CORRUPT not a record')
  end
  if state == 'settled' and (mode == 'W' or mode == 'C') then
    local stored = redis.call('GET', key)
    -- The same completion, the expiry (bytes 34 to 37) aside.
    if whole and string.sub(stored, 1, 33) == string.sub(ARGV[2], 1, 33)
        and string.sub(stored, 38) == string.sub(ARGV[2], 38) then
      return 1
    end
    -- Past the carried-over attempt: one byte, or five after a 255.
    local rest = string.byte(stored, 38) == 255 and 43 or 39
    if not whole and string.sub(stored, 1, 1) == string.sub(ARGV[2], 1, 1)
        and string.sub(stored, rest) == string.sub(ARGV[2], 6) then
      return 1
    end
  end
  if state ~= 'held' then
    return 0
  end
  local record = ARGV[2]
  if not whole then
    -- Carry the fingerprint and attempt over from the in-progress record.
    local fingerprint, attempt = carried(head)
    record = string.sub(ARGV[2], 1, 1) .. fingerprint .. string.sub(ARGV[2], 2, 5) .. attempt
        .. string.sub(ARGV[2], 6)
  end
  redis.call('SET', key, record, 'PX', ARGV[3])
end
-- Wake the record's waiters on a cluster (prelude.lua), only if one subscribed; on one
-- server the store counts them behind the script.
if SHARDED then
  wake(key)
end
return 1
