-- claim: begin's first statement, which answers every call but the rare ones without taking
-- a lock or building begin.sql's plan.
--
-- $1 scope (bytea), $2 key (text), $3 fingerprint (bytea, 32 bytes), $4 token (uuid),
-- $5 lease (interval), $6 retention (interval), as begin.sql.
--
-- Returns begin.sql's row, or no row:
--
-- * `seen` is begin.sql's own snapshot read: a record that needs no change (completed and
--   live, in flight under a live lease, held by this very token, created by another
--   request) is the answer, and nothing is written or locked.
-- * `claimed` inserts the record in progress under $4 when the snapshot holds no record of
--   the key at all: a new key, the common case, is one plain insert.
-- * No row: the snapshot holds a record that needs a change (past its expiry, or a lease to
--   take over), or a concurrent caller inserted the key after the snapshot was taken (ON
--   CONFLICT DO NOTHING, at READ COMMITTED, then returns nothing). The caller sends
--   begin.sql, which decides on the row's latest committed version, under its lock.
--
-- The NOT EXISTS keeps the insert from ever meeting a row the snapshot holds: ON CONFLICT's
-- check alone would wait for a transaction holding that row (a completion written by
-- complete_in and not yet committed) to end, where `seen` answers at once.
{seen}claimed AS (
    INSERT INTO {records} AS r (scope, key, fingerprint, attempt, token, lease_until, expires_at)
    SELECT $1, $2, $3, 1, $4, clock.now + $5::interval, clock.now + $5::interval + $6::interval
    FROM clock
    WHERE NOT EXISTS (SELECT FROM {records} AS s WHERE s.scope = $1 AND s.key = $2)
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING r.fingerprint, r.attempt, r.token, r.lease_until, r.expires_at, r.meta, r.body
)
{answer}
