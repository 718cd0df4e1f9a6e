//! The relay's metrics: what one batch did ([`Batch`]), counters of its own work and the
//! outbox's gauges, as a snapshot ([`RelayMetrics`]) and through the `metrics` facade
//! (`idem_relay_*`, labelled `schema`).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::outbox::Gauges;

/// What one [`crate::Relay::relay_batch`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Batch {
    /// Rows claimed.
    pub claimed: usize,
    /// Rows applied to Redis (written, or found already completed or held by a later
    /// lease: nothing left to do) and deleted.
    pub relayed: usize,
    /// Of the relayed rows, those written into Redis (the others found the key completed
    /// already, or held by a later lease).
    pub written: usize,
    /// Rows whose completed record had already expired: deleted without being applied.
    pub expired: usize,
    /// Rows whose application failed; their tries went up and they wait for a retry.
    pub failed: usize,
    /// Of the failed rows, those that reached the maximum tries and are now dead.
    pub dead: usize,
}

/// A snapshot of a relay's metrics ([`crate::Relay::metrics`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RelayMetrics {
    /// Rows applied to Redis and deleted, by this relay, since it was created.
    pub relayed_total: u64,
    /// Rows deleted unapplied because their record had expired, by this relay.
    pub expired_total: u64,
    /// Failed applications of single rows (decoding, Redis refusing the row), by this
    /// relay. A Redis outage does not count here: the batch is rolled back whole.
    pub failed_total: u64,
    /// Rows that this relay marked dead.
    pub dead_marked_total: u64,
    /// Batches rolled back because Redis or PostgreSQL was unavailable, by this relay.
    pub outages_total: u64,
    /// Dead rows in the outbox (all relays), as last read.
    pub dead: u64,
    /// Rows waiting to be relayed (all relays), as last read.
    pub backlog: u64,
    /// Age in seconds of the oldest row waiting to be relayed (0 when none), as last read.
    pub lag_seconds: f64,
}

/// One relay's counters and last gauges, kept for [`RelayMetrics`] and recorded through the
/// `metrics` facade as they change.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// The `schema` label of every series.
    schema: String,
    relayed: AtomicU64,
    expired: AtomicU64,
    failed: AtomicU64,
    dead_marked: AtomicU64,
    outages: AtomicU64,
    dead: AtomicU64,
    backlog: AtomicU64,
    /// f64 bits.
    lag: AtomicU64,
}

const RELAYED: &str = "idem_relay_relayed_total";
const EXPIRED: &str = "idem_relay_expired_total";
const FAILED: &str = "idem_relay_failed_total";
const DEAD_MARKED: &str = "idem_relay_dead_marked_total";
const OUTAGES: &str = "idem_relay_outages_total";

impl Counters {
    pub(crate) fn new(schema: &str) -> Self {
        Self {
            schema: schema.to_owned(),
            ..Self::default()
        }
    }

    /// Makes every counter's series exist (at 0) in the installed recorder, so a dashboard
    /// or an alert on a rate sees it before the first event.
    pub(crate) fn register(&self) {
        for name in [RELAYED, EXPIRED, FAILED, DEAD_MARKED, OUTAGES] {
            metrics::counter!(name, "schema" => self.schema.clone()).increment(0);
        }
    }

    /// Counts a committed batch.
    pub(crate) fn batch(&self, batch: &Batch) {
        for (counter, name, n) in [
            (&self.relayed, RELAYED, batch.relayed),
            (&self.expired, EXPIRED, batch.expired),
            (&self.failed, FAILED, batch.failed),
            (&self.dead_marked, DEAD_MARKED, batch.dead),
        ] {
            counter.fetch_add(n as u64, Ordering::Relaxed);
            metrics::counter!(name, "schema" => self.schema.clone()).increment(n as u64);
        }
    }

    /// Counts a batch rolled back because a store was unavailable.
    pub(crate) fn outage(&self) {
        self.outages.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(OUTAGES, "schema" => self.schema.clone()).increment(1);
    }

    /// Keeps gauges just read.
    pub(crate) fn gauges(&self, gauges: &Gauges) {
        self.backlog.store(gauges.backlog, Ordering::Relaxed);
        self.dead.store(gauges.dead, Ordering::Relaxed);
        self.lag
            .store(gauges.lag_seconds.to_bits(), Ordering::Relaxed);
        let schema = &self.schema;
        metrics::gauge!("idem_relay_backlog", "schema" => schema.clone())
            .set(gauges.backlog as f64);
        metrics::gauge!("idem_relay_dead", "schema" => schema.clone()).set(gauges.dead as f64);
        metrics::gauge!("idem_relay_lag_seconds", "schema" => schema.clone())
            .set(gauges.lag_seconds);
    }

    /// The counters and the gauges as last read.
    pub(crate) fn snapshot(&self) -> RelayMetrics {
        RelayMetrics {
            relayed_total: self.relayed.load(Ordering::Relaxed),
            expired_total: self.expired.load(Ordering::Relaxed),
            failed_total: self.failed.load(Ordering::Relaxed),
            dead_marked_total: self.dead_marked.load(Ordering::Relaxed),
            outages_total: self.outages.load(Ordering::Relaxed),
            dead: self.dead.load(Ordering::Relaxed),
            backlog: self.backlog.load(Ordering::Relaxed),
            lag_seconds: f64::from_bits(self.lag.load(Ordering::Relaxed)),
        }
    }
}
