//! Where the demo's payments live, next to the store of `--store`:
//!
//! - on `postgres://` and `tiered:` stores, rows of `idem_demo.payments` in the same
//!   database, each written in the transaction that completes the request's idempotency
//!   record (`complete_in`): both commit or neither does, so a crash after the commit
//!   loses nothing and a retry replays the payment instead of making a second one. Every
//!   `idem serve` process on the database sees the same payments;
//! - on the memory and Redis stores, a list in this process's memory: a restart forgets
//!   it, and two processes each have their own.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idem_core::{Completion, Error, Store};
use idem_http::LeaseHandle;
use idemkit::outbox::TieredStore;
use idemkit::postgres::{map_error, PgStore};
use idemkit::url::StoreUrl;
use serde::Serialize;
use sqlx::PgPool;

use crate::store::Opened;
use crate::CliError;

/// One payment, as stored and as answered.
#[derive(Debug, Clone, Serialize)]
pub struct Payment {
    pub id: String,
    pub amount: u64,
    pub currency: String,
    pub status: String,
    pub created_at: String,
    #[serde(skip)]
    pub owner: String,
}

/// The store `--store` names, and the payments ledger that goes with it.
#[derive(Debug)]
pub struct Backend {
    /// The idempotency store.
    pub store: Arc<dyn Store>,
    /// The payments.
    pub ledger: Ledger,
}

impl Backend {
    /// The ledger that goes with the store `url` named, opened (and migrated) by
    /// [`idemkit::open`]; on PostgreSQL, creates `idem_demo.payments` if it is missing.
    ///
    /// # Errors
    ///
    /// [`CliError::Open`] when the payments table cannot be created.
    pub async fn open(url: &StoreUrl, opened: Opened) -> Result<Self, CliError> {
        let store = opened.store();
        let records = match opened {
            Opened::Postgres(pg) => Records::Pg(pg),
            Opened::Tiered(tiered) => Records::Tiered(tiered),
            // The memory and Redis stores: the payments live in this process.
            _ => {
                return Ok(Self {
                    store,
                    ledger: Ledger::Memory(Mutex::default()),
                })
            }
        };
        let ledger = Postgres { records };
        ledger.migrate().await.map_err(|e| {
            // Drivers may quote the URL they were given: never let its password through.
            let detail = url.scrub(&e.to_string());
            CliError::Open(format!(
                "cannot create the demo's payments table in {url}: {detail}"
            ))
        })?;
        Ok(Self {
            store,
            ledger: Ledger::Postgres(ledger),
        })
    }
}

/// The payments.
#[derive(Debug)]
pub enum Ledger {
    /// In this process's memory.
    Memory(Mutex<Vec<Payment>>),
    /// In PostgreSQL, with the idempotency records.
    Postgres(Postgres),
}

impl Ledger {
    /// Where the payments are, for the start-up line.
    pub fn describe(&self) -> &'static str {
        match self {
            Self::Memory(_) => "in this process's memory",
            Self::Postgres(_) => "in PostgreSQL, table idem_demo.payments",
        }
    }

    /// Makes the payment (the side effect). On PostgreSQL its row and, with a `lease`, the
    /// record completed with `completion` commit in one transaction; the layer is then
    /// told, so it does not store the response again. `pause` is waited after the commit,
    /// before anything else: the window in which a crash would lose the response but not
    /// the payment (for the demo and its tests).
    ///
    /// # Errors
    ///
    /// [`Error::LeaseLost`] when another request took the key over (nothing was
    /// committed); database errors.
    pub async fn pay(
        &self,
        payment: &Payment,
        lease: Option<(&LeaseHandle, &Completion)>,
        pause: Option<Duration>,
    ) -> Result<(), Error> {
        match self {
            Self::Memory(payments) => {
                payments
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(payment.clone());
                if let Some(pause) = pause {
                    tokio::time::sleep(pause).await;
                }
                Ok(())
            }
            Self::Postgres(pg) => pg.pay(payment, lease, pause).await,
        }
    }

    /// The owner's payments, oldest first.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub async fn list(&self, owner: &str) -> Result<Vec<Payment>, Error> {
        match self {
            Self::Memory(payments) => Ok(payments
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .filter(|p| p.owner == owner)
                .cloned()
                .collect()),
            Self::Postgres(pg) => pg.select(owner, None).await,
        }
    }

    /// One of the owner's payments.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub async fn find(&self, owner: &str, id: &str) -> Result<Option<Payment>, Error> {
        match self {
            Self::Memory(payments) => Ok(payments
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .iter()
                .find(|p| p.id == id && p.owner == owner)
                .cloned()),
            Self::Postgres(pg) => Ok(pg.select(owner, Some(id)).await?.pop()),
        }
    }
}

/// The store whose `complete_in` writes the record in the payment's transaction.
#[derive(Debug, Clone)]
enum Records {
    Pg(PgStore),
    Tiered(TieredStore),
}

/// The payments table in the store's database.
#[derive(Debug)]
pub struct Postgres {
    records: Records,
}

/// Creates the demo's table; idempotent.
const MIGRATION: &str = "
CREATE SCHEMA IF NOT EXISTS idem_demo;
CREATE TABLE IF NOT EXISTS idem_demo.payments (
    seq        bigserial PRIMARY KEY,
    id         text NOT NULL UNIQUE,
    owner      text NOT NULL,
    amount     bigint NOT NULL,
    currency   text NOT NULL,
    status     text NOT NULL,
    created_at text NOT NULL
);
CREATE INDEX IF NOT EXISTS payments_owner ON idem_demo.payments (owner, seq);
";

type Row = (String, i64, String, String, String, String);

impl Postgres {
    fn pool(&self) -> &PgPool {
        match &self.records {
            Records::Pg(pg) => pg.pool(),
            Records::Tiered(tiered) => tiered.pg().pool(),
        }
    }

    async fn migrate(&self) -> Result<(), Error> {
        let mut tx = self.pool().begin().await.map_err(map_error)?;
        // Two processes starting at once would race on CREATE ... IF NOT EXISTS.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem_demo.payments'))")
            .execute(&mut *tx)
            .await
            .map_err(map_error)?;
        sqlx::raw_sql(MIGRATION)
            .execute(&mut *tx)
            .await
            .map_err(map_error)?;
        tx.commit().await.map_err(map_error)
    }

    async fn pay(
        &self,
        payment: &Payment,
        lease: Option<(&LeaseHandle, &Completion)>,
        pause: Option<Duration>,
    ) -> Result<(), Error> {
        let mut tx = self.pool().begin().await.map_err(map_error)?;
        sqlx::query(
            "INSERT INTO idem_demo.payments (id, owner, amount, currency, status, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(&payment.id)
        .bind(&payment.owner)
        .bind(i64::try_from(payment.amount).map_err(|e| Error::Invalid(e.to_string()))?)
        .bind(&payment.currency)
        .bind(&payment.status)
        .bind(&payment.created_at)
        .execute(&mut *tx)
        .await
        .map_err(map_error)?;
        if let Some((lease, completion)) = lease {
            // The record completed in the payment's transaction. LeaseLost (another
            // request took the key over) returns here and drops `tx`: no payment.
            let (held, retention) = (lease.lease(), lease.retention());
            match &self.records {
                Records::Pg(pg) => pg.complete_in(&mut tx, held, completion, retention).await?,
                Records::Tiered(t) => t.complete_in(&mut tx, held, completion, retention).await?,
            }
        }
        tx.commit().await.map_err(map_error)?;
        if let Some(pause) = pause {
            tokio::time::sleep(pause).await;
        }
        if let Some((lease, completion)) = lease {
            lease.committed(completion);
            if let Records::Tiered(tiered) = &self.records {
                // Redis answers retries from now on; the relay would copy it later anyway.
                if let Err(e) = tiered
                    .publish(lease.lease(), completion, lease.retention())
                    .await
                {
                    tracing::debug!(error = %e, "completion left to the relay");
                }
            }
        }
        Ok(())
    }

    async fn select(&self, owner: &str, id: Option<&str>) -> Result<Vec<Payment>, Error> {
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT id, amount, currency, status, created_at, owner FROM idem_demo.payments \
             WHERE owner = $1 AND ($2::text IS NULL OR id = $2) ORDER BY seq",
        )
        .bind(owner)
        .bind(id)
        .fetch_all(self.pool())
        .await
        .map_err(map_error)?;
        Ok(rows
            .into_iter()
            .map(
                |(id, amount, currency, status, created_at, owner)| Payment {
                    id,
                    amount: amount.unsigned_abs(),
                    currency,
                    status,
                    created_at,
                    owner,
                },
            )
            .collect())
    }
}
