-- release: end the lease and forget the record, so the next begin is attempt 1 again.
--
-- $1 scope (bytea), $2 key (text), $3 token (uuid),
-- $4 notification payload (text, or NULL to notify nobody).
--
-- Affects one row when the record was in progress under $3 and not expired; none otherwise
-- (the lease was lost, and nothing changed).
DELETE FROM {records} AS r
WHERE r.scope = $1 AND r.key = $2 AND r.token = $3 AND r.expires_at > clock_timestamp()
-- Waiters (crates/idem-postgres/src/notify.rs): for the changed row only, sent on commit.
RETURNING (SELECT pg_notify('idem_settled', $4) WHERE $4 IS NOT NULL) IS NULL AS silent
