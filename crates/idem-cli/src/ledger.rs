//! Where the demo's payments live (docs/stores.md, "The demo's payments on PostgreSQL"): rows of
//! `idem_demo.payments` on `postgres://` and `tiered:` stores, each committed in the
//! transaction that completes its idempotency record (`complete_in`); else this process's
//! memory.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idem_core::{Completion, Error, Store};
use idem_http::LeaseHandle;
use idemkit::outbox::TieredStore;
use idemkit::postgres::{map_error, PgStore};
use serde::Serialize;

use crate::error::CliError;
use crate::store::Opened;

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
    /// The ledger that goes with the store `opened`, opened (and migrated) by
    /// [`crate::store::open`]; on PostgreSQL, creates `idem_demo.payments` if it is missing.
    ///
    /// # Errors
    ///
    /// [`CliError::Open`] when the payments table cannot be created.
    pub async fn open(opened: Opened) -> Result<Self, CliError> {
        let store = opened.store();
        let url = opened.url();
        // The memory and Redis stores: the payments live in this process.
        let Some(pg) = opened.pg().cloned() else {
            return Ok(Self {
                store,
                ledger: Ledger::Memory(Mutex::default()),
            });
        };
        let tiered = opened.tiered().cloned();
        let ledger = Postgres { pg, tiered };
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
            Self::Postgres(pg) => pg.select(owner).await,
        }
    }

    /// One of the owner's payments.
    ///
    /// # Errors
    ///
    /// Database errors.
    pub async fn find(&self, owner: &str, id: &str) -> Result<Option<Payment>, Error> {
        Ok(self.list(owner).await?.into_iter().find(|p| p.id == id))
    }
}

/// The payments table in the store's database.
#[derive(Debug)]
pub struct Postgres {
    pg: PgStore,
    /// On a tiered store, the store whose `complete_in` also writes the outbox row.
    tiered: Option<TieredStore>,
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
    async fn migrate(&self) -> Result<(), Error> {
        let mut tx = self.pg.pool().begin().await.map_err(map_error)?;
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
        let mut tx = self.pg.pool().begin().await.map_err(map_error)?;
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
            match &self.tiered {
                None => {
                    self.pg
                        .complete_in(&mut tx, held, completion, retention)
                        .await?
                }
                Some(t) => t.complete_in(&mut tx, held, completion, retention).await?,
            }
        }
        tx.commit().await.map_err(map_error)?;
        if let Some(pause) = pause {
            tokio::time::sleep(pause).await;
        }
        if let Some((lease, completion)) = lease {
            lease.committed(completion);
            if let Some(tiered) = &self.tiered {
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

    async fn select(&self, owner: &str) -> Result<Vec<Payment>, Error> {
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT id, amount, currency, status, created_at, owner FROM idem_demo.payments \
             WHERE owner = $1 ORDER BY seq",
        )
        .bind(owner)
        .fetch_all(self.pg.pool())
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
