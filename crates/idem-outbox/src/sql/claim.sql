-- claim: a batch of due rows for one relay, in its batch transaction.
--
-- $1 the batch size (bigint).
--
-- Returns up to $1 rows, the oldest due first: id, scope, key, fingerprint, token, attempt,
-- meta, body, tries, and ttl_ms (the completion's time left, by the database's clock, the
-- one that set expires_at). Rows another relay holds are skipped, not waited for (SKIP
-- LOCKED), so any number of relays share one outbox; the rows stay locked until the batch
-- commits or rolls back.
SELECT id, scope, key, fingerprint, token, attempt, meta, body, tries,
       floor(extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint AS ttl_ms
FROM {outbox}
WHERE NOT dead AND next_try_at <= clock_timestamp()
ORDER BY next_try_at, id
LIMIT $1
FOR UPDATE SKIP LOCKED
