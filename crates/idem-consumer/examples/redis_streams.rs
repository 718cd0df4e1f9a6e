//! An idempotent Redis Streams worker: each payment is charged once, however many times its
//! entry is added or delivered.
//!
//! ```text
//! cargo run -p idem-consumer --features redis-streams --example redis_streams
//! ```
//!
//! It connects to `REDIS_URL` (default `redis://127.0.0.1:6379`), adds five entries for three
//! payments to a stream of its own (a publisher that retried adds a payment twice, with the
//! same `x-idempotency-key` as the HTTP request that created it), consumes them for two
//! seconds or until Ctrl-C, prints what happened, and deletes its streams.

mod shared;

use idem_consumer::redis_streams::{publish, Topology, Worker};
use idem_core::Key;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_string());
    let client = redis::Client::open(url)?;
    let mut conn = client.get_connection_manager().await?;

    // Stream idem-example-payments-<pid>, its group "idem" and its dead-letter stream
    // idem-example-payments-<pid>.dead.
    let topology = Topology::new(format!("idem-example-payments-{}", std::process::id()));
    topology.declare(&mut conn).await?;

    // The request's idempotency key travels in a field (see `shared::PAYMENTS`).
    for (key, amount) in shared::PAYMENTS {
        let payload = shared::payment(amount);
        let key = Key::new(key)?;
        publish(&mut conn, &topology.stream, payload.as_bytes(), &key, None).await?;
    }

    let summary = Worker::new(shared::consumer()?, topology.clone())
        .run(&client, shared::charge, shared::stop())
        .await?;
    shared::report(&summary, "entries acknowledged");
    topology.delete(&mut conn).await?;
    Ok(())
}
