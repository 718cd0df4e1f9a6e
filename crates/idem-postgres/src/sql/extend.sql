-- extend: move the lease deadline to $4 from now, and the expiry by as much as the deadline
-- moved (never backwards), so the margin after the deadline stays what begin set.
--
-- $1 scope (bytea), $2 key (text), $3 token (uuid), $4 by (interval).
--
-- Returns one row (attempt, lease_us: the lease time granted in microseconds) when the
-- record was in progress under $3 and not expired; none otherwise (the lease was lost, and
-- nothing changed). In SET, r.lease_until is the deadline before this update.
UPDATE {records} AS r
SET lease_until = clock.now + $4::interval,
    expires_at = r.expires_at
        + greatest(clock.now + $4::interval - r.lease_until, interval '0')
FROM (SELECT clock_timestamp() AS now) AS clock
WHERE r.scope = $1 AND r.key = $2 AND r.token = $3 AND r.expires_at > clock.now
RETURNING
    r.attempt,
    (extract(epoch FROM r.lease_until - clock.now) * 1000000)::bigint AS lease_us
