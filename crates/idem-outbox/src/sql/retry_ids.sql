-- retry_ids: make the given dead rows pending again (tries reset, due now).
--
-- $1 the NOTIFY channel (text), $2 the schema (text, the payload), $3 the ids (bigint[]);
-- ids of rows that are not dead are passed over.
--
-- Returns one row: how many rows were retried (bigint).
WITH retried AS (
    UPDATE {outbox} SET dead = false, tries = 0, next_try_at = clock_timestamp()
    WHERE dead AND id = ANY($3) RETURNING id
)
SELECT count(*) FROM retried, (SELECT pg_notify($1, $2)) AS wake
