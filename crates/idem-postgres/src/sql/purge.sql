-- purge: delete up to $1 expired records, the longest expired first.
--
-- $1 batch (bigint).
--
-- Affects the rows it deletes, and costs what it deletes, not the size of the table or of
-- the backlog:
-- * the inner SELECT walks the expires_at index from its start and stops at the clock. The
--   clock is read once into `clock`: a volatile clock_timestamp() in the WHERE clause could
--   only filter rows, not bound the index scan.
-- * SKIP LOCKED passes over rows that a concurrent begin (taking an expired row over) or
--   another purge holds: they are either no longer expired or someone else's to delete.
-- * the DELETE finds the chosen rows by ctid (a TID scan), whatever plan the outer query
--   would otherwise pick. The ctids are stable: the rows stay locked by this statement
--   until it ends. The outer condition re-checks expiry on the rows as locked.
WITH clock AS MATERIALIZED (SELECT clock_timestamp() AS now)
DELETE FROM {records} AS r
WHERE r.ctid = ANY (ARRAY(
        SELECT e.ctid
        FROM {records} AS e
        WHERE e.expires_at <= (SELECT now FROM clock)
        ORDER BY e.expires_at
        LIMIT $1
        FOR UPDATE SKIP LOCKED
    ))
  AND r.expires_at <= (SELECT now FROM clock)
