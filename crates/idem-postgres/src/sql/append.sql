-- append: write $5 at byte $4 of the stream of the record in progress under $3.
--
-- $1 scope (bytea), $2 key (text), $3 token (uuid), $4 at (bigint), $5 bytes (bytea),
-- $6 the record's notification payload (text, crates/idem-postgres/src/notify.rs).
--
-- Returns one row: held (whether the record is in progress under $3 and not expired), len
-- (the stream's length before), silent. The bytes are written only when held and $4 is at
-- most len; the same bytes at the same offset again (a call sent again) conflict and change
-- nothing. Readers read only the rows of the token the record holds, so no check needs a
-- lock: a takeover right after this statement leaves these rows unread.
WITH held AS (
    SELECT 1
    FROM {records} AS r
    WHERE r.scope = $1 AND r.key = $2 AND r.token = $3 AND r.expires_at > clock_timestamp()
), stream AS (
    SELECT coalesce(max(s.at + octet_length(s.bytes)), 0) AS len
    FROM {streams} AS s
    WHERE s.scope = $1 AND s.key = $2 AND s.token = $3
), written AS (
    INSERT INTO {streams} (scope, key, token, at, bytes)
    SELECT $1, $2, $3, $4, $5
    WHERE EXISTS (SELECT 1 FROM held) AND $4 <= (SELECT len FROM stream)
    ON CONFLICT DO NOTHING
)
SELECT
    EXISTS (SELECT 1 FROM held) AS held,
    (SELECT len FROM stream) AS len,
    -- Readers waiting for more (crates/idem-postgres/src/notify.rs), as complete.sql wakes
    -- waiters: only when one holds the record's shared advisory lock (1768187245 is
    -- LOCK_CLASS).
    (SELECT pg_notify('idem_settled', $6)
     WHERE EXISTS (SELECT 1 FROM held)
       AND NOT pg_try_advisory_xact_lock(1768187245, hashtext($6))) IS NULL AS silent
