-- complete: store the outcome and end the lease, if the lease still holds the record.
--
-- $1 scope (bytea), $2 key (text), $3 token (uuid), $4 meta (bytea, idem_core::encode_meta),
-- $5 body (bytea), $6 retention (interval),
-- $7 the record's notification payload (text, crates/idem-postgres/src/notify.rs).
--
-- Affects one row when the record was in progress under $3 and not expired; none otherwise
-- (the lease was lost, and nothing changed). The guard on the token is evaluated on the
-- row's latest committed version (READ COMMITTED re-checks it after waiting for a
-- concurrent writer), so a worker whose lease was taken over never overwrites the new
-- holder, and a key completed by another transaction is never completed again.
UPDATE {records} AS r
SET token = NULL,
    lease_until = NULL,
    meta = $4,
    body = $5,
    expires_at = clock.now + $6::interval
FROM (SELECT clock_timestamp() AS now) AS clock
WHERE r.scope = $1 AND r.key = $2 AND r.token = $3 AND r.expires_at > clock.now
-- Waiters (crates/idem-postgres/src/notify.rs): for the changed row only, sent on commit, and
-- only when a waiter holds the record's shared advisory lock (1768187245 is LOCK_CLASS), so
-- that this exclusive try fails. Nobody waiting: one lock taken and freed in memory.
RETURNING (SELECT pg_notify('idem_settled', $7)
           WHERE NOT pg_try_advisory_xact_lock(1768187245, hashtext($7))) IS NULL AS silent
