-- answer: the row begin.sql and claim.sql return, spliced into both where they name it
-- (their headers say what its columns mean), from the CTEs `seen`, `claimed` and `clock`; $3 the
-- fingerprint.
SELECT
    rec.fingerprint,
    rec.attempt,
    rec.token,
    -- Time left is measured when the answer leaves, not at the statement's start: the
    -- statement may have waited on the holder's row lock, and the holder's deadline was set
    -- from a clock read after ours, so measuring from `clock.now` could report more time left
    -- than the holder's whole lease.
    (extract(epoch FROM rec.lease_until - clock_timestamp()) * 1000000)::bigint AS lease_us,
    (extract(epoch FROM rec.expires_at - clock_timestamp()) * 1000000)::bigint AS expires_us,
    -- How long the statement ran before answering (waits on row locks included): the caller
    -- counts the time left from its send time plus this, a sound and tight lower bound.
    (extract(epoch FROM clock_timestamp() - clock.now) * 1000000)::bigint AS waited_us,
    CASE WHEN rec.token IS NULL AND rec.fingerprint = $3 THEN rec.meta END AS meta,
    CASE WHEN rec.token IS NULL AND rec.fingerprint = $3 THEN rec.body END AS body
FROM (SELECT * FROM seen UNION ALL SELECT * FROM claimed) AS rec, clock
