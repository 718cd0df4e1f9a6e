#!lua flags=allow-oom
--[[
end_if: DELIFEQ, or a compare-and-expire, for servers without the commands: when the value
at KEYS[1] is exactly the one expected, delete it (a release) or give it a new time to live
and leave it as it is (a heartbeat) (crates/idem-redis/src/transitions.rs).

KEYS[1]  the record's key
ARGV[1]  the value expected at KEYS[1]
ARGV[2]  '0' to delete, else the new time to live in milliseconds
ARGV[3]  'NUMSUB' or 'SHARDNUMSUB' to wake the record's waiters after a delete (as in
         set_if.lua), or '' for none

Returns the value KEYS[1] held (nil when absent): ARGV[1] when it was deleted or expired.

`allow-oom`: it grows nothing, so releases and heartbeats work when the server is full.
]]
local old = redis.call('GET', KEYS[1])
if old == ARGV[1] then
  if ARGV[2] ~= '0' then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  else
    redis.call('DEL', KEYS[1])
    if ARGV[3] ~= '' and redis.call('PUBSUB', ARGV[3], KEYS[1])[2] > 0 then
      redis.call(ARGV[3] == 'NUMSUB' and 'PUBLISH' or 'SPUBLISH', KEYS[1], '')
    end
  end
end
return old
