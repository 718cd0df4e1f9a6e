//! The conformance suite on the test-only cross-process `FileStore` that the crash test of
//! `tests/rabbitmq.rs` uses, so that test rests on a store that keeps the contract.

mod support;

mod file {
    use std::sync::Arc;

    use idem_core::Store;

    use crate::support::file_store::FileStore;

    async fn store() -> Option<Arc<dyn Store>> {
        Some(Arc::new(
            FileStore::temporary().expect("a temporary directory"),
        ))
    }

    async fn unreachable() -> Arc<dyn Store> {
        // A directory under a regular file can never be opened.
        Arc::new(FileStore::at("/dev/null/idem"))
    }

    idem_testkit::conformance_suite!(store, unreachable = unreachable);
}
