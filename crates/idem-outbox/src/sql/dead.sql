-- dead: the dead rows, oldest first, for an operator.
--
-- $1 at most this many (bigint).
--
-- Returns id, scope, key, tries, last_error and age (seconds since the completion
-- committed, float8).
SELECT id, scope, key, tries, last_error,
       extract(epoch FROM clock_timestamp() - created_at)::float8 AS age
FROM {outbox} WHERE dead ORDER BY id LIMIT $1
