//! The random bytes of fencing tokens: from the operating system's CSPRNG, as with
//! `Uuid::new_v4`, but drawn [`TOKENS`] tokens at a time, in one `getrandom` call per
//! thread, rather than one call per token (measured: 31 ns a token against 234, plus 96 ns
//! for the fork check below).
//!
//! A forked child starts with a copy of its parent's buffers, and the two would hand out the
//! same tokens. Each buffer therefore remembers the id of the process that filled it and is
//! refilled when that id changed: `std::process::id()` is a system call of its own, but
//! needs no `unsafe` (a `pthread_atfork` handler would). A fork whose child has the parent's
//! id (only a child made with `CLONE_NEWPID` by a process that is itself its namespace's
//! first, without `exec`) is not told apart.

use std::cell::RefCell;

/// Tokens per `getrandom` call.
const TOKENS: usize = 32;
const BYTES: usize = 16 * TOKENS;

struct Pool {
    bytes: [u8; BYTES],
    /// The next unused byte; `BYTES` when the pool is empty.
    next: usize,
    /// The process that filled the pool.
    pid: u32,
}

thread_local! {
    static POOL: RefCell<Pool> = const {
        RefCell::new(Pool { bytes: [0; BYTES], next: BYTES, pid: 0 })
    };
}

/// 16 fresh random bytes, or `None` when the system's generator failed (the caller then
/// draws another way).
pub(crate) fn token_bytes() -> Option<[u8; 16]> {
    take(std::process::id())
}

fn take(pid: u32) -> Option<[u8; 16]> {
    POOL.try_with(|pool| {
        let mut pool = pool.try_borrow_mut().ok()?;
        if pool.next == BYTES || pool.pid != pid {
            getrandom::fill(&mut pool.bytes).ok()?;
            pool.next = 0;
            pool.pid = pid;
        }
        let at = pool.next;
        let mut out = [0; 16];
        out.copy_from_slice(&pool.bytes[at..at + 16]);
        // No copy of a token handed out stays behind.
        pool.bytes[at..at + 16].fill(0);
        pool.next = at + 16;
        Some(out)
    })
    .ok()
    .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn tokens_never_repeat_across_refills_and_threads() {
        let draw = || {
            (0..10 * TOKENS)
                .map(|_| token_bytes().unwrap())
                .collect::<Vec<_>>()
        };
        let mut seen = HashSet::new();
        for bytes in draw() {
            assert!(seen.insert(bytes));
        }
        let other = std::thread::spawn(draw).join().unwrap();
        for bytes in other {
            assert!(seen.insert(bytes));
        }
    }

    #[test]
    fn tokens_are_version_4_uuids() {
        let token = crate::FencingToken::random();
        assert_eq!(token.as_uuid().get_version_num(), 4);
        assert_eq!(token.as_uuid().get_variant(), uuid::Variant::RFC4122);
        assert_ne!(token, crate::FencingToken::random());
    }

    /// A process of another id (a forked child) never gets what is left in the pool it
    /// inherited.
    #[test]
    fn another_process_refills() {
        let pid = std::process::id();
        take(pid).unwrap();
        let left: Vec<[u8; 16]> = POOL.with(|pool| {
            let pool = pool.borrow();
            pool.bytes[pool.next..]
                .chunks(16)
                .map(|c| c.try_into().unwrap())
                .collect()
        });
        assert_eq!(left.len(), TOKENS - 1);
        let child = take(pid.wrapping_add(1)).unwrap();
        assert!(
            !left.contains(&child),
            "the child got a token its parent holds"
        );
        // And the parent, back in its own process, does not reuse the child's pool either.
        let parent = take(pid).unwrap();
        assert!(!left.contains(&parent) && parent != child);
    }
}
