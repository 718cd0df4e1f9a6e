#!lua
--[[
begin: claim a key for one attempt, or say why not. One atomic step.

The store's common cases never run this script: its fast path is one plain
`SET key <in-progress record> NX GET PX <lease + retention>`, which acquires an absent key,
or hands back a completed record (a replay: the record carries its expiry) or a record of
another fingerprint (a mismatch). Only when that answer shows a record in progress is this
script sent, since its lease deadline needs the server's clock (the key's PTTL minus the
record's margin) and a takeover a compare in one step. It decides every case itself, as
the state may have changed since.

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

An in-progress record ('P') holds no clock reading: its lease deadline is its expiry (the
key's PTTL, by the server's clock) minus its margin (ARGV[4] of the begin that wrote it).
A record of the previous layout ('p', written by an older idem) holds an absolute deadline,
read against TIME. Everything is read and checked before the only write (a SET), so an
error never leaves half a change.

The shebang has no flags: Redis counts the script as a writer and refuses it with OOM,
before it runs, when the server is out of memory.
]]
local key = KEYS[1]
local fingerprint, token = ARGV[1], ARGV[2]
local lease, retention = tonumber(ARGV[3]), tonumber(ARGV[4])
local function in_progress(attempt)
  return 'P' .. token .. struct.pack('>I6', retention) .. fingerprint .. struct.pack('>I4', attempt)
end

local record = redis.call('GET', key)
if not record then
  redis.call('SET', key, in_progress(1), 'PX', lease + retention)
  return {1, 1, lease}
end

local tag = string.sub(record, 1, 1)
local fp, holder, attempt, left
if tag == 'P' and string.len(record) == 59 then
  -- tag, token, margin (u48), fingerprint, attempt (u32)
  fp, holder = string.sub(record, 24, 55), string.sub(record, 2, 17)
  attempt = struct.unpack('>I4', record, 56)
  local pttl = redis.call('PTTL', key)
  if pttl < 0 then
    return redis.error_reply('IDEM_CORRUPT in-progress record without an expiry')
  end
  left = pttl - struct.unpack('>I6', record, 18)
elseif tag == 'p' and string.len(record) == 59 then
  -- The previous layout: tag, fingerprint, attempt, token, absolute deadline (u48 ms).
  fp, holder = string.sub(record, 2, 33), string.sub(record, 38, 53)
  attempt = struct.unpack('>I4', record, 34)
  local time = redis.call('TIME')
  local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  left = struct.unpack('>I6', record, 54) - now
elseif (string.find('CZH', tag, 1, true) and string.len(record) >= 38)
    or (string.find('czh', tag, 1, true) and string.len(record) >= 37) then
  if string.sub(record, 2, 33) ~= fingerprint then
    return {4}
  end
  return {2, redis.call('PTTL', key), record}
else
  return redis.error_reply('IDEM_CORRUPT not a record (' .. string.len(record) .. ' bytes)')
end

if fp ~= fingerprint then
  return {4}
end
if holder == token then
  -- The same attempt asking again (its reply was lost): hand its own lease back.
  return {1, attempt, math.max(0, left)}
end
if left > 0 then
  return {3, left}
end
-- The holder's lease expired: take it over with a new token and count the attempt.
if attempt < 4294967295 then
  attempt = attempt + 1
end
redis.call('SET', key, in_progress(attempt), 'PX', lease + retention)
return {1, attempt, lease}
