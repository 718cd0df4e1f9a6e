-- delete: the rows of a batch that were applied to Redis (or had expired).
--
-- $1 their ids (bigint[]). Affects those rows; the batch transaction holds their locks.
DELETE FROM {outbox} WHERE id = ANY($1)
