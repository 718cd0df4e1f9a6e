--[[
prelude: what complete, release, extend and apply share, placed in front of each (after its
shebang line) when the store loads it (crates/idem-redis/src/scripts.rs). Not a script of
its own: it defines one function and touches no key.

lease_head(key, token) reads the first 59 bytes of the record at `key` (a KEYS entry of the
calling script) and says what they hold for the lease whose fencing token is `token`:
  nil,  'absent'   no record
  head, 'settled'  a completed record ('c', 'z' or 'h'): no lease holds it
  head, 'held'     in progress under `token`: the lease still holds the record
  head, 'other'    in progress under another token (a takeover, or a new incarnation)
  head, 'corrupt'  not a record: the caller answers IDEM_CORRUPT and writes nothing
The layout is in crates/idem-redis/src/codec.rs.
]]
local function lease_head(key, token)
  local head = redis.call('GETRANGE', key, 0, 58)
  if head == '' then
    return nil, 'absent'
  end
  local tag = string.sub(head, 1, 1)
  if tag == 'c' or tag == 'z' or tag == 'h' then
    return head, 'settled'
  end
  if tag ~= 'p' or string.len(head) ~= 59 then
    return head, 'corrupt'
  end
  if string.sub(head, 38, 53) == token then
    return head, 'held'
  end
  return head, 'other'
end
