#!lua
--[[
apply: write a completion that was committed elsewhere (by the PostgreSQL arbiter of the
tiered store: the outbox relay, or a repair after the arbiter answered with a replay),
unless Redis holds a state that must win.

KEYS[1]  the record's key
ARGV[1]  the fencing token of the lease that completed, 16 bytes
ARGV[2]  the completed record's tag: 'c' (raw body), 'z' (LZ4 body) or 'h' (body dropped)
ARGV[3]  the request's fingerprint, 32 bytes, or '' when the caller does not have it at hand
ARGV[4]  the attempt that completed, 4 bytes, big-endian, or '' with ARGV[3]
ARGV[5]  the completion's metadata, as complete.lua's ARGV[3]
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
local identity = ARGV[3] .. ARGV[4]
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
  identity = string.sub(head, 24, 59)
end
redis.call('SET', key, ARGV[2] .. identity .. ARGV[5] .. ARGV[6], 'PX', tonumber(ARGV[7]))
-- Wake the record's waiters (prelude.lua), only if one subscribed.
wake(key)
return 1
