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
//! Why it holds: [`TieredStore`] grants a lease only when PostgreSQL grants it, and Redis
//! only ever holds what PostgreSQL granted or committed (its docs say how each call keeps
//! it so). Redis's replays are therefore the committed ones, and its "in flight" and
//! "mismatch" answers rest on a lease or a completion PostgreSQL holds: a retry of a
//! committed request is never refused because Redis lost the key and another request
//! claimed it there first, or because a claim sent to a stalled Redis landed late.
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
//! Plus, per completion, the relay's share of a batch: one claiming `SELECT ... FOR UPDATE
//! SKIP LOCKED`, one Redis script per row (pipelined), one `DELETE`.
//!
//! What a client sees during each kind of fault (Redis flushed, down or stalled; PostgreSQL
//! down) is the table of docs/tiered.md.
//!
//! ## The relay
//!
//! [`Relay`] copies the committed completions of the outbox table into Redis, at least once;
//! its docs say what a batch does and how a failing row ends up dead. Run it as `idem relay
//! run` (crate `idem-cli`; docs/tiered.md, "Running the relay", gives its options, its shutdown and
//! its `--prefix`, which must match [`idem_redis::RedisConfig::prefix`]) or in-process with
//! [`Relay::run`]. A dead row weakens no guarantee, it only delays the fast path for its
//! key: PostgreSQL holds the completion, and replays it once the completing lease expired.
//! Its metrics ([`Relay::metrics`], and `idem_relay_*` through the `metrics` facade) are
//! listed in docs/operations.md, "Metrics".
#![cfg_attr(docsrs, feature(doc_cfg))]

mod metrics;
mod migrate;
mod outage;
mod outbox;
mod relay;
mod statements;
mod tiered;

pub use metrics::{Batch, RelayMetrics};
pub use migrate::{migrate, migrator};
pub use outbox::{DeadEntry, Gauges, Outbox};
pub use relay::{Relay, RelayConfig};
pub use tiered::{TieredStore, CHANNEL, STORE};
