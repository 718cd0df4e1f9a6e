//! # idem-postgres
//!
//! The [`idem_core::Store`] on PostgreSQL, with [sqlx]: idempotency records in a table of
//! their own schema, each step of the state machine one SQL statement, and a transactional
//! API that commits the completed record together with the work's own writes.
//!
//! ## Quick start
//!
//! ```no_run
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! use idem_core::{Begin, Fingerprint, Idem, Key, RecordId, Response, Scope};
//! use idem_postgres::PgStore;
//!
//! let store = PgStore::connect("postgres://app@127.0.0.1/app").await?;
//! store.migrate().await?; // creates the schema `idem` and its table, once
//! let idem = Idem::new(store);
//!
//! let id = RecordId::new(Scope::new("tenant-1")?, Key::new("order-42")?);
//! match idem.begin(&id, Fingerprint::of_bytes(b"charge 12.50 EUR")).await? {
//!     Begin::Acquired(lease) | Begin::TookOver(lease) => {
//!         // ... the work, once ...
//!         idem.complete(&lease, Response::new(201, "charged")).await?;
//!     }
//!     Begin::Replay(replay) => { /* hand back replay.completion.response */ }
//!     Begin::InFlight { retry_after } => { /* 409, retry after `retry_after` */ }
//!     Begin::Mismatch => { /* 422: the key was used for another request */ }
//!     Begin::Expired { .. } => { /* 410: forgotten, under AfterRetention::Refuse */ }
//! }
//! # Ok(()) }
//! ```
//!
//! ## Schema and migrations
//!
//! The table lives in its own schema, `idem` by default ([`PgStore::with_schema`] picks
//! another), with its own migration ledger: [`migrate`] (or [`PgStore::migrate`]) says how,
//! and why it never meets the application's `_sqlx_migrations`.
//!
//! ```no_run
//! # async fn run(pool: sqlx::PgPool) -> Result<(), idem_core::Error> {
//! idem_postgres::migrate(&pool).await?; // schema `idem`
//! let store = idem_postgres::PgStore::new(pool).with_schema("billing_idem")?;
//! store.migrate().await?; // schema `billing_idem`
//! # Ok(()) }
//! ```
//!
//! ## Waiters
//!
//! A caller waiting for another worker's result ([`idem_core::Config::wait`]) is woken with
//! `LISTEN`/`NOTIFY`, sent only for records someone waits for: [`notify`] has the protocol,
//! [`PgStore::with_notify`] turns it off.
//!
//! ## How `begin` stays atomic
//!
//! `begin` sends `src/sql/claim.sql`, and `src/sql/begin.sql` only when that returns no row.
//! Each is one statement, so each is atomic; between the two the record may change, which
//! is as if the call had come a little later.
//!
//! `claim.sql` answers from the statement's snapshot when the record needs no change, so
//! replays, in-flight answers (a waiter's polling included) and mismatches write and lock
//! nothing, and inserts a new key with one plain insert. When it returns no row (a record
//! past its expiry, a lease to take over, or a key a concurrent caller inserted meanwhile),
//! `begin.sql` decides on the row's latest committed version, under its lock (`INSERT ... ON
//! CONFLICT DO UPDATE`). Each file's header says why it is built as it is, and what it
//! returns. [`PgStore::begin_in`] sends `begin.sql` alone.
//!
//! A serialization failure or deadlock under a stricter isolation level is resent by the
//! store's own calls ([`PgStore::with_conflict_retries`]), never inside a caller's
//! transaction ([`is_transaction_conflict`]).
//!
//! Every deadline and expiry is computed by the database's `clock_timestamp()`, read once
//! per statement: never the application's clock, and never `now()`, which in a long
//! transaction is the transaction's start.
//!
//! ## Transactional use
//!
//! [`PgStore::complete_in`] stores the completion on the caller's own transaction, so the
//! work's writes and the completed record commit or roll back together: a crash, a lost
//! connection or a rollback leaves neither, and a retry runs the work again. If the lease
//! was lost meanwhile (another worker took the key over and completed it), the guarded
//! update matches no row and returns [`idem_core::Error::LeaseLost`]: roll back, and the
//! work is never committed twice.
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use idem_core::{
//!     Begin, BeginRequest, Completion, Error, FencingToken, Fingerprint, Key, RecordId,
//!     Response, Scope, Store,
//! };
//! use idem_postgres::PgStore;
//!
//! async fn pay(store: &PgStore, order: &str, cents: i64) -> Result<Response, Error> {
//!     let id = RecordId::new(Scope::global(), Key::new(order).map_err(|e| Error::Invalid(e.to_string()))?);
//!     let req = BeginRequest {
//!         id: &id,
//!         fingerprint: Fingerprint::of_bytes(&cents.to_be_bytes()),
//!         token: FencingToken::random(),
//!         lease: Duration::from_secs(30),
//!         retention: Duration::from_secs(24 * 3600),
//!     };
//!     // Claim the key on the pool: committed at once, no transaction held yet.
//!     let lease = match store.begin(req).await? {
//!         Begin::Acquired(lease) | Begin::TookOver(lease) => lease,
//!         Begin::Replay(replay) => return Ok(replay.completion.response),
//!         Begin::InFlight { .. } => return Ok(Response::new(409, "in flight")),
//!         Begin::Mismatch => return Ok(Response::new(422, "key reused")),
//!         // Only the engine answers it (after a key's retention, under its tombstone).
//!         Begin::Expired { .. } => return Ok(Response::new(410, "key expired")),
//!     };
//!     let db = |e: sqlx::Error| Error::backend("postgres", e);
//!     let mut tx = store.pool().begin().await.map_err(db)?;
//!     sqlx::query("INSERT INTO payments (order_id, cents) VALUES ($1, $2)")
//!         .bind(order)
//!         .bind(cents)
//!         .execute(&mut *tx)
//!         .await
//!         .map_err(db)?;
//!     let response = Response::new(201, "paid");
//!     let completion = Completion::succeeded(response.clone());
//!     // In the same transaction: the payment row and the completed record commit together.
//!     // LeaseLost here drops `tx`, which rolls the payment back.
//!     store
//!         .complete_in(&mut tx, &lease, &completion, Duration::from_secs(24 * 3600))
//!         .await?;
//!     tx.commit().await.map_err(db)?;
//!     Ok(response)
//! }
//! ```
//!
//! [`PgStore::begin_in`] claims the key inside the transaction too, holding it open across
//! the work; its docs say what that costs.
//!
//! ## Purging expired records
//!
//! Expired records behave as absent at once; deleting them only reclaims space, in bounded
//! batches: [`PgStore::purge_expired`] by hand (`while store.purge_expired(1000).await? ==
//! 1000 {}`), or [`PgStore::spawn_purge`] in the background.
//!
//! ## Operators
//!
//! [`idem_core::Store::stats`] counts live records by state (in flight, expired leases,
//! stuck, succeeded, failed) in one statement: within a scope it reads that scope's range of
//! the primary key; across all scopes it reads the whole table, so keep it off the hot path.
//! The table is plain SQL too: `SELECT * FROM idem.records WHERE token IS NOT NULL AND
//! lease_until < now() - interval '5 minutes'` lists the keys abandoned by crashed workers.
//!
//! ## Table design for churn
//!
//! The table is mostly churn: the migration `migrations/postgres/0001_records.sql` says in
//! its header how it is tuned for that (fillfactor, two indexes, autovacuum).
//!
//! ## Throughput
//!
//! `idem-bench --store postgres://...` measures lifecycles and replays: see BENCHMARKS.md.
//!
//! ## Errors
//!
//! SQLSTATE codes and sqlx's error variants decide, never message text: connection refused
//! or dropped, TLS failures, pool timeouts, class `08` (connection exception), class `53`
//! (insufficient resources, `53300` too many connections), `57P01`..`57P03` (shutdown),
//! `57014` (statement timeout) and `55P03` (lock timeout) are
//! [`idem_core::Error::Unavailable`]; `40001`/`40P01` too, wrapped in
//! [`TransactionConflict`]; values that do not decode are
//! [`idem_core::Error::Corrupt`]; everything else is [`idem_core::Error::Backend`]. The
//! pool's acquire timeout bounds how long an unreachable server takes to answer
//! ([`PgStore::pool_options`] sets 3 s).
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]

mod error;
mod migrate;
pub mod notify;
mod purge;
mod schema;
mod store;
mod stuck;

pub use error::{is_transaction_conflict, map as map_error, TransactionConflict};
pub use migrate::{migrate, migrator, sharing_the_ledger};
pub use purge::{PurgeConfig, PurgeHandle};
pub use schema::DEFAULT_SCHEMA;
pub use store::{PgStore, DEFAULT_CONFLICT_RETRIES, MAX_DURATION};
pub use stuck::StuckRecord;
