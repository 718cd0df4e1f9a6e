//! The state machine's `begin` rule, as a pure function: what a store does with a `begin`
//! given the record it found. [`crate::MemoryStore`] runs it as is; the Redis store's
//! `begin` (`SET .. NX GET`, then a compare-and-set for a takeover) and the PostgreSQL
//! statement (`begin.sql`) are the same rule
//! written in their own languages, and the conformance cases and the model check
//! (`idem-testkit`) hold all of them to it.

use std::time::Duration;

use crate::fingerprint::Fingerprint;
use crate::record::FencingToken;

/// The live record a `begin` finds (an expired one counts as absent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    /// The fingerprint of the request that made the record.
    pub fingerprint: Fingerprint,
    /// Its acquisitions so far.
    pub attempt: u32,
    /// In progress under a lease (its token, and its deadline by the store's clock), or
    /// completed.
    pub lease: Option<(FencingToken, Duration)>,
}

/// What the store must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BeginStep {
    /// No record: insert one in progress under the request's token, attempt 1.
    Insert,
    /// Another request made the record: answer mismatch, change nothing.
    Mismatch,
    /// Completed: replay it, change nothing.
    Replay,
    /// In progress under the request's own token (its reply was lost): hand the same lease
    /// back, with `remaining` of it left.
    SameAttempt {
        /// Time left on the lease.
        remaining: Duration,
    },
    /// In progress under a live lease: answer in flight, change nothing.
    InFlight {
        /// Time left on the holder's lease.
        retry_after: Duration,
    },
    /// In progress under a lease that expired: replace the token with the request's, count
    /// this `attempt`, set a new deadline.
    TakeOver {
        /// The new attempt (the old one plus one, saturating).
        attempt: u32,
    },
}

/// The `begin` rule. `now` is the store's clock, the one the deadline was set by.
pub fn decide_begin(
    found: Option<&Found>,
    fingerprint: Fingerprint,
    token: FencingToken,
    now: Duration,
) -> BeginStep {
    let Some(found) = found else {
        return BeginStep::Insert;
    };
    if found.fingerprint != fingerprint {
        return BeginStep::Mismatch;
    }
    match found.lease {
        None => BeginStep::Replay,
        Some((held, deadline)) if held == token => BeginStep::SameAttempt {
            remaining: deadline.saturating_sub(now),
        },
        Some((_, deadline)) if deadline > now => BeginStep::InFlight {
            retry_after: deadline - now,
        },
        Some(_) => BeginStep::TakeOver {
            attempt: found.attempt.saturating_add(1),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_branch() {
        let (fp, other_fp) = (Fingerprint::of_bytes(b"a"), Fingerprint::of_bytes(b"b"));
        let (mine, theirs) = (FencingToken::random(), FencingToken::random());
        let s = Duration::from_secs;
        let held = |token, deadline| Found {
            fingerprint: fp,
            attempt: 2,
            lease: Some((token, deadline)),
        };
        assert_eq!(decide_begin(None, fp, mine, s(5)), BeginStep::Insert);
        let done = Found {
            fingerprint: fp,
            attempt: 1,
            lease: None,
        };
        assert_eq!(
            decide_begin(Some(&done), other_fp, mine, s(5)),
            BeginStep::Mismatch
        );
        assert_eq!(decide_begin(Some(&done), fp, mine, s(5)), BeginStep::Replay);
        assert_eq!(
            decide_begin(Some(&held(mine, s(9))), fp, mine, s(5)),
            BeginStep::SameAttempt { remaining: s(4) }
        );
        assert_eq!(
            decide_begin(Some(&held(theirs, s(9))), fp, mine, s(5)),
            BeginStep::InFlight { retry_after: s(4) }
        );
        // A deadline equal to now has passed.
        assert_eq!(
            decide_begin(Some(&held(theirs, s(5))), fp, mine, s(5)),
            BeginStep::TakeOver { attempt: 3 }
        );
        // Another fingerprint is a mismatch even on an expired lease.
        assert_eq!(
            decide_begin(Some(&held(theirs, s(1))), other_fp, mine, s(5)),
            BeginStep::Mismatch
        );
    }
}
