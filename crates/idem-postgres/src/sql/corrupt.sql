-- corrupt: the live completed records whose metadata idem cannot read (an operator's tool;
-- reads, never writes): shorter than its fixed head (version, kind, status, header count:
-- 6 bytes), another version than $2, or a completion kind other than 0 and 1. Such a
-- record fails every request for its key until it is evicted. (The rest of the metadata,
-- the headers, is checked only when the record is read.)
--
-- $1 scope (bytea, NULL for every scope), $2 the metadata version idem writes (integer),
-- $3 limit (bigint).
--
-- Returns up to $3 rows: scope (bytea), key (text), and total (bigint): how many such
-- records there are in all (the window counts before LIMIT applies).
WITH clock AS MATERIALIZED (SELECT clock_timestamp() AS now)
SELECT r.scope, r.key, count(*) OVER () AS total
FROM {records} AS r, clock
WHERE r.token IS NULL
  AND r.expires_at > clock.now
  AND ($1::bytea IS NULL OR r.scope = $1::bytea)
  -- CASE, not OR: get_byte past the end would fail the statement, and SQL does not promise
  -- to evaluate OR's operands in order.
  AND CASE
        WHEN octet_length(r.meta) < 6 THEN true
        ELSE get_byte(r.meta, 0) <> $2 OR get_byte(r.meta, 1) NOT IN (0, 1)
      END
ORDER BY r.scope, r.key
LIMIT $3
