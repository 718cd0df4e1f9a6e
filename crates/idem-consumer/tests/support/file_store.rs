//! A test-only [`Store`] shared between processes through a directory: one JSON file per
//! record, every step serialised by an exclusive `flock` on `<dir>/.lock` (which the OS
//! releases when a process dies, even by `kill -9`), and the wall clock as the store's clock
//! (one clock for every process on this machine).
//!
//! It exists so that the crash test can kill a consumer process and let another process take
//! its keys over without a server. It is not for production: every call takes one global
//! lock and does blocking file I/O on the caller's thread. It passes the conformance suite
//! (`tests/file_store.rs`), so the crash test exercises the contract, not a shortcut.

// `File::lock` needs Rust 1.89, one release past the workspace's MSRV (1.88): only this
// test-only store uses it, and the library itself keeps the MSRV.
#![allow(clippy::incompatible_msrv)]

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use idem_core::{
    decode_meta, encode_meta, Begin, BeginRequest, Completion, Error, FencingToken, Fingerprint,
    Lease, Record, RecordId, RecordState, Replay, Store,
};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

const NAME: &str = "file";

/// See the module docs.
#[derive(Debug, Clone)]
pub struct FileStore {
    dir: PathBuf,
    _cleanup: Option<std::sync::Arc<RemoveOnDrop>>,
}

/// Removes a temporary store's directory when the last clone of the store is dropped.
#[derive(Debug)]
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

#[derive(Serialize, Deserialize)]
struct Stored {
    id: String,
    fingerprint: String,
    attempt: u32,
    /// Microseconds since the Unix epoch.
    expires_at: u64,
    state: StoredState,
}

#[derive(Serialize, Deserialize)]
enum StoredState {
    InProgress { token: String, deadline: u64 },
    Completed { meta: String, body: String },
}

impl FileStore {
    /// A store in `dir`, created if needed. Processes that open the same directory share
    /// the store.
    pub fn open(dir: impl Into<PathBuf>) -> std::io::Result<Self> {
        let dir = dir.into();
        fs::create_dir_all(&dir)?;
        Ok(Self {
            dir,
            _cleanup: None,
        })
    }

    /// A store in a new temporary directory, removed when the last clone is dropped.
    pub fn temporary() -> std::io::Result<Self> {
        let dir = std::env::temp_dir().join(format!("idem-file-store-{}", uuid::Uuid::new_v4()));
        let mut store = Self::open(&dir)?;
        store._cleanup = Some(std::sync::Arc::new(RemoveOnDrop(dir)));
        Ok(store)
    }

    /// The directory: open it in another process to share the store.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A store in `dir`, which must exist: for the conformance suite's unreachable store.
    pub fn at(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            _cleanup: None,
        }
    }

    /// Runs `step` under the store's lock.
    fn locked<R>(&self, step: impl FnOnce(&Path, u64) -> Result<R, Error>) -> Result<R, Error> {
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.dir.join(".lock"))
            .map_err(unavailable)?;
        lock.lock().map_err(unavailable)?;
        let out = step(&self.dir, now_micros());
        // Closing the file releases the lock too; unlock explicitly to say so.
        let _ = lock.unlock();
        out
    }
}

fn unavailable(e: std::io::Error) -> Error {
    Error::unavailable(NAME, e)
}

fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn path_of(dir: &Path, id: &RecordId) -> PathBuf {
    // Encoded ids can be longer than a file name may be: name files by their digest.
    let digest = Fingerprint::of_bytes(id.encoded().as_bytes()).to_hex();
    dir.join(format!("{digest}.json"))
}

/// The live record at `path`, deleting it first if it expired.
fn read(path: &Path, now: u64) -> Result<Option<Stored>, Error> {
    let bytes = match fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(unavailable(e)),
    };
    let stored: Stored = serde_json::from_slice(&bytes)
        .map_err(|e| Error::corrupt(NAME, format!("undecodable record: {e}")))?;
    if stored.expires_at <= now {
        remove(path)?;
        return Ok(None);
    }
    Ok(Some(stored))
}

/// Writes through a temporary file and a rename, so a reader never sees half a record.
fn write(path: &Path, stored: &Stored) -> Result<(), Error> {
    let tmp = path.with_extension("tmp");
    let bytes = serde_json::to_vec(stored).map_err(|e| Error::backend(NAME, e))?;
    let mut file = File::create(&tmp).map_err(unavailable)?;
    file.write_all(&bytes).map_err(unavailable)?;
    fs::rename(&tmp, path).map_err(unavailable)
}

fn remove(path: &Path) -> Result<bool, Error> {
    match fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(unavailable(e)),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Result<Vec<u8>, Error> {
    if !text.len().is_multiple_of(2) {
        return Err(Error::corrupt(NAME, "odd hex length"));
    }
    (0..text.len())
        .step_by(2)
        .map(|i| {
            u8::from_str_radix(&text[i..i + 2], 16).map_err(|_| Error::corrupt(NAME, "bad hex"))
        })
        .collect()
}

fn token_of(text: &str) -> Result<FencingToken, Error> {
    uuid::Uuid::parse_str(text)
        .map(FencingToken::from_uuid)
        .map_err(|_| Error::corrupt(NAME, "bad token"))
}

fn fingerprint_of(text: &str) -> Result<Fingerprint, Error> {
    let bytes: [u8; 32] = unhex(text)?
        .try_into()
        .map_err(|_| Error::corrupt(NAME, "bad fingerprint"))?;
    Ok(Fingerprint::from_bytes(bytes))
}

fn completion_of(meta: &str, body: &str) -> Result<Completion, Error> {
    decode_meta(&unhex(meta)?, unhex(body)?.into()).map_err(|e| Error::corrupt(NAME, e.to_string()))
}

/// The stored record if it is in progress under `lease`'s token.
fn held(path: &Path, lease: &Lease, now: u64) -> Result<Stored, Error> {
    match read(path, now)? {
        Some(stored)
            if matches!(&stored.state, StoredState::InProgress { token, .. }
                if token_of(token)? == lease.token()) =>
        {
            Ok(stored)
        }
        _ => Err(Error::LeaseLost),
    }
}

#[async_trait]
impl Store for FileStore {
    fn name(&self) -> &'static str {
        NAME
    }

    async fn begin(&self, req: BeginRequest<'_>) -> Result<Begin, Error> {
        let sent_at = Instant::now();
        self.locked(|dir, now| {
            let path = path_of(dir, req.id);
            let fresh = |attempt| Stored {
                id: req.id.encoded(),
                fingerprint: req.fingerprint.to_hex(),
                attempt,
                expires_at: now + micros(req.lease) + micros(req.retention),
                state: StoredState::InProgress {
                    token: req.token.to_string(),
                    deadline: now + micros(req.lease),
                },
            };
            let lease = |attempt, remaining| {
                Lease::new(req.id.clone(), req.token, attempt, remaining, sent_at)
            };
            let Some(stored) = read(&path, now)? else {
                write(&path, &fresh(1))?;
                return Ok(Begin::Acquired(lease(1, req.lease)));
            };
            if fingerprint_of(&stored.fingerprint)? != req.fingerprint {
                return Ok(Begin::Mismatch);
            }
            match &stored.state {
                StoredState::Completed { meta, body } => Ok(Begin::Replay(Replay {
                    completion: completion_of(meta, body)?,
                    expires_in: Duration::from_micros(stored.expires_at - now),
                })),
                StoredState::InProgress { token, deadline } if token_of(token)? == req.token => {
                    let lease = lease(
                        stored.attempt,
                        Duration::from_micros(deadline.saturating_sub(now)),
                    );
                    Ok(if stored.attempt == 1 {
                        Begin::Acquired(lease)
                    } else {
                        Begin::TookOver(lease)
                    })
                }
                StoredState::InProgress { deadline, .. } if *deadline > now => {
                    Ok(Begin::InFlight {
                        retry_after: Duration::from_micros(deadline - now),
                    })
                }
                StoredState::InProgress { .. } => {
                    let attempt = stored.attempt.saturating_add(1);
                    write(&path, &fresh(attempt))?;
                    Ok(Begin::TookOver(lease(attempt, req.lease)))
                }
            }
        })
    }

    async fn complete(
        &self,
        lease: &Lease,
        completion: &Completion,
        retention: Duration,
    ) -> Result<(), Error> {
        self.locked(|dir, now| {
            let path = path_of(dir, lease.id());
            let mut stored = held(&path, lease, now)?;
            stored.state = StoredState::Completed {
                meta: hex(&encode_meta(completion.kind, &completion.response)),
                body: hex(&completion.response.body),
            };
            stored.expires_at = now + micros(retention);
            write(&path, &stored)
        })
    }

    async fn release(&self, lease: &Lease) -> Result<(), Error> {
        self.locked(|dir, now| {
            let path = path_of(dir, lease.id());
            held(&path, lease, now)?;
            remove(&path).map(|_| ())
        })
    }

    async fn extend(&self, lease: &Lease, by: Duration) -> Result<Lease, Error> {
        let sent_at = Instant::now();
        self.locked(|dir, now| {
            let path = path_of(dir, lease.id());
            let mut stored = held(&path, lease, now)?;
            let StoredState::InProgress { deadline, .. } = &mut stored.state else {
                return Err(Error::LeaseLost);
            };
            let new_deadline = now + micros(by);
            stored.expires_at += new_deadline.saturating_sub(*deadline);
            *deadline = new_deadline;
            let attempt = stored.attempt;
            write(&path, &stored)?;
            Ok(Lease::new(
                lease.id().clone(),
                lease.token(),
                attempt,
                by,
                sent_at,
            ))
        })
    }

    async fn get(&self, id: &RecordId) -> Result<Option<Record>, Error> {
        self.locked(|dir, now| {
            let Some(stored) = read(&path_of(dir, id), now)? else {
                return Ok(None);
            };
            if stored.id != id.encoded() {
                return Err(Error::corrupt(NAME, "record file holds another id"));
            }
            let state = match &stored.state {
                StoredState::InProgress { token, deadline } => RecordState::InProgress {
                    token: token_of(token)?,
                    lease_remaining: Duration::from_micros(deadline.saturating_sub(now)),
                },
                StoredState::Completed { meta, body } => {
                    RecordState::Completed(completion_of(meta, body)?)
                }
            };
            Ok(Some(Record {
                id: id.clone(),
                fingerprint: fingerprint_of(&stored.fingerprint)?,
                attempt: stored.attempt,
                state,
                expires_in: Duration::from_micros(stored.expires_at - now),
            }))
        })
    }

    async fn evict(&self, id: &RecordId) -> Result<bool, Error> {
        self.locked(|dir, now| {
            let path = path_of(dir, id);
            // An expired record counts as absent.
            Ok(read(&path, now)?.is_some() && remove(&path)?)
        })
    }
}
