-- 0003_streams: the streams of records in progress (a streamed response recorded while its
-- lease runs, so that other instances can join it).
--
-- Runs with search_path set to idem's own schema, like 0001_records. (Version 2 is taken:
-- databases migrated by an earlier idem-postgres hold its former outbox migration there.)
--
-- One row per append: the bytes a lease wrote at byte offset `at` of its stream. Rows are
-- keyed by the lease's token, so a holder that lost its lease writes only rows that nobody
-- reads (readers read the rows of the token the record holds), and a new holder starts an
-- empty stream. Rows whose token no longer holds an unexpired record are deleted by the
-- purge (`purge_streams.sql`), a batch at a time.
CREATE TABLE streams (
    scope bytea  NOT NULL,
    key   text   COLLATE "C" NOT NULL,
    token uuid   NOT NULL,
    at    bigint NOT NULL CHECK (at >= 0),
    bytes bytea  NOT NULL,
    PRIMARY KEY (scope, key, token, at)
);
