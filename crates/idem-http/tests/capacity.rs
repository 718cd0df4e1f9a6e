//! The in-memory store at its capacity, over real HTTP: a new key is refused with 503
//! problem+json and `Retry-After` (the store's `Error::Unavailable`), the handler does not
//! run, and the keys already stored still replay.

use idem_core::{Idem, MemoryCapacity, MemoryStore};
use idem_http::{Config, Outcome};

mod support;

use support::*;

#[tokio::test]
async fn a_full_memory_store_refuses_new_keys_with_503_and_still_replays() {
    let store = MemoryStore::new().with_capacity(MemoryCapacity::default().with_records(2));
    let (server, runs, outcomes) = serve_pay(Idem::new(store), Config::default()).await;
    let mut stored = Vec::new();
    for key in ["k1", "k2"] {
        let reply = server
            .post("/pay", &[("idempotency-key", key), JSON], "{}")
            .await;
        assert_eq!(reply.status, 201, "{reply:?}");
        stored.push(reply);
    }
    let refused = server
        .post("/pay", &[("idempotency-key", "k3"), JSON], "{}")
        .await;
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(refused.problem_type(), "urn:idem:problem:store-unavailable");
    assert!(refused.header("retry-after").is_some(), "{refused:?}");
    assert_eq!(runs.get(), 2, "the handler ran for a refused key");
    assert_eq!(outcomes.count(Outcome::StoreError), 1);
    let again = server
        .post("/pay", &[("idempotency-key", "k1"), JSON], "{}")
        .await;
    again.assert_replay_of(&stored[0]);
    assert_eq!(runs.get(), 2);
}
