#!lua flags=no-writes
--[[
get: read a record for inspection, with its time to live and the server's clock, in one
atomic step. Writes nothing.

KEYS[1]  the record's key

Returns {} when the record is absent (or expired), else {record, pttl_ms, now_ms}: the
stored value, its time to live and the server's clock in Unix milliseconds (so the caller
can tell how much of an in-progress lease is left).

`no-writes`: Redis refuses any write the script might try, and runs it under OOM.
]]
local record = redis.call('GET', KEYS[1])
if not record then
  return {}
end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
return {record, redis.call('PTTL', KEYS[1]), now}
