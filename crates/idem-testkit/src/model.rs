//! A model-based property check of the [`Store`] contract, for every store.
//!
//! Random interleavings of begin / complete / fail / release / extend / time passing, by
//! several workers on a few keys, run against the store and against a plain model of the
//! contract; every answer must agree. Two properties are checked on top: a lease is handed
//! out only with a token never seen before (so the protected work runs at most once per lease
//! incarnation), and no completion from a lost lease is ever visible (every replay is the
//! completion of the lease that held the key when it completed).
//!
//! Time comes in two kinds ([`Time`]):
//!
//! - **Manual**: the store runs on a [`ManualClock`] that the check advances, so every
//!   deadline and expiry is predicted exactly (the in-memory store; 512 cases).
//! - **Real**: the store keeps its own clock (a server's). The check sleeps to let time pass
//!   and brackets every call between the instants it was sent and answered. A lease deadline
//!   that falls inside that bracket may be judged either way by the store, so the check then
//!   accepts either answer and follows the store; outside it, the answer is forced. Records
//!   are kept for ten minutes, so nothing expires during a case (the conformance cases check
//!   expiry on every store).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    Begin, BeginRequest, Completion, CompletionKind, Error, FencingToken, Fingerprint, Key, Lease,
    ManualClock, MemoryStore, RecordId, RecordState, Response, Scope, Store,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tokio::time::Instant;

const WORKERS: usize = 3;
const KEYS: usize = 2;

/// How time passes in a case, and so how exact the check can be. See the [module](self).
#[derive(Debug, Clone)]
pub enum Time {
    /// The store runs on this clock, which the check advances.
    Manual(ManualClock),
    /// The store runs on its own clock; the check sleeps.
    Real,
}

impl Time {
    /// Durations in a real-time case are this many times longer than in a manual one, so that
    /// a lease is long against a round trip to a loaded server.
    fn scale(&self) -> u32 {
        match self {
            Time::Manual(_) => 1,
            Time::Real => 5,
        }
    }

    fn retention(&self) -> Duration {
        match self {
            Time::Manual(_) => Duration::from_millis(50),
            Time::Real => Duration::from_secs(600),
        }
    }
}

/// One step of a case.
#[derive(Debug, Clone)]
pub enum Op {
    /// A worker begins a key with one of two fingerprints and a lease of `lease_ms`.
    Begin {
        /// Which worker.
        worker: usize,
        /// Which key.
        key: usize,
        /// Which of two requests.
        fp: u8,
        /// The lease asked for, in milliseconds (scaled by the kind of time).
        lease_ms: u64,
    },
    /// A worker completes its latest lease on a key.
    Complete {
        /// Which worker.
        worker: usize,
        /// Which key.
        key: usize,
    },
    /// A worker stores a terminal failure with its latest lease on a key.
    Fail {
        /// Which worker.
        worker: usize,
        /// Which key.
        key: usize,
    },
    /// A worker releases its latest lease on a key.
    Release {
        /// Which worker.
        worker: usize,
        /// Which key.
        key: usize,
    },
    /// A worker extends its latest lease on a key by `by_ms`.
    Extend {
        /// Which worker.
        worker: usize,
        /// Which key.
        key: usize,
        /// The new lease, in milliseconds (scaled).
        by_ms: u64,
    },
    /// Time passes.
    Advance {
        /// How long, in milliseconds (scaled).
        ms: u64,
    },
}

/// Cases of 1 to `max_ops` steps.
pub fn ops(max_ops: usize) -> impl Strategy<Value = Vec<Op>> {
    let w = 0..WORKERS;
    let k = 0..KEYS;
    let op = prop_oneof![
        3 => (w.clone(), k.clone(), 0..2u8, 5..40u64)
            .prop_map(|(worker, key, fp, lease_ms)| Op::Begin { worker, key, fp, lease_ms }),
        2 => (w.clone(), k.clone()).prop_map(|(worker, key)| Op::Complete { worker, key }),
        1 => (w.clone(), k.clone()).prop_map(|(worker, key)| Op::Fail { worker, key }),
        1 => (w.clone(), k.clone()).prop_map(|(worker, key)| Op::Release { worker, key }),
        1 => (w, k, 5..40u64).prop_map(|(worker, key, by_ms)| Op::Extend { worker, key, by_ms }),
        2 => (0..60u64).prop_map(|ms| Op::Advance { ms }),
    ];
    proptest::collection::vec(op, 1..max_ops)
}

/// An instant of the case, as time since it started: exact under [`Time::Manual`], bracketed
/// by a call's send and answer under [`Time::Real`].
#[derive(Debug, Clone, Copy)]
struct Span {
    sent: Duration,
    answered: Duration,
}

/// The model's view of one key.
#[derive(Debug, Clone)]
enum Model {
    InProgress {
        fp: u8,
        token: FencingToken,
        /// The store set the deadline somewhere in here.
        deadline: Span,
        lease: Duration,
        attempt: u32,
        expiry: Duration,
    },
    Completed {
        fp: u8,
        completion: Completion,
        expiry: Duration,
    },
}

impl Model {
    fn expiry(&self) -> Duration {
        match self {
            Model::InProgress { expiry, .. } | Model::Completed { expiry, .. } => *expiry,
        }
    }

    fn fp(&self) -> u8 {
        match self {
            Model::InProgress { fp, .. } | Model::Completed { fp, .. } => *fp,
        }
    }
}

/// The case's clock: where "now" is, and how to let time pass.
struct CaseClock<'a> {
    time: &'a Time,
    start: Instant,
    manual_now: Duration,
}

impl CaseClock<'_> {
    fn now(&self) -> Duration {
        match self.time {
            Time::Manual(_) => self.manual_now,
            Time::Real => self.start.elapsed(),
        }
    }

    async fn advance(&mut self, by: Duration) {
        match self.time {
            Time::Manual(clock) => {
                clock.advance(by);
                self.manual_now += by;
            }
            Time::Real => tokio::time::sleep(by).await,
        }
    }

    /// Runs one store call and brackets it.
    async fn call<T>(&self, call: impl Future<Output = T>) -> (T, Span) {
        let sent = self.now();
        let answer = call.await;
        (
            answer,
            Span {
                sent,
                answered: self.now(),
            },
        )
    }
}

/// Whether the store must have seen a lease set within `deadline` (plus `lease`) as live, or
/// as expired, during `call`; `None` when the deadline falls inside the call's bracket.
fn lease_live(deadline: Span, lease: Duration, call: Span) -> Option<bool> {
    if call.answered < deadline.sent + lease {
        Some(true)
    } else if call.sent >= deadline.answered + lease {
        Some(false)
    } else {
        None
    }
}

fn fingerprint(fp: u8) -> Fingerprint {
    Fingerprint::of_bytes(&[fp])
}

/// Runs one case against `store`, whose records live in `scope` (a scope of the case's own,
/// so cases can share a store).
///
/// # Errors
///
/// The first disagreement between the store and the model.
pub async fn follow(
    store: &dyn Store,
    time: &Time,
    scope: &Scope,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let scale = time.scale();
    let retention = time.retention();
    let ids: Vec<RecordId> = (0..KEYS)
        .map(|k| RecordId::new(scope.clone(), Key::new(format!("k{k}")).expect("key")))
        .collect();
    let mut clock = CaseClock {
        time,
        start: Instant::now(),
        manual_now: Duration::ZERO,
    };
    let mut model: Vec<Option<Model>> = vec![None; KEYS];
    // The latest lease each worker holds for each key.
    let mut leases: HashMap<(usize, usize), Lease> = HashMap::new();
    // Every token ever handed out: a new lease must never reuse one.
    let mut tokens: HashSet<FencingToken> = HashSet::new();
    let mut seq = 0u64;
    let ms = |ms: u64| Duration::from_millis(ms) * scale;

    for op in ops {
        match *op {
            Op::Advance { ms: by } => clock.advance(ms(by)).await,
            Op::Begin {
                worker,
                key,
                fp,
                lease_ms,
            } => {
                let lease = ms(lease_ms);
                let token = FencingToken::random();
                let (answer, span) = clock
                    .call(store.begin(BeginRequest {
                        id: &ids[key],
                        fingerprint: fingerprint(fp),
                        token,
                        lease,
                        retention,
                    }))
                    .await;
                let answer =
                    answer.map_err(|e| TestCaseError::fail(format!("begin failed: {e}")))?;
                let fresh = |attempt| Model::InProgress {
                    fp,
                    token,
                    deadline: span,
                    lease,
                    attempt,
                    expiry: span.sent + lease + retention,
                };
                match (&model[key], answer) {
                    (None, Begin::Acquired(l)) => {
                        prop_assert_eq!(l.attempt(), 1);
                        prop_assert!(tokens.insert(l.token()), "token reused");
                        leases.insert((worker, key), l);
                        model[key] = Some(fresh(1));
                    }
                    (Some(m), Begin::Mismatch) => prop_assert_ne!(m.fp(), fp),
                    (
                        Some(Model::Completed {
                            fp: f, completion, ..
                        }),
                        Begin::Replay(r),
                    ) => {
                        prop_assert_eq!(*f, fp);
                        prop_assert_eq!(&r.completion, completion);
                    }
                    (
                        Some(Model::InProgress {
                            fp: f,
                            deadline,
                            lease: held,
                            ..
                        }),
                        Begin::InFlight { retry_after },
                    ) => {
                        prop_assert_eq!(*f, fp);
                        let live = lease_live(*deadline, *held, span);
                        prop_assert!(live != Some(false), "an expired lease reported in flight");
                        if let Time::Manual(_) = time {
                            prop_assert_eq!(retry_after, deadline.sent + *held - span.sent);
                        } else {
                            prop_assert!(retry_after <= *held, "{retry_after:?} left of {held:?}");
                        }
                    }
                    (
                        Some(Model::InProgress {
                            fp: f,
                            deadline,
                            lease: held,
                            attempt,
                            ..
                        }),
                        Begin::TookOver(l),
                    ) => {
                        prop_assert_eq!(*f, fp);
                        let live = lease_live(*deadline, *held, span);
                        prop_assert!(live != Some(true), "took over a live lease");
                        prop_assert_eq!(l.attempt(), attempt + 1);
                        prop_assert!(tokens.insert(l.token()), "token reused");
                        let attempt = attempt + 1;
                        leases.insert((worker, key), l);
                        model[key] = Some(fresh(attempt));
                    }
                    (m, answer) => {
                        prop_assert!(
                            false,
                            "store answered {answer:?} where the model holds {m:?}"
                        );
                    }
                }
            }
            Op::Complete { worker, key } | Op::Fail { worker, key } => {
                let Some(lease) = leases.get(&(worker, key)) else {
                    continue;
                };
                seq += 1;
                let kind = if matches!(op, Op::Fail { .. }) {
                    CompletionKind::Failed
                } else {
                    CompletionKind::Succeeded
                };
                let completion = Completion {
                    kind,
                    response: Response::new(200, Bytes::from(format!("w{worker}-{seq}"))),
                };
                let (result, span) = clock
                    .call(store.complete(lease, &completion, retention))
                    .await;
                match &model[key] {
                    Some(Model::InProgress { fp, token, .. }) if *token == lease.token() => {
                        prop_assert!(result.is_ok(), "holder's complete refused: {result:?}");
                        model[key] = Some(Model::Completed {
                            fp: *fp,
                            completion,
                            expiry: span.sent + retention,
                        });
                    }
                    _ => prop_assert!(
                        matches!(result, Err(Error::LeaseLost)),
                        "stale complete: {result:?}"
                    ),
                }
            }
            Op::Release { worker, key } => {
                let Some(lease) = leases.get(&(worker, key)) else {
                    continue;
                };
                let (result, _) = clock.call(store.release(lease)).await;
                match &model[key] {
                    Some(Model::InProgress { token, .. }) if *token == lease.token() => {
                        prop_assert!(result.is_ok(), "holder's release refused: {result:?}");
                        model[key] = None;
                    }
                    _ => prop_assert!(
                        matches!(result, Err(Error::LeaseLost)),
                        "stale release: {result:?}"
                    ),
                }
            }
            Op::Extend { worker, key, by_ms } => {
                let Some(lease) = leases.get(&(worker, key)).cloned() else {
                    continue;
                };
                let by = ms(by_ms);
                let (result, span) = clock.call(store.extend(&lease, by)).await;
                match &mut model[key] {
                    Some(Model::InProgress {
                        token,
                        deadline,
                        lease: held,
                        expiry,
                        ..
                    }) if *token == lease.token() => {
                        let renewed = result.map_err(|e| {
                            TestCaseError::fail(format!("holder's extend refused: {e}"))
                        })?;
                        prop_assert_eq!(renewed.token(), lease.token());
                        // The record's expiry moves by as much as the deadline did (exact
                        // under a manual clock, the only kind where records expire here).
                        let (old, new) = (deadline.sent + *held, span.sent + by);
                        *expiry += new.saturating_sub(old);
                        *deadline = span;
                        *held = by;
                        leases.insert((worker, key), renewed);
                    }
                    _ => prop_assert!(
                        matches!(result, Err(Error::LeaseLost)),
                        "stale extend: {result:?}"
                    ),
                }
            }
        }
        // Expiry: the model forgets what the store must have forgotten.
        let now = clock.now();
        for slot in model.iter_mut() {
            if slot.as_ref().is_some_and(|m| m.expiry() <= now) {
                *slot = None;
            }
        }
        // What the store shows must be what the model holds.
        for (key, id) in ids.iter().enumerate() {
            let record = store
                .get(id)
                .await
                .map_err(|e| TestCaseError::fail(format!("get failed: {e}")))?;
            match (&model[key], record) {
                (None, None) => {}
                (Some(Model::InProgress { token, attempt, .. }), Some(r)) => {
                    prop_assert_eq!(r.attempt, *attempt);
                    let held =
                        matches!(r.state, RecordState::InProgress { token: t, .. } if t == *token);
                    prop_assert!(held, "store shows another holder: {:?}", r.state);
                }
                (Some(Model::Completed { completion, .. }), Some(r)) => {
                    prop_assert_eq!(r.state, RecordState::Completed(completion.clone()));
                }
                (m, r) => prop_assert!(false, "store holds {r:?} where the model holds {m:?}"),
            }
        }
    }
    Ok(())
}

fn runner(cases: u32, max_shrink_iters: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        max_shrink_iters,
        // Cases run against live servers and fresh scopes: a saved seed file next to the
        // caller's source would replay nothing useful.
        failure_persistence: None,
        ..Config::default()
    })
}

/// The check on [`MemoryStore`] under a manual clock: `cases` cases of up to 80 steps, every
/// deadline exact.
///
/// # Panics
///
/// On the first case the store fails, with the smallest failing case found.
pub fn check_manual_clock(cases: u32) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let result = runner(cases, 1024).run(&ops(80), |ops| {
        rt.block_on(async {
            let clock = ManualClock::new();
            let store = MemoryStore::with_clock(Arc::new(clock.clone()));
            follow(&store, &Time::Manual(clock), &Scope::global(), &ops).await
        })
    });
    if let Err(e) = result {
        panic!("the memory store left the model on a manual clock: {e}");
    }
}

/// The check on a store that keeps its own clock (a real server): `store` makes it (or
/// returns `None` when its server is missing: the check is then skipped, as the conformance
/// cases are), and `cases` cases of up to 40 steps run on it, each in a scope of its own.
///
/// # Panics
///
/// On the first case the store fails, with the smallest failing case found.
pub fn check_real_clock<F, Fut>(cases: u32, store: F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Option<Arc<dyn Store>>>,
{
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let Some(store) = rt.block_on(store()) else {
        return;
    };
    // Shrinking re-runs the case against the server: keep it bounded.
    let result = runner(cases, 64).run(&ops(40), |ops| {
        let scope =
            Scope::new(format!("model-{}", uuid::Uuid::new_v4().simple())).expect("a valid scope");
        rt.block_on(follow(store.as_ref(), &Time::Real, &scope, &ops))
    });
    if let Err(e) = result {
        panic!("the {} store left the model: {e}", store.name());
    }
}
