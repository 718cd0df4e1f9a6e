-- get: read a record for inspection.
--
-- $1 scope (bytea), $2 key (text).
--
-- Returns the record unless it is absent or expired: fingerprint, attempt, token, lease_us
-- (lease time left in microseconds, NULL once completed), expires_us, meta, body.
SELECT
    r.fingerprint,
    r.attempt,
    r.token,
    (extract(epoch FROM r.lease_until - clock.now) * 1000000)::bigint AS lease_us,
    (extract(epoch FROM r.expires_at - clock.now) * 1000000)::bigint AS expires_us,
    r.meta,
    r.body
FROM {records} AS r, (SELECT clock_timestamp() AS now) AS clock
WHERE r.scope = $1 AND r.key = $2 AND r.expires_at > clock.now
