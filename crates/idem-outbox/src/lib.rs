//! # idem-outbox
//!
//! The tiered store of idem: PostgreSQL is the source of truth, committed together with the
//! business writes; Redis is the fast path, fed right after each commit and by a relay
//! worker that drains an outbox table.
//!
//! ## The guarantee
//!
//! **Once a business transaction that completed a key with [`TieredStore::complete_in`] has
//! committed, no retry of that key runs the work again**, whatever happened to Redis since
//! (flushed, failed over to a replica that missed the write, evicted the record, down) and
//! however far behind the relay is: such a retry gets the committed response. **Two business
//! transactions for the same key can never both commit**: each completes under its lease's
//! fencing token with a guarded update in PostgreSQL, and only the current holder's matches.
//!
//! Why it holds: a retry reaches the work only after `begin` granted it a lease, and
//! [`TieredStore`] grants a lease only when PostgreSQL grants it. Redis only ever holds what
//! PostgreSQL granted or committed: `begin` reads Redis without writing, asks PostgreSQL
//! when Redis has no answer, and writes a lease into Redis only after PostgreSQL granted it;
//! completions reach Redis only after they committed. So Redis's replays are the committed
//! ones, and its "in flight" and "mismatch" answers rest on a lease or a completion
//! PostgreSQL holds: a retry of a committed request is never refused because Redis lost the
//! key and another request claimed it there first, or because a claim sent to a stalled
//! Redis landed late.
//!
//! A completion whose body Redis cannot hold whole (over its body limit, with a policy that
//! would refuse it or drop the body) is never written into Redis: its retries are replayed
//! from PostgreSQL, one Redis and one PostgreSQL round trip each.
//!
//! ## The cost
//!
//! | request | round trips |
//! |---|---|
//! | retry of a completed key (Redis has it) | 1 Redis |
//! | duplicate while in flight | 1 Redis |
//! | first request for a key | 1 Redis (read) + 1 PostgreSQL (`begin`) + 1 Redis (the granted lease), then the business transaction with 2 more statements (complete + outbox row), then 1 Redis (`publish`) |
//! | retry after Redis lost the completion | 1 Redis + 1 PostgreSQL + 1 Redis (the repair) |
//! | any request while Redis is down | 1 PostgreSQL (PostgreSQL alone answers) |
//!
//! **Faults, as a client sees them.** Redis flushed or failed over: retries of committed
//! keys are replayed from PostgreSQL (and written back into Redis); nothing runs twice.
//! Redis down or stalled: the calls that were waiting on it answer after
//! [`idem_redis::RedisConfig::call_timeout`] at most; from the first call that failed on,
//! PostgreSQL answers alone (replays, in flight, mismatch, new keys), logged once, until a
//! probe finds Redis back (every half second; logged with the count of requests answered
//! without it). PostgreSQL down or restarting: `begin` fails as unavailable (503 from the
//! middleware) rather than let Redis decide alone; completions that were committed are
//! still replayed from Redis.
//!
//! Plus, per completion, the relay's share of a batch: one claiming `SELECT ... FOR UPDATE
//! SKIP LOCKED`, one Redis script per row (pipelined), one `DELETE`.
//!
//! ## The relay
//!
//! [`Relay`] copies the committed completions of the outbox table into Redis. Run it as a
//! worker, one or more per database (any number can run at once: each batch is claimed
//! with `FOR UPDATE SKIP LOCKED`, so relays share the rows without waiting on each other),
//! either as `idem relay run` (the `idem` binary, crate `idem-cli`, whose `--help` and the
//! README's "Running the relay" give its options, variables and exit codes; its `--prefix`
//! must match the application's [`idem_redis::RedisConfig::prefix`]) or in-process with
//! [`Relay::run`].
//!
//! **What a batch does**, in one transaction: claim up to `batch` due rows (`NOT dead AND
//! next_try_at <= now`, oldest first), delete unapplied those whose record has expired,
//! apply the others to Redis concurrently ([`idem_redis::RedisStore::apply_completion`]:
//! written over the completing lease's in-progress record or into an absent key; a key
//! already completed, or held by a later lease, is left alone, since that lease must pass
//! the arbiter, which answers with this completion), delete the applied rows in one
//! statement, count a try on the failed ones, commit. Delivery is at least once: a relay
//! killed before its commit leaves its rows to the next batch, which applies them again,
//! harmlessly.
//!
//! **When it runs**: on every `NOTIFY idem_outbox` whose payload is its schema (sent by the
//! transactions that write outbox rows, and by `dead retry`), and every `--poll-ms` anyway
//! (notifications are lost while the listening connection reconnects, and rows waiting for
//! a retry fall due silently). It drains batch after batch while they come back full.
//!
//! **Failures.** A row that fails on its own (it does not decode, or Redis refuses it, such
//! as a body over the Redis store's limit under a refusing policy) is retried after
//! `backoff * 2^tries` (at most the cap); after `--max-tries` failures it is marked dead,
//! with its last error, and the relay logs it at `error` level. Dead rows stay in the
//! table, out of the relay's way: `idem relay dead list` shows them
//! ([`Outbox::dead_entries`]), `idem relay dead retry` makes all of them (or `--id N`)
//! pending again with their tries reset ([`Outbox::retry_dead`]). A dead row weakens no
//! guarantee, it only delays the fast path for its key: PostgreSQL holds the completion, so
//! retries of the key see it in flight while Redis still holds the completing lease, and
//! once that lease expired, get the committed response from PostgreSQL (which also writes
//! it back into Redis).
//!
//! **Shutdown.** On SIGTERM or SIGINT (in-process: when the future passed to
//! [`Relay::run`] resolves) the relay finishes and commits the batch in hand, then exits 0;
//! idle, it exits at once. A relay killed outright (`kill -9`, a crash) loses nothing
//! either: PostgreSQL rolls its open batch back and the rows are relayed by the next batch
//! of any relay.
//!
//! **Metrics**, at `GET /metrics` with `--metrics-listen` (Prometheus text format, each
//! labelled `schema`), from [`Relay::metrics`] / [`Relay::observe`] in-process, and as
//! `tracing` events:
//!
//! | metric | type | meaning |
//! |---|---|---|
//! | `idem_relay_relayed_total` | counter | rows applied to Redis and deleted by this relay |
//! | `idem_relay_expired_total` | counter | rows deleted unapplied, their record expired |
//! | `idem_relay_failed_total` | counter | failed applications of single rows |
//! | `idem_relay_dead_marked_total` | counter | rows this relay marked dead |
//! | `idem_relay_outages_total` | counter | batches rolled back, Redis or PostgreSQL unavailable |
//! | `idem_relay_backlog` | gauge | rows waiting to be relayed (all relays) |
//! | `idem_relay_lag_seconds` | gauge | age of the oldest waiting row: alert on it |
//! | `idem_relay_dead` | gauge | dead rows waiting for an operator: alert when above 0 |
//!
//! The gauges are read from PostgreSQL (one `count(*)` over the outbox) on every scrape and
//! at most once a second by the worker.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod metrics;
mod migrate;
mod outbox;
mod relay;
mod statements;
mod tiered;

pub use metrics::{Batch, RelayMetrics};
pub use migrate::{migrate, migrator};
pub use outbox::{DeadEntry, Gauges, Outbox};
pub use relay::{Relay, RelayConfig};
pub use tiered::{TieredStore, CHANNEL, STORE};
