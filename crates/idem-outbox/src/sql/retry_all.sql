-- retry_all: make every dead row pending again (tries reset, due now).
--
-- $1 the NOTIFY channel (text), $2 the schema (text, the payload): retried rows wake the
-- relays like new ones, once this commits.
--
-- Returns one row: how many rows were retried (bigint).
WITH retried AS (
    UPDATE {outbox} SET dead = false, tries = 0, next_try_at = clock_timestamp()
    WHERE dead RETURNING id
)
SELECT count(*) FROM retried, (SELECT pg_notify($1, $2)) AS wake
