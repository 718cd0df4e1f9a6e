-- 1001_outbox: completions committed by the tiered store, waiting for the relay to copy them
-- into Redis. Owned by idem-outbox (its own migrator, `idem_outbox::migrator`); a plain
-- PostgreSQL store never gets this table.
--
-- Runs with search_path set to idem's schema, where idem-postgres's 0001 made `records`.
-- The version (1001) stays clear of idem-postgres's, since both migrators keep their ledger
-- in the schema's one `_sqlx_migrations` table (each ignores the other's versions).
--
-- IF NOT EXISTS: databases migrated before this crate owned the table got it from
-- idem-postgres's former 0002_outbox (the same table and index): for them this is a no-op.
--
-- A row is written in the same transaction as the completed record it mirrors (by
-- `idem_outbox::TieredStore::complete_in`, or `complete` in a transaction of its own), so it
-- exists exactly when that completion committed. The relay claims rows with
-- FOR UPDATE SKIP LOCKED, applies them to Redis (idempotently: applying twice is applying
-- once) and deletes them; a row whose application keeps failing is marked dead for an
-- operator to list and retry. `pg_notify('idem_outbox', '')` in the writing transaction wakes
-- the relays when it commits.
--
-- The row carries a copy of the completion rather than a reference to the record: the relay
-- reads one table, and a record that was purged or completed again by a later incarnation of
-- its key cannot be confused with this one.
--
-- Built for insert-then-delete churn: no foreign keys, one partial index over the rows still
-- to relay (dead rows leave it), and autovacuum started early.
CREATE TABLE IF NOT EXISTS outbox (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    scope       bytea       NOT NULL,
    key         text        COLLATE "C" NOT NULL,
    fingerprint bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    -- The lease that completed: the relay writes over Redis's in-progress record only when
    -- it is still held by this token.
    token       uuid        NOT NULL,
    attempt     integer     NOT NULL CHECK (attempt >= 1),
    meta        bytea       NOT NULL,
    body        bytea       NOT NULL,
    -- When the completed record is forgotten: the copy in Redis expires then too.
    expires_at  timestamptz NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Relay bookkeeping: failed applications so far, when to try next, and why it failed.
    tries       integer     NOT NULL DEFAULT 0,
    next_try_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    dead        boolean     NOT NULL DEFAULT false,
    last_error  text
) WITH (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_analyze_scale_factor = 0.05
);

CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (next_try_at, id) WHERE NOT dead;
