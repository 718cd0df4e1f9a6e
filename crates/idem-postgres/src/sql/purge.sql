-- purge: delete up to $1 expired records, the longest expired first.
--
-- $1 batch (bigint).
--
-- Affects the rows it deletes. The inner SELECT walks the expires_at index, so a
-- batch costs what it deletes, not the size of the table. SKIP LOCKED passes over rows that
-- a concurrent begin (taking an expired row over) or another purge holds: they are either
-- no longer expired or someone else's to delete. The outer condition re-checks expiry on
-- the row as locked.
DELETE FROM {records} AS r
WHERE (r.scope, r.key) IN (
        SELECT e.scope, e.key
        FROM {records} AS e
        WHERE e.expires_at <= clock_timestamp()
        ORDER BY e.expires_at
        LIMIT $1
        FOR UPDATE SKIP LOCKED
    )
  AND r.expires_at <= clock_timestamp()
