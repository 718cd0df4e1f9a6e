-- seen: the snapshot read begin.sql and claim.sql open with, spliced into both where they
-- name it (their headers say what it answers). Reads $1 scope, $2 key, $3 fingerprint, $4 token;
-- defines the CTEs `clock` (the database's clock, read once) and `seen`.
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
