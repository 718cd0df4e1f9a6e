-- begin: claim a key, take over an expired lease, or report the record as it stands.
--
-- $1 scope (bytea), $2 key (text), $3 fingerprint (bytea, 32 bytes), $4 token (uuid),
-- $5 lease (interval), $6 retention (interval: kept this long after the lease deadline).
--
-- Returns exactly one row, the record as this statement leaves it: fingerprint, attempt,
-- token, lease_us (lease time left in microseconds, NULL once completed), waited_us (how long
-- the statement ran before answering), expires_us (time
-- until it is forgotten), meta and body (only for a completed record with fingerprint $3).
-- The caller classifies it: token = $4 means this request holds the lease (attempt 1:
-- acquired, else took over; a re-send with the same token lands here too); otherwise
-- another fingerprint is a mismatch, a NULL token a replay, and a live lease in flight.
--
-- Two branches, one statement:
--
-- * `seen` reads the record in the statement's snapshot. When it needs no change (completed
--   and live, in flight under a live lease, held by this very token, or created by another
--   request) it is the answer, and the INSERT inserts nothing (NOT EXISTS). Replays,
--   in-flight answers (including a waiter's polling) and mismatches therefore write nothing,
--   lock nothing and cannot conflict with the holder's complete under stricter isolation
--   levels. Answering from the snapshot is sound: the snapshot is taken after the call
--   began, and a later change (a completion, a release) is simply ordered after this call.
--
-- * Otherwise (no record in the snapshot, an expired record, or an expired lease to take
--   over), `claimed` runs INSERT ... ON CONFLICT DO UPDATE with no WHERE clause. Why not
--   ON CONFLICT DO NOTHING: under READ COMMITTED, the loser of a race gets no row back, and
--   a read in the same statement uses the statement's snapshot, taken before the winner
--   committed, so it sees nothing either. DO UPDATE instead waits for the winner, locks the
--   row in its latest committed version and always returns it. One decision (`step`) is taken on that
--   locked latest version: replace an expired record, take over an expired lease, or set
--   every column to itself (the row changed since the snapshot and needs nothing: a no-op
--   update that touches no indexed column, so a HOT update). So the insert-or-take-over
--   decision is atomic against any number of concurrent callers, and the statement always
--   returns exactly one row.
--
-- The clock is the database's: clock_timestamp() read once for every comparison, even inside
-- a long caller transaction (where now() would be the transaction's start). Deadlines set by
-- a takeover, and the time left in the answer, read it again after any wait on a row lock.
{seen}claimed AS (
    INSERT INTO {records} AS r (scope, key, fingerprint, attempt, token, lease_until, expires_at)
    SELECT $1, $2, $3, 1, $4, clock.now + $5::interval, clock.now + $5::interval + $6::interval
    FROM clock
    WHERE NOT EXISTS (SELECT FROM seen)
    ON CONFLICT (scope, key) DO UPDATE SET
        -- One decision on the locked latest version, `step`, written once:
        --   'renew'      past its expiry the record counts as absent: start afresh at
        --                attempt 1, whatever its fingerprint;
        --   'take_over'  an expired lease, the same fingerprint, another token: count the
        --                attempt and hand the lease to this token;
        --   'keep'       anything else: every column set to itself.
        -- A new deadline is counted from clock_timestamp(), read now that the row lock is
        -- held: the statement may have waited for it (behind a holder's open transaction that
        -- then rolled back), and a deadline counted from `clock.now` could already be past.
        -- An in-progress record has no meta or body, and a completed one is replaced only
        -- once expired (its NULL token never passes the takeover test): only 'renew' clears.
        (attempt, fingerprint, token, lease_until, expires_at, meta, body) = (
            SELECT
                CASE d.step WHEN 'renew' THEN 1 WHEN 'take_over' THEN r.attempt + 1
                            ELSE r.attempt END,
                CASE d.step WHEN 'renew' THEN excluded.fingerprint ELSE r.fingerprint END,
                CASE d.step WHEN 'keep' THEN r.token ELSE excluded.token END,
                CASE d.step WHEN 'keep' THEN r.lease_until
                            ELSE clock_timestamp() + $5::interval END,
                CASE d.step WHEN 'keep' THEN r.expires_at
                            ELSE clock_timestamp() + $5::interval + $6::interval END,
                CASE d.step WHEN 'renew' THEN NULL ELSE r.meta END,
                CASE d.step WHEN 'renew' THEN NULL ELSE r.body END
            FROM (
                SELECT CASE
                    WHEN r.expires_at <= clock.now THEN 'renew'
                    WHEN r.token <> excluded.token
                         AND r.lease_until <= clock.now
                         AND r.fingerprint = excluded.fingerprint THEN 'take_over'
                    ELSE 'keep' END AS step
                FROM clock
                -- OFFSET 0 keeps this subquery whole: flattened, its CASE would be copied
                -- into each of the seven CASEs above, and PostgreSQL compiles every
                -- expression of the plan again at each execution (BENCHMARKS.md).
                OFFSET 0
            ) AS d
        )
    RETURNING r.fingerprint, r.attempt, r.token, r.lease_until, r.expires_at, r.meta, r.body
)
{answer}
