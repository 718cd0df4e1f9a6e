-- release: end the lease and forget the record, so the next begin is attempt 1 again.
--
-- $1 scope (bytea), $2 key (text), $3 token (uuid),
-- $4 the record's notification payload (text, crates/idem-postgres/src/notify.rs).
--
-- Affects one row when the record was in progress under $3 and not expired; none otherwise
-- (the lease was lost, and nothing changed).
DELETE FROM {records} AS r
WHERE r.scope = $1 AND r.key = $2 AND r.token = $3 AND r.expires_at > clock_timestamp()
-- Waiters (crates/idem-postgres/src/notify.rs): for the changed row only, sent on commit, and
-- only when a waiter holds the record's shared advisory lock (1768187245 is LOCK_CLASS), so
-- that this exclusive try fails. Nobody waiting: one lock taken and freed in memory.
RETURNING (SELECT pg_notify('idem_settled', $4)
           WHERE NOT pg_try_advisory_xact_lock(1768187245, hashtext($4))) IS NULL AS silent
