-- evict: forget a key's outbox rows (an operator evicting the key), before its record goes,
-- so that the relay cannot write an evicted completion back into Redis.
--
-- $1 scope (bytea), $2 key (text). Affects the key's rows, dead ones included.
DELETE FROM {outbox} WHERE scope = $1 AND key = $2
