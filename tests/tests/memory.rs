//! The conformance suite on the embedded in-memory store, and the model check on a manual
//! clock (every deadline and expiry predicted exactly).

mod memory {
    use std::sync::Arc;

    use idem_core::{MemoryStore, Store};

    async fn store() -> Option<Arc<dyn Store>> {
        Some(Arc::new(MemoryStore::new()))
    }

    idem_testkit::conformance_suite!(store, stats);

    /// 512 random interleavings against the model, on a manual clock.
    #[test]
    fn follows_the_model_on_a_manual_clock() {
        idem_testkit::model::check_manual_clock(512);
    }

    // Notified in process.
    idem_testkit::conformance_suite!(store, notifies);
}
