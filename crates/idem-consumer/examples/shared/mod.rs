//! What the broker examples share: the payments they publish, the handler that charges
//! them, and when the demo stops.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem_consumer::{Consumer, Context, Message, Policy, Summary};
use idem_core::{Config, Failure, Idem, KeyError, MemoryStore, Scope};

/// What `POST /payments` would publish, as (idempotency key, amount in cents): a retried
/// request publishes the same payment again, under the same key.
pub const PAYMENTS: [(&str, u32); 5] = [
    ("pay-1", 1250),
    ("pay-2", 990),
    ("pay-1", 1250),
    ("pay-3", 4000),
    ("pay-2", 990),
];

/// The JSON payload of a payment of `amount`.
pub fn payment(amount: u32) -> String {
    format!(r#"{{"amount": {amount}, "currency": "EUR"}}"#)
}

/// The charges made in this process.
static CHARGES: AtomicU32 = AtomicU32::new(0);

/// The handler: charges the payment (counted in [`CHARGES`]) and returns the charge's id.
pub async fn charge(message: Message, ctx: Context) -> Result<String, Failure<String>> {
    let payment: serde_json::Value = serde_json::from_slice(message.payload())
        .map_err(|e| Failure::Terminal(format!("not a payment: {e}")))?;
    // The provider gets a key derived from the message's, so that a retry after a crash
    // cannot charge twice at the provider either.
    let provider_key = ctx.child_key("charge-card");
    CHARGES.fetch_add(1, Ordering::SeqCst);
    println!(
        "charging {} {} for {} (attempt {}, provider key {provider_key})",
        payment["amount"],
        payment["currency"].as_str().unwrap_or("?"),
        ctx.key(),
        ctx.attempt(),
    );
    Ok(format!("ch_{}", ctx.key()))
}

/// The worker's consumer. Records live in the worker's own scope (not the HTTP requests'),
/// for 24 h by default; a lease of 30 s is renewed while a handler runs. The store is in
/// memory, right for one process only: workers in several processes must share a store
/// (Redis, PostgreSQL) so that a duplicate delivered to another process is recognised.
pub fn consumer() -> Result<Consumer, KeyError> {
    let idem = Idem::new(MemoryStore::new()).with_config(Config::default());
    Ok(Consumer::new(idem, Scope::new("payments-worker")?).with_policy(Policy::default()))
}

/// Prints what the worker did: `summary`, and the charges made.
pub fn report(summary: &Summary, settled: &str) {
    println!(
        "{} {settled}, {} charges made: {summary:?}",
        summary.acked,
        CHARGES.load(Ordering::SeqCst)
    );
}

/// Completes on Ctrl-C, or after two seconds: enough for the demo.
pub async fn stop() {
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = tokio::time::sleep(Duration::from_secs(2)) => {}
    }
}
