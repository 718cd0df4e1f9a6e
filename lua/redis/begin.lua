#!lua
--[[
begin: claim a key for one attempt, or say why not. One atomic step.

KEYS[1]  the record's key (one string value; layout in crates/idem-redis/src/codec.rs)
ARGV[1]  the request's fingerprint, 32 bytes
ARGV[2]  the attempt's fencing token, 16 bytes
ARGV[3]  the lease, in milliseconds (>= 1)
ARGV[4]  how long the record is kept after its lease deadline, in milliseconds (>= 0)

Returns an array whose first element says what happened:
  {1, attempt, lease_ms}  the caller holds the lease: a fresh record (attempt 1), a takeover
                          of an expired lease (attempt + 1), or the caller's own lease handed
                          back when the same token is sent again (lease_ms is what is left)
  {2, pttl_ms, record}    the key is completed: the stored record, and its time to live
  {3, retry_after_ms}     another token holds a live lease
  {4}                     the record was made by a request with another fingerprint
Errors: "IDEM_CORRUPT <why>" when the stored value is not a record; nothing is written.

Deadlines are read from the server's clock (TIME), never from the caller's. Everything is
read and checked before the only write (a SET), so an error never leaves half a change.

The shebang has no flags: Redis counts the script as a writer and refuses it with OOM,
before it runs, when the server is out of memory.
]]
local key = KEYS[1]
local fingerprint, token = ARGV[1], ARGV[2]
local lease, retention = tonumber(ARGV[3]), tonumber(ARGV[4])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local record = redis.call('GET', key)
if not record then
  redis.call('SET', key,
    'p' .. fingerprint .. struct.pack('>I4', 1) .. token .. struct.pack('>I6', now + lease),
    'PX', lease + retention)
  return {1, 1, lease}
end

local tag = string.sub(record, 1, 1)
if string.len(record) < 37 then
  return redis.error_reply('IDEM_CORRUPT record of ' .. string.len(record) .. ' bytes')
end
if tag ~= 'p' and tag ~= 'c' and tag ~= 'z' and tag ~= 'h' then
  return redis.error_reply('IDEM_CORRUPT unknown record tag')
end
if string.sub(record, 2, 33) ~= fingerprint then
  return {4}
end
if tag ~= 'p' then
  return {2, redis.call('PTTL', key), record}
end
if string.len(record) ~= 59 then
  return redis.error_reply('IDEM_CORRUPT in-progress record of ' .. string.len(record) .. ' bytes')
end

local attempt = struct.unpack('>I4', record, 34)
local deadline = struct.unpack('>I6', record, 54)
if string.sub(record, 38, 53) == token then
  -- The same attempt asking again (its reply was lost): hand its own lease back.
  return {1, attempt, math.max(0, deadline - now)}
end
if deadline > now then
  return {3, deadline - now}
end
-- The holder's lease expired: take it over with a new token and count the attempt.
if attempt < 4294967295 then
  attempt = attempt + 1
end
redis.call('SET', key,
  'p' .. fingerprint .. struct.pack('>I4', attempt) .. token .. struct.pack('>I6', now + lease),
  'PX', lease + retention)
return {1, attempt, lease}
