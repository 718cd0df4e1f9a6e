-- stats: count live records by state, in one scope or in all (an operator's tool; with no
-- scope it reads the whole table).
--
-- $1 scope (bytea, NULL for every scope), $2 stuck_after (interval).
--
-- Returns one row of bigints: in_flight (live lease), expired_leases (in progress, deadline
-- passed, not taken over), stuck (of those, deadline passed more than $2 ago), succeeded and
-- failed (completed; the kind is the second byte of meta, as idem_core::encode_meta writes
-- it: version, kind). Expired records are not counted: they behave as absent.
WITH clock AS MATERIALIZED (SELECT clock_timestamp() AS now)
SELECT
    count(*) FILTER (WHERE r.token IS NOT NULL AND r.lease_until > clock.now) AS in_flight,
    count(*) FILTER (WHERE r.token IS NOT NULL AND r.lease_until <= clock.now) AS expired_leases,
    count(*) FILTER (WHERE r.token IS NOT NULL AND clock.now - r.lease_until > $2::interval)
        AS stuck,
    count(*) FILTER (WHERE r.token IS NULL AND substring(r.meta FROM 2 FOR 1) = '\x00'::bytea)
        AS succeeded,
    count(*) FILTER (WHERE r.token IS NULL AND substring(r.meta FROM 2 FOR 1) = '\x01'::bytea)
        AS failed
FROM {records} AS r, clock
WHERE r.expires_at > clock.now AND ($1::bytea IS NULL OR r.scope = $1::bytea)
