-- begin: claim a key, take over an expired lease, or report the record as it stands.
--
-- $1 scope (bytea), $2 key (text), $3 fingerprint (bytea, 32 bytes), $4 token (uuid),
-- $5 lease (interval), $6 retention (interval: kept this long after the lease deadline).
--
-- Returns exactly one row, the record as this statement leaves it: fingerprint, attempt,
-- token, lease_us (lease time left in microseconds, NULL once completed), expires_us (time
-- until it is forgotten), meta and body (only for a completed record with fingerprint $3).
-- The caller classifies it: token = $4 means this request holds the lease (attempt 1:
-- acquired, else took over; a re-send with the same token lands here too); otherwise
-- another fingerprint is a mismatch, a NULL token a replay, and a live lease in flight.
--
-- Why ON CONFLICT DO UPDATE with no WHERE clause. Under READ COMMITTED, the loser of a race
-- on `ON CONFLICT DO NOTHING` gets no row back, and a read in the same statement uses the
-- statement's snapshot, taken before the winner committed, so it sees nothing either. DO
-- UPDATE instead waits for the winner, locks the row in its latest committed version and
-- always returns it. When the row must not change, every column is set to itself: a no-op
-- update that touches no indexed column, so it is a HOT update (the table's fillfactor
-- leaves room for it). The CASEs decide everything on that locked latest version, so the
-- insert-or-take-over decision is atomic against any number of concurrent callers.
--
-- The clock is the database's: clock_timestamp() read once, so every comparison and every
-- deadline in the statement uses the same instant, even inside a long caller transaction
-- (where now() would be the transaction's start).
WITH clock AS MATERIALIZED (SELECT clock_timestamp() AS now)
INSERT INTO {records} AS r (scope, key, fingerprint, attempt, token, lease_until, expires_at)
SELECT $1, $2, $3, 1, $4, clock.now + $5::interval, clock.now + $5::interval + $6::interval
FROM clock
ON CONFLICT (scope, key) DO UPDATE SET
    -- Past its expiry the record counts as absent: start afresh at attempt 1, whatever its
    -- fingerprint. An expired lease with the same fingerprint and another token: take over.
    -- Anything else: keep the row as it is.
    attempt = CASE
        WHEN r.expires_at <= (SELECT now FROM clock) THEN 1
        WHEN r.token <> excluded.token
             AND r.lease_until <= (SELECT now FROM clock)
             AND r.fingerprint = excluded.fingerprint THEN r.attempt + 1
        ELSE r.attempt END,
    fingerprint = CASE WHEN r.expires_at <= (SELECT now FROM clock) THEN excluded.fingerprint
                       ELSE r.fingerprint END,
    token = CASE
        WHEN r.expires_at <= (SELECT now FROM clock)
             OR (r.token <> excluded.token
                 AND r.lease_until <= (SELECT now FROM clock)
                 AND r.fingerprint = excluded.fingerprint) THEN excluded.token
        ELSE r.token END,
    lease_until = CASE
        WHEN r.expires_at <= (SELECT now FROM clock)
             OR (r.token <> excluded.token
                 AND r.lease_until <= (SELECT now FROM clock)
                 AND r.fingerprint = excluded.fingerprint) THEN excluded.lease_until
        ELSE r.lease_until END,
    expires_at = CASE
        WHEN r.expires_at <= (SELECT now FROM clock)
             OR (r.token <> excluded.token
                 AND r.lease_until <= (SELECT now FROM clock)
                 AND r.fingerprint = excluded.fingerprint) THEN excluded.expires_at
        ELSE r.expires_at END,
    -- A completed record is never replaced unless expired (its token is NULL, so the
    -- takeover test above is never true for it), so clearing meta and body only ever
    -- applies to a replaced row.
    meta = CASE WHEN r.expires_at <= (SELECT now FROM clock) THEN NULL ELSE r.meta END,
    body = CASE WHEN r.expires_at <= (SELECT now FROM clock) THEN NULL ELSE r.body END
RETURNING
    r.fingerprint,
    r.attempt,
    r.token,
    (extract(epoch FROM r.lease_until - (SELECT now FROM clock)) * 1000000)::bigint AS lease_us,
    (extract(epoch FROM r.expires_at - (SELECT now FROM clock)) * 1000000)::bigint AS expires_us,
    CASE WHEN r.token IS NULL AND r.fingerprint = $3 THEN r.meta END AS meta,
    CASE WHEN r.token IS NULL AND r.fingerprint = $3 THEN r.body END AS body
