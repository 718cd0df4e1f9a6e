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
//! [`TieredStore`] grants a lease only when PostgreSQL grants it too. Redis can say "in
//! flight", "replay" or "mismatch" on its own, but never "run": Redis only ever holds
//! completions that PostgreSQL committed first, so its replays are the committed ones.
//!
//! ## The cost
//!
//! | request | round trips |
//! |---|---|
//! | retry of a completed key (Redis has it) | 1 Redis |
//! | duplicate while in flight | 1 Redis |
//! | first request for a key | 1 Redis + 1 PostgreSQL (`begin`), then the business transaction with 2 more statements (complete + outbox row), then 1 Redis (`publish`) |
//! | retry after Redis lost the completion | 1 Redis + 1 PostgreSQL + 1 Redis (the repair) |
//! | any request while Redis is down | 1 PostgreSQL (PostgreSQL alone answers) |
//!
//! Plus, per completion, the relay's share of a batch: one claiming `SELECT ... FOR UPDATE
//! SKIP LOCKED`, one Redis script per row (pipelined), one `DELETE`.

mod relay;
mod tiered;

pub use relay::{Batch, DeadEntry, Gauges, Outbox, Relay, RelayConfig, RelayMetrics};
pub use tiered::{TieredStore, CHANNEL, STORE};
