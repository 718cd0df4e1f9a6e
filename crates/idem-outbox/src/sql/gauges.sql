-- gauges: the outbox at a glance, for metrics and operators. Takes no parameter.
--
-- Returns one row: backlog (rows waiting, bigint), dead (dead rows, bigint), lag (age in
-- seconds of the oldest waiting row, float8; 0 when none). One scan of the outbox.
SELECT count(*) FILTER (WHERE NOT dead) AS backlog,
       count(*) FILTER (WHERE dead) AS dead,
       COALESCE(extract(epoch FROM clock_timestamp()
           - min(created_at) FILTER (WHERE NOT dead)), 0)::float8 AS lag
FROM {outbox}
