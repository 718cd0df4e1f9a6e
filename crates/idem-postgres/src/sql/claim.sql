-- claim: begin's first statement, which answers every call but the rare ones without taking
-- a lock or building begin.sql's plan.
--
-- $1 scope (bytea), $2 key (text), $3 fingerprint (bytea, 32 bytes), $4 token (uuid),
-- $5 lease (interval), $6 retention (interval), as begin.sql.
--
-- Returns begin.sql's row, or no row:
--
-- * `seen` is begin.sql's own snapshot read: a record that needs no change (completed and
--   live, in flight under a live lease, held by this very token, created by another
--   request) is the answer, and nothing is written or locked.
-- * `claimed` inserts the record in progress under $4 when the snapshot holds no record of
--   the key at all: a new key, the common case, is one plain insert.
-- * No row: the snapshot holds a record that needs a change (past its expiry, or a lease to
--   take over), or a concurrent caller inserted the key after the snapshot was taken (ON
--   CONFLICT DO NOTHING, at READ COMMITTED, then returns nothing). The caller sends
--   begin.sql, which decides on the row's latest committed version, under its lock.
--
-- The NOT EXISTS keeps the insert from ever meeting a row the snapshot holds: ON CONFLICT's
-- check alone would wait for a transaction holding that row (a completion written by
-- complete_in and not yet committed) to end, where `seen` answers at once.
WITH clock AS MATERIALIZED (SELECT clock_timestamp() AS now),
seen AS (
    SELECT r.fingerprint, r.attempt, r.token, r.lease_until, r.expires_at, r.meta, r.body
    FROM {records} AS r, clock
    WHERE r.scope = $1 AND r.key = $2 AND r.expires_at > clock.now
      AND (r.token IS NULL              -- completed
           OR r.token = $4              -- this very attempt, sent again
           OR r.lease_until > clock.now -- in flight
           OR r.fingerprint <> $3)      -- another request: a mismatch
),
claimed AS (
    INSERT INTO {records} AS r (scope, key, fingerprint, attempt, token, lease_until, expires_at)
    SELECT $1, $2, $3, 1, $4, clock.now + $5::interval, clock.now + $5::interval + $6::interval
    FROM clock
    WHERE NOT EXISTS (SELECT FROM {records} AS s WHERE s.scope = $1 AND s.key = $2)
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING r.fingerprint, r.attempt, r.token, r.lease_until, r.expires_at, r.meta, r.body
)
-- The columns and their meaning are begin.sql's.
SELECT
    rec.fingerprint,
    rec.attempt,
    rec.token,
    (extract(epoch FROM rec.lease_until - clock_timestamp()) * 1000000)::bigint AS lease_us,
    (extract(epoch FROM rec.expires_at - clock_timestamp()) * 1000000)::bigint AS expires_us,
    (extract(epoch FROM clock_timestamp() - clock.now) * 1000000)::bigint AS waited_us,
    CASE WHEN rec.token IS NULL AND rec.fingerprint = $3 THEN rec.meta END AS meta,
    CASE WHEN rec.token IS NULL AND rec.fingerprint = $3 THEN rec.body END AS body
FROM (SELECT * FROM seen UNION ALL SELECT * FROM claimed) AS rec, clock
