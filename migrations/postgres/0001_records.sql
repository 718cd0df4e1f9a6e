-- 0001_records: the table of idempotency records and the index the purge walks.
--
-- Runs with search_path set to idem's own schema (see `idem_postgres::migrate`), so it names
-- no schema: the same file serves `idem` and any schema chosen with `with_schema`.
--
-- One row per (scope, key). A row is either
--   in progress: token, lease_until set; meta, body NULL
--   completed:   meta, body set; token, lease_until NULL
-- and is forgotten once expires_at passes (it then behaves as absent, and `purge_expired`
-- deletes it). All times come from the database clock (clock_timestamp()).
--
-- Built for a high insert, update and delete rate:
--   * fillfactor 80 leaves room on each page for the updates every record goes through
--     (complete; sometimes extend or a takeover): PostgreSQL puts the new row version on
--     the same page when it fits, so an update dirties one heap page and needs no search for
--     free space, and the old version's space is reclaimed by page pruning on a later visit,
--     before vacuum comes round. An update that changes no indexed column (a begin that
--     finds the row changed since its snapshot and leaves it as it is) is HOT as well: no
--     index entry at all.
--   * two indexes only: the primary key, which `begin` needs for ON CONFLICT, and expires_at,
--     which lets the purge take the oldest expired rows in bounded batches without a scan.
--   * no foreign keys and no triggers: every write is one row and takes one row lock.
--   * autovacuum tuned per table: the defaults wait for 20% of the table to be dead, which on
--     a table that is mostly churn means long bloat cycles; these start it at 2% and 5%.
CREATE TABLE records (
    -- The scope's UTF-8 bytes: a scope may hold any character, NUL included, which text
    -- cannot store.
    scope       bytea       NOT NULL,
    -- Visible ASCII only (idem_core::Key); "C" collation compares bytes, no locale lookups.
    key         text        COLLATE "C" NOT NULL,
    -- SHA-256 of the request that created the record.
    fingerprint bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    -- 1 for the first acquisition, +1 for each takeover of an expired lease.
    attempt     integer     NOT NULL CHECK (attempt >= 1),
    -- The fencing token of the lease holder; NULL once completed.
    token       uuid,
    -- The lease deadline; NULL once completed.
    lease_until timestamptz,
    -- When the record is forgotten.
    expires_at  timestamptz NOT NULL,
    -- idem_core::encode_meta of the completion (kind, status, headers); NULL in progress.
    meta        bytea,
    -- The completion's body; NULL in progress.
    body        bytea,
    PRIMARY KEY (scope, key),
    CONSTRAINT records_state CHECK (
        (token IS NULL) = (lease_until IS NULL)
        AND (token IS NULL) = (meta IS NOT NULL)
        AND (meta IS NULL) = (body IS NULL)
    )
) WITH (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.05
);

CREATE INDEX records_expires_at ON records (expires_at);
