-- purge_streams: delete up to $1 rows of streams whose token no longer holds an unexpired
-- record in progress (completed, released, taken over, evicted or expired).
--
-- $1 batch (bigint).
--
-- Affects the rows it deletes. The streams table holds only recent streams, so the inner
-- SELECT's walk is short; SKIP LOCKED passes over rows another purge holds.
DELETE FROM {streams} AS s
WHERE s.ctid = ANY (ARRAY(
        SELECT t.ctid
        FROM {streams} AS t
        WHERE NOT EXISTS (
            SELECT 1
            FROM {records} AS r
            WHERE r.scope = t.scope AND r.key = t.key AND r.token = t.token
              AND r.expires_at > clock_timestamp()
        )
        LIMIT $1
        FOR UPDATE SKIP LOCKED
    ))
