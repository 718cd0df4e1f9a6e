#!lua
--[[
set_if: SET .. IFEQ .. GET for servers without it (Redis before 8.4, Valkey before 8.1):
replace the value at KEYS[1] when it is exactly the one expected. It completes a lease,
takes an expired one over, or applies a completion (crates/idem-redis/src/transitions.rs).

KEYS[1]  the record's key
ARGV[1]  the value expected at KEYS[1]
ARGV[2]  the value to write
ARGV[3]  its time to live, in milliseconds (>= 1)
ARGV[4]  'NUMSUB' or 'SHARDNUMSUB' to wake the record's waiters after the write (an empty
         message on the channel, or shard channel, named like KEYS[1], sent only when it has
         subscribers), or '' for none

Returns the value KEYS[1] held (nil when absent): ARGV[1] when the write was made.

The shebang has no flags: a writer, refused under OOM before it runs.
]]
local old = redis.call('GET', KEYS[1])
if old == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  if ARGV[4] ~= '' and redis.call('PUBSUB', ARGV[4], KEYS[1])[2] > 0 then
    redis.call(ARGV[4] == 'NUMSUB' and 'PUBLISH' or 'SPUBLISH', KEYS[1], '')
  end
end
return old
