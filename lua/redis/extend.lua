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

The deadline is the key's expiry (PTTL, the server's clock) minus the record's margin.
A deadline moved forward moves the expiry by as much (PEXPIRE to by + margin), so the
margin kept after the deadline stays what begin set; a deadline moved back keeps the expiry
and widens the margin instead (6 bytes rewritten in place). All checks come before the
first write.

`allow-oom`: an extend grows nothing, so heartbeats keep leases alive even when the server
is out of memory.
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
local ttl = redis.call('PTTL', key)
if ttl < 0 then
  return redis.error_reply('IDEM_CORRUPT in-progress record without an expiry')
end
local margin = struct.unpack('>I6', head, 18)
if by >= ttl - margin then
  redis.call('PEXPIRE', key, by + margin)
else
  redis.call('SETRANGE', key, 17, struct.pack('>I6', ttl - by))
end
return {1, struct.unpack('>I4', head, 56), by}
