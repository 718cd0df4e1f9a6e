//! The conformance suite on the embedded in-memory store.

mod memory {
    use std::sync::Arc;

    use idem_core::{MemoryStore, Store};

    async fn store() -> Option<Arc<dyn Store>> {
        Some(Arc::new(MemoryStore::new()))
    }

    idem_testkit::conformance_suite!(store);

    #[tokio::test]
    async fn stats_count_by_state() {
        idem_testkit::cases::stats_count_by_state(Arc::new(MemoryStore::new())).await;
    }
}
