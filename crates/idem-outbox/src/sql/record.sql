-- record: the outbox row of a completion, in the business transaction that completed it.
--
-- $1 scope (bytea), $2 key (text), $3 the completing lease's token (uuid),
-- $4 the NOTIFY channel (text), $5 the schema (text, the notification's payload).
--
-- Copies the completed record this transaction just wrote (it sees its own write), so the
-- body is not encoded twice and the expiry is the database's. Affects one row; none means
-- the record is not completed in this transaction (the caller reports it). The pg_notify
-- wakes the relays of this schema when the transaction commits, and never if it rolls back.
INSERT INTO {outbox} (scope, key, fingerprint, token, attempt, meta, body, expires_at)
SELECT r.scope, r.key, r.fingerprint, $3, r.attempt, r.meta, r.body, r.expires_at
FROM {records} AS r, (SELECT pg_notify($4, $5)) AS wake
WHERE r.scope = $1 AND r.key = $2 AND r.token IS NULL
