--[[
prelude: what complete, release, extend and apply share, placed in front of each (after its
shebang line, or at its `--@prelude` line) when the store loads it
(crates/idem-redis/src/scripts.rs). Not a script of its own: it defines three functions and
touches no key but the caller's.

lease_head(key, token) reads the first 59 bytes of the record at `key` (a KEYS entry of the
calling script) and says what they hold for the lease whose fencing token is `token`:
  nil,  'absent'   no record
  head, 'settled'  a completed record ('C', 'Z' or 'H', or 'c', 'z' or 'h' of the previous
                   layout): no lease holds it
  head, 'held'     in progress ('P') under `token`: the lease still holds the record
  head, 'other'    in progress under another token (a takeover, a new incarnation, or a
                   lease of the previous layout 'p', which no lease of this one can hold)
  head, 'corrupt'  not a record: the caller answers IDEM_CORRUPT and writes nothing
The layout is in crates/idem-redis/src/codec.rs: an in-progress record is the tag, the
token [2..17], the margin [18..23], the fingerprint [24..55] and the attempt [56..59]
(1-based, as string.sub counts); a completed one is the tag, the fingerprint, the expiry
(u32 Unix seconds), the attempt (one byte under 255, else 255 and the u32), the metadata
and the body.

carried(head) is what a completion carries over from the in-progress record `head` (a
'held' one): its fingerprint, and its attempt in a completed record's form.

wake(key) tells the waiters of the record at `key` (crates/idem-redis/src/notify.rs) that
it changed: an empty message on the channel named like `key`, published only when that
channel has subscribers, so a write nobody waits for sends and replicates nothing. One
server's waiters subscribe with SUBSCRIBE (PUBSUB NUMSUB, PUBLISH); a cluster's with
SSUBSCRIBE on the primary that owns the key's slot (PUBSUB SHARDNUMSUB, SPUBLISH: the
channel hashes to the key's slot, where NUMSUB would miss its subscribers and a PUBLISH
would be broadcast to every node). `SHARDED`, a local the store places in front of this
prelude (scripts.rs), says which: one count per write, not both.
]]
local function lease_head(key, token)
  local head = redis.call('GETRANGE', key, 0, 58)
  if head == '' then
    return nil, 'absent'
  end
  local tag = string.sub(head, 1, 1)
  if string.find('CZHczh', tag, 1, true) then
    return head, 'settled'
  end
  if (tag ~= 'P' and tag ~= 'p') or string.len(head) ~= 59 then
    return head, 'corrupt'
  end
  if tag == 'P' and string.sub(head, 2, 17) == token then
    return head, 'held'
  end
  return head, 'other'
end

local function carried(head)
  local attempt = struct.unpack('>I4', head, 56)
  if attempt < 255 then
    return string.sub(head, 24, 55), string.char(attempt)
  end
  return string.sub(head, 24, 55), '\255' .. string.sub(head, 56, 59)
end

local function wake(key)
  if SHARDED then
    if redis.call('PUBSUB', 'SHARDNUMSUB', key)[2] > 0 then
      redis.call('SPUBLISH', key, '')
    end
  elseif redis.call('PUBSUB', 'NUMSUB', key)[2] > 0 then
    redis.call('PUBLISH', key, '')
  end
end
