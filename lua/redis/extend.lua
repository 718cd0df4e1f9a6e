#!lua flags=allow-oom
--[[
extend: move a lease's deadline to `by` from now (a heartbeat), if the lease still holds
the record.

KEYS[1]  the record's key
ARGV[1]  the lease's fencing token, 16 bytes
ARGV[2]  by: the new lease time from now, in milliseconds (>= 1)

Returns {1, attempt, by_ms} when the deadline moved, {0} when the lease no longer holds the
record (absent, completed, or held by another token): then nothing was changed.
Errors: "IDEM_CORRUPT <why>" when the stored value is not a record; nothing is written.

The record's expiry moves forward by as much as the deadline moved forward, so the margin
kept after the deadline stays what begin set; it never moves back. The deadline is read
from the server's clock (TIME). All checks come before the first write.

`allow-oom`: an extend rewrites 6 bytes in place and moves an expiry, growing nothing,
so heartbeats keep leases alive even when the server is out of memory.
]]
local key = KEYS[1]
local by = tonumber(ARGV[2])
local head, state = lease_head(key, ARGV[1])
if state == 'corrupt' then
  return redis.error_reply('IDEM_CORRUPT not a record')
end
if state ~= 'held' then
  return {0}
end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local attempt = struct.unpack('>I4', head, 34)
local deadline = struct.unpack('>I6', head, 54)
local ttl = redis.call('PTTL', key)
local new_deadline = now + by
local moved = math.max(0, new_deadline - deadline)

redis.call('SETRANGE', key, 53, struct.pack('>I6', new_deadline))
if ttl >= 0 and moved > 0 then
  redis.call('PEXPIRE', key, ttl + moved)
end
return {1, attempt, by}
