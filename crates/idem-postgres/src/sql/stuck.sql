-- stuck: list in-progress records whose lease expired longer ago than $2 and that no retry
-- took over, the longest expired first (an operator's tool; reads, never writes).
--
-- $1 scope (bytea, NULL for every scope), $2 stuck_after (interval), $3 limit (bigint).
--
-- Returns up to $3 rows: scope (bytea), key (text), attempt (integer), expired_us (bigint,
-- how long ago the lease expired, by the database clock). Expired records are left out:
-- they behave as absent.
WITH clock AS MATERIALIZED (SELECT clock_timestamp() AS now)
SELECT
    r.scope,
    r.key,
    r.attempt,
    (extract(epoch FROM clock.now - r.lease_until) * 1000000)::bigint AS expired_us
FROM {records} AS r, clock
WHERE r.token IS NOT NULL
  AND clock.now - r.lease_until > $2::interval
  AND r.expires_at > clock.now
  AND ($1::bytea IS NULL OR r.scope = $1::bytea)
ORDER BY r.lease_until
LIMIT $3
