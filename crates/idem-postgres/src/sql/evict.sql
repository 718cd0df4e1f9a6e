-- evict: delete a record whatever its state (an operator's tool).
--
-- $1 scope (bytea), $2 key (text).
--
-- Returns the deleted row's liveness (live: whether it had not expired yet); no row when
-- there was none.
DELETE FROM {records} AS r
WHERE r.scope = $1 AND r.key = $2
RETURNING r.expires_at > clock_timestamp() AS live
