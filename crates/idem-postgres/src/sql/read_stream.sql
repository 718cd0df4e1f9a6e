-- read_stream: a record and, in progress, its holder's stream from byte $3.
--
-- $1 scope (bytea), $2 key (text), $3 from (bigint).
--
-- Returns the record unless it is absent or expired: token, lease_us (lease time left in
-- microseconds, NULL once completed), meta, body, and stream: the bytes the holder
-- appended from byte $3 on (empty when none; NULL once completed).
SELECT
    r.token,
    (extract(epoch FROM r.lease_until - clock.now) * 1000000)::bigint AS lease_us,
    r.meta,
    r.body,
    CASE WHEN r.token IS NOT NULL THEN coalesce(
        (SELECT string_agg(substring(s.bytes FROM (greatest($3 - s.at, 0) + 1)::integer),
                           ''::bytea ORDER BY s.at)
         FROM {streams} AS s
         WHERE s.scope = r.scope AND s.key = r.key AND s.token = r.token
           AND s.at + octet_length(s.bytes) > $3),
        ''::bytea)
    END AS stream
FROM {records} AS r, (SELECT clock_timestamp() AS now) AS clock
WHERE r.scope = $1 AND r.key = $2 AND r.expires_at > clock.now
