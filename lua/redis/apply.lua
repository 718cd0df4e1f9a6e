#!lua
--[[
apply: write a completion that was committed elsewhere (by the PostgreSQL arbiter of the
tiered store: the outbox relay, or a repair after the arbiter answered with a replay),
unless Redis holds a state that must win.

KEYS[1]  the record's key
ARGV[1]  the fencing token of the lease that completed, 16 bytes
ARGV[2]  the completed record's tag ('C' raw body, 'Z' LZ4 body, 'H' body dropped), then its
         expiry (u32 Unix seconds): 5 bytes
ARGV[3]  the request's fingerprint, 32 bytes, or '' when the caller does not have it at hand
ARGV[4]  the attempt that completed, in a completed record's form (one byte under 255, else
         255 and the u32), or '' with ARGV[3]
ARGV[5]  the completion's metadata (crates/idem-redis/src/codec.rs)
ARGV[6]  the body as stored
ARGV[7]  how long the completed record is kept, in milliseconds (>= 1)

Returns
  1  written: the key was absent, or in progress under ARGV[1] (the completing lease)
  2  left alone: the key is already completed (this completion, applied before, or one the
     key completed with since; a completion is never overwritten)
  4  left alone: the key is absent and ARGV[3] is '': call again with the fingerprint
  3  left alone: another lease holds the key in Redis. It cannot complete the key for good:
     its holder must pass the arbiter first, which answers with this completion; or it is a
     later incarnation of the key, which must not be overwritten by an older completion.
Errors: "IDEM_CORRUPT <why>" when the stored value is not a record; nothing is written.

Publishes an empty message on the channel (or shard channel) named like KEYS[1] after a
write, when that channel has subscribers (waiters for the record): nothing is published
otherwise (prelude.lua's wake).

Over the completing lease's own in-progress record, the fingerprint and attempt are carried
over from it (as complete.lua does), so the common case after a commit needs no lookup.
Applying twice is applying once (the second run answers 2), so the relay may deliver at
least once. Only the first 59 bytes of an existing record are read; all checks come before
the only write.

The shebang has no flags: a writer, refused under OOM before it runs.
]]
local key = KEYS[1]
local head, state = lease_head(key, ARGV[1])
local fingerprint, attempt = ARGV[3], ARGV[4]
if state == 'corrupt' then
  return redis.error_reply('IDEM_CORRUPT not a record')
elseif state == 'absent' then
  if ARGV[3] == '' then
    return 4
  end
elseif state == 'settled' then
  return 2
elseif state == 'other' then
  return 3
else
  fingerprint, attempt = carried(head)
end
local record = string.sub(ARGV[2], 1, 1) .. fingerprint .. string.sub(ARGV[2], 2, 5) .. attempt
  .. ARGV[5] .. ARGV[6]
redis.call('SET', key, record, 'PX', tonumber(ARGV[7]))
-- Wake the record's waiters (prelude.lua), only if one subscribed.
wake(key)
return 1
