//! What a piece of work reports through the `tracing` and `metrics` facades, for tests that
//! check spans, events and metrics (feature `telemetry`).
//!
//! Each helper runs the work on a current-thread runtime of its own, one at a time in the
//! test process: tracing caches process-wide which callsites are enabled, so work run
//! without a subscriber beside work run with a scoped one can leave the latter's spans and
//! events disabled.

use std::future::Future;
use std::io::Write;
use std::sync::{Arc, Mutex, MutexGuard};

use metrics_util::debugging::{DebuggingRecorder, Snapshot};
pub use tracing::Level;
pub use tracing_subscriber::fmt::format::FmtSpan;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> MutexGuard<'static, ()> {
    // A test that failed while holding the lock poisoned it; the next one may still run.
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn block_on<F: Future>(work: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime")
        .block_on(work)
}

/// A writer the subscriber formats into, for the test to read.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `work` under a `fmt` subscriber of `level` and below that also writes the span
/// events of `spans` (say [`FmtSpan::CLOSE`], with each span's fields and timing), and
/// returns what it wrote, without colours.
///
/// # Panics
///
/// When `work` panics, or what was written is not UTF-8.
pub fn logs_of<F: Future>(level: Level, spans: FmtSpan, work: F) -> String {
    let _one = one_at_a_time();
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_span_events(spans)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, || block_on(work));
    let written = captured.0.lock().unwrap().clone();
    String::from_utf8(written).expect("UTF-8 logs")
}

/// Runs `work` with a local `metrics` recorder and returns what it recorded.
///
/// # Panics
///
/// When `work` panics.
pub fn metrics_of<F: Future>(work: F) -> Snapshot {
    let _one = one_at_a_time();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || block_on(work));
    snapshotter.snapshot()
}
