-- fail: record the failed applications of a batch in one statement.
--
-- $1 ids (bigint[]), $2 the pause before each row's next try in milliseconds (bigint[]),
-- $3 each row's error (text[]), $4 the tries after which a row is dead (integer).
--
-- Returns id and dead for every updated row: a row whose tries reach $4 is marked dead
-- (out of the relay's way, for an operator to list and retry).
UPDATE {outbox} AS o
SET tries = o.tries + 1,
    next_try_at = clock_timestamp() + f.delay_ms * interval '1 millisecond',
    last_error = f.error,
    dead = o.tries + 1 >= $4
FROM unnest($1::bigint[], $2::bigint[], $3::text[]) AS f(id, delay_ms, error)
WHERE o.id = f.id
RETURNING o.id, o.dead
