//! Model-based property test of the state machine on `MemoryStore`.
//!
//! Random interleavings of begin / complete / fail / release / extend / time passing, by
//! several workers on a few keys, are run against the store and against a plain model of the
//! contract; every answer must agree. On top of that, two properties are checked directly:
//! the protected work runs at most once per lease incarnation (a worker "runs" the work only
//! when `begin` hands it a lease, and every lease's token is new), and no completion from a
//! lost lease is ever visible (every replay is the completion of the lease that held the key
//! when it completed).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    Begin, BeginRequest, Completion, CompletionKind, Error, FencingToken, Fingerprint, Key, Lease,
    ManualClock, MemoryStore, RecordId, Response, Scope, Store,
};
use proptest::prelude::*;

const WORKERS: usize = 3;
const KEYS: usize = 2;
const RETENTION: Duration = Duration::from_millis(50);

#[derive(Debug, Clone)]
enum Op {
    Begin {
        worker: usize,
        key: usize,
        fp: u8,
        lease_ms: u64,
    },
    Complete {
        worker: usize,
        key: usize,
    },
    Fail {
        worker: usize,
        key: usize,
    },
    Release {
        worker: usize,
        key: usize,
    },
    Extend {
        worker: usize,
        key: usize,
        by_ms: u64,
    },
    Advance {
        ms: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let w = 0..WORKERS;
    let k = 0..KEYS;
    prop_oneof![
        3 => (w.clone(), k.clone(), 0..2u8, 5..40u64)
            .prop_map(|(worker, key, fp, lease_ms)| Op::Begin { worker, key, fp, lease_ms }),
        2 => (w.clone(), k.clone()).prop_map(|(worker, key)| Op::Complete { worker, key }),
        1 => (w.clone(), k.clone()).prop_map(|(worker, key)| Op::Fail { worker, key }),
        1 => (w.clone(), k.clone()).prop_map(|(worker, key)| Op::Release { worker, key }),
        1 => (w, k, 5..40u64).prop_map(|(worker, key, by_ms)| Op::Extend { worker, key, by_ms }),
        2 => (0..60u64).prop_map(|ms| Op::Advance { ms }),
    ]
}

/// The model's view of one key.
#[derive(Debug, Clone)]
enum Model {
    InProgress {
        fp: u8,
        token: FencingToken,
        deadline: Duration,
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
}

fn fingerprint(fp: u8) -> Fingerprint {
    Fingerprint::of_bytes(&[fp])
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let clock = ManualClock::new();
        let store = MemoryStore::with_clock(Arc::new(clock.clone()));
        let ids: Vec<RecordId> = (0..KEYS)
            .map(|k| RecordId::new(Scope::global(), Key::new(format!("k{k}")).expect("key")))
            .collect();
        let mut model: Vec<Option<Model>> = vec![None; KEYS];
        let mut now = Duration::ZERO;
        // The latest lease each worker holds for each key.
        let mut leases: HashMap<(usize, usize), Lease> = HashMap::new();
        // Every token ever handed out: a new lease must never reuse one.
        let mut tokens: HashSet<FencingToken> = HashSet::new();
        let mut seq = 0u64;

        for op in ops {
            match op {
                Op::Advance { ms } => {
                    clock.advance(Duration::from_millis(ms));
                    now += Duration::from_millis(ms);
                }
                Op::Begin { worker, key, fp, lease_ms } => {
                    let lease = Duration::from_millis(lease_ms);
                    let token = FencingToken::random();
                    let answer = store
                        .begin(BeginRequest {
                            id: &ids[key],
                            fingerprint: fingerprint(fp),
                            token,
                            lease,
                            retention: RETENTION,
                        })
                        .await
                        .expect("memory store never fails");
                    let fresh = |attempt| Model::InProgress {
                        fp,
                        token,
                        deadline: now + lease,
                        attempt,
                        expiry: now + lease + RETENTION,
                    };
                    match (&model[key], answer) {
                        (None, Begin::Acquired(l)) => {
                            prop_assert_eq!(l.attempt(), 1);
                            prop_assert!(tokens.insert(l.token()), "token reused");
                            leases.insert((worker, key), l);
                            model[key] = Some(fresh(1));
                        }
                        (Some(m), Begin::Mismatch) => {
                            let stored = match m {
                                Model::InProgress { fp, .. } | Model::Completed { fp, .. } => *fp,
                            };
                            prop_assert_ne!(stored, fp);
                        }
                        (Some(Model::Completed { fp: f, completion, .. }), Begin::Replay(r)) => {
                            prop_assert_eq!(*f, fp);
                            prop_assert_eq!(&r.completion, completion);
                        }
                        (Some(Model::InProgress { fp: f, deadline, .. }), Begin::InFlight { retry_after }) => {
                            prop_assert_eq!(*f, fp);
                            prop_assert!(*deadline > now);
                            prop_assert_eq!(retry_after, *deadline - now);
                        }
                        (Some(Model::InProgress { fp: f, deadline, attempt, .. }), Begin::TookOver(l)) => {
                            prop_assert_eq!(*f, fp);
                            prop_assert!(*deadline <= now, "took over a live lease");
                            prop_assert_eq!(l.attempt(), attempt + 1);
                            prop_assert!(tokens.insert(l.token()), "token reused");
                            let attempt = attempt + 1;
                            leases.insert((worker, key), l);
                            model[key] = Some(fresh(attempt));
                        }
                        (m, answer) => {
                            prop_assert!(false, "store answered {answer:?} where the model holds {m:?}");
                        }
                    }
                }
                Op::Complete { worker, key } | Op::Fail { worker, key } => {
                    let Some(lease) = leases.get(&(worker, key)) else { continue };
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
                    let result = store.complete(lease, &completion, RETENTION).await;
                    match &model[key] {
                        Some(Model::InProgress { fp, token, .. }) if *token == lease.token() => {
                            prop_assert!(result.is_ok(), "holder's complete refused: {result:?}");
                            model[key] = Some(Model::Completed {
                                fp: *fp,
                                completion,
                                expiry: now + RETENTION,
                            });
                        }
                        _ => prop_assert!(matches!(result, Err(Error::LeaseLost)), "stale complete: {result:?}"),
                    }
                }
                Op::Release { worker, key } => {
                    let Some(lease) = leases.get(&(worker, key)) else { continue };
                    let result = store.release(lease).await;
                    match &model[key] {
                        Some(Model::InProgress { token, .. }) if *token == lease.token() => {
                            prop_assert!(result.is_ok(), "holder's release refused: {result:?}");
                            model[key] = None;
                        }
                        _ => prop_assert!(matches!(result, Err(Error::LeaseLost)), "stale release: {result:?}"),
                    }
                }
                Op::Extend { worker, key, by_ms } => {
                    let Some(lease) = leases.get(&(worker, key)).cloned() else { continue };
                    let by = Duration::from_millis(by_ms);
                    let result = store.extend(&lease, by).await;
                    match &mut model[key] {
                        Some(Model::InProgress { token, deadline, expiry, .. }) if *token == lease.token() => {
                            let renewed = result.map_err(|e| TestCaseError::fail(format!("holder's extend refused: {e}")))?;
                            prop_assert_eq!(renewed.token(), lease.token());
                            let new_deadline = now + by;
                            *expiry += new_deadline.saturating_sub(*deadline);
                            *deadline = new_deadline;
                            leases.insert((worker, key), renewed);
                        }
                        _ => prop_assert!(matches!(result, Err(Error::LeaseLost)), "stale extend: {result:?}"),
                    }
                }
            }
            // Expiry: the model forgets what the store must have forgotten.
            for slot in model.iter_mut() {
                if slot.as_ref().is_some_and(|m| m.expiry() <= now) {
                    *slot = None;
                }
            }
            // What the store shows must be what the model holds.
            for (key, id) in ids.iter().enumerate() {
                let record = store.get(id).await.expect("get");
                match (&model[key], record) {
                    (None, None) => {}
                    (Some(Model::InProgress { token, attempt, .. }), Some(r)) => {
                        prop_assert_eq!(r.attempt, *attempt);
                        let held = matches!(r.state, idem_core::RecordState::InProgress { token: t, .. } if t == *token);
                        prop_assert!(held, "store shows another holder: {:?}", r.state);
                    }
                    (Some(Model::Completed { completion, .. }), Some(r)) => {
                        prop_assert_eq!(r.state, idem_core::RecordState::Completed(completion.clone()));
                    }
                    (m, r) => prop_assert!(false, "store holds {r:?} where the model holds {m:?}"),
                }
            }
        }
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn store_follows_the_model(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops)?;
    }
}
