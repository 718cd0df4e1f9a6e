//! Counting the store's records on Redis: [`RedisStore::scan`], a [`Scan`] walked a page at
//! a time (`SCAN` on every primary), which [`idem_core::Store::stats`] runs to its end. An
//! operator's tool, not a hot path.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use idem_core::{Error, RecordId, RecordState, Scope, Stats};
use redis::Value;

use crate::codec::{self, Head};
use crate::connection::Node;
use crate::error::unexpected;
use crate::store::RedisStore;

/// Keys asked for per `SCAN` step.
const PAGE: usize = 1000;

/// Bytes of each value read by a page's pipeline. A record longer than this (a large body)
/// is read again whole, on its own, to be decoded.
const READ: usize = 64 * 1024;

/// The counts of a [`Scan`] so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ScanCounts {
    /// The records by state, as [`idem_core::Store::stats`] reports them.
    pub stats: Stats,
    /// Strings under the store's key pattern that do not decode as records (an unknown
    /// record tag, a wrong length, bad metadata or a bad compressed body). Every request for
    /// such a key fails until the key is evicted.
    pub corrupt: u64,
    /// Keys under the store's key pattern that are not idem's: another type (a hash, a
    /// list, ...), or a name that is not a record's.
    pub foreign: u64,
    /// Keys the scan read (all categories, and keys that expired between the `SCAN` and
    /// the read).
    pub keys: u64,
}

/// What is wrong with one key, as a [`Scan`] keeping findings reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Problem {
    /// In progress, its lease expired longer ago than the scan's `stuck_after`, and no retry
    /// took it over.
    Stuck {
        /// How long ago the lease expired, by the server's clock.
        expired_for: Duration,
        /// The attempt that holds it.
        attempt: u32,
    },
    /// A string that does not decode as a record; the codec's reason.
    Corrupt(String),
    /// Not a record: the key's type (`hash`, `list`, ...) or why its name is not a record's.
    Foreign(String),
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Stuck {
                expired_for,
                attempt,
            } => write!(
                f,
                "stuck: attempt {attempt}'s lease expired {:.0} s ago, no retry came",
                expired_for.as_secs_f64()
            ),
            Self::Corrupt(why) => write!(f, "corrupt: {why}"),
            Self::Foreign(what) => write!(f, "not an idem record: {what}"),
        }
    }
}

/// One key a [`Scan`] found wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Finding {
    /// The Redis key (lossy UTF-8).
    pub key: String,
    /// The record it holds, when its name decodes as one.
    pub id: Option<RecordId>,
    /// What is wrong.
    pub problem: Problem,
}

/// A walk over the store's keys, a page at a time. Made by [`RedisStore::scan`].
///
/// Each [`Scan::step`] reads one `SCAN` page (`COUNT 1000`) on one primary and the types and
/// values of the keys it returns, in two pipelined round trips, each bounded by
/// [`crate::RedisConfig::response_timeout`]; the walk as a whole has no limit of its own. Every
/// key under the store's pattern is counted once, in one category: a record in one of its
/// states, corrupt (a string that does not decode), or foreign (another type, or a name
/// that is not a record's). Not a snapshot: records that change meanwhile may be counted in
/// either state, or missed.
#[derive(Debug)]
pub struct Scan {
    store: RedisStore,
    pattern: Vec<u8>,
    stuck_after_ms: i64,
    /// The primaries, read at the first step.
    nodes: Option<Vec<Node>>,
    node: usize,
    cursor: u64,
    /// `SCAN` calls made on the current primary, and its `DBSIZE` (read at its first page).
    node_pages: u64,
    node_size: u64,
    done: bool,
    counts: ScanCounts,
    findings: Vec<Finding>,
    max_findings: usize,
}

impl RedisStore {
    /// A scan of the store's records (in `scope`, or all of them), not started: call
    /// [`Scan::step`] until it answers `false`. In-progress records whose lease expired more
    /// than `stuck_after` ago count as stuck.
    ///
    /// ```no_run
    /// # async fn run(store: idem_redis::RedisStore) -> Result<(), idem_core::Error> {
    /// use std::time::Duration;
    ///
    /// let mut scan = store.scan(None, Duration::from_secs(300)).with_findings(100);
    /// while scan.step().await? {
    ///     eprintln!("{} keys so far", scan.counts().keys);
    /// }
    /// for finding in scan.findings() {
    ///     println!("{}: {}", finding.key, finding.problem);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn scan(&self, scope: Option<&Scope>, stuck_after: Duration) -> Scan {
        Scan {
            store: self.clone(),
            pattern: pattern(&self.config().prefix, scope),
            stuck_after_ms: i64::try_from(stuck_after.as_millis()).unwrap_or(i64::MAX),
            nodes: None,
            node: 0,
            cursor: 0,
            node_pages: 0,
            node_size: 0,
            done: false,
            counts: ScanCounts::default(),
            findings: Vec::new(),
            max_findings: 0,
        }
    }
}

impl Scan {
    /// Keeps up to `limit` [`Finding`]s (stuck, corrupt and foreign keys), in the order
    /// found. Default: none kept, only counted.
    pub fn with_findings(mut self, limit: usize) -> Self {
        self.max_findings = limit;
        self
    }

    /// Reads one page of keys and counts them. Answers `true` while keys remain.
    ///
    /// A page that fails is not counted, and the next call reads it again: the counts stay
    /// those of whole pages.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when Redis does not answer within
    /// [`crate::RedisConfig::response_timeout`] (after one retry on a fresh connection when
    /// the connection failed); [`Error::Backend`] when it answers with an error.
    pub async fn step(&mut self) -> Result<bool, Error> {
        if self.done {
            return Ok(false);
        }
        let mut retried = false;
        loop {
            match self.page().await {
                Ok(()) => return Ok(!self.done),
                Err(e) if e.is_retryable() && !retried => retried = true,
                Err(e) => return Err(e),
            }
        }
    }

    /// The counts so far (of whole pages).
    pub fn counts(&self) -> &ScanCounts {
        &self.counts
    }

    /// The findings kept so far (see [`Scan::with_findings`]).
    pub fn findings(&self) -> &[Finding] {
        &self.findings
    }

    /// The primary being scanned (counting from 1) and how many there are: `(1, 1)` on one
    /// server; `(0, 0)` before the first step.
    pub fn primaries(&self) -> (usize, usize) {
        match &self.nodes {
            Some(nodes) => ((self.node + 1).min(nodes.len()), nodes.len()),
            None => (0, 0),
        }
    }

    /// An estimate of how far the scan of the current primary is, from 0 to 1: the `SCAN`
    /// calls made times their `COUNT` (1000) against the primary's `DBSIZE` (a `SCAN` call
    /// visits about `COUNT` keys of the whole keyspace, matching or not). Capped below 1
    /// until done.
    pub fn primary_progress(&self) -> f64 {
        if self.done {
            return 1.0;
        }
        if self.node_size == 0 {
            return 0.0;
        }
        (self.node_pages as f64 * PAGE as f64 / self.node_size as f64).min(0.99)
    }

    /// One page: `SCAN`, the keys' types and the strings' values, counted. Nothing is
    /// counted unless the whole page was read.
    async fn page(&mut self) -> Result<(), Error> {
        let mut conn = self.store.ready().await?;
        if self.nodes.is_none() {
            self.nodes = Some(conn.primaries().await?);
        }
        let nodes = self.nodes.as_deref().unwrap_or_default();
        let Some(node) = nodes.get(self.node).cloned() else {
            self.done = true;
            return Ok(());
        };
        if self.cursor == 0 {
            // A primary's first page: its size, for the progress estimate.
            self.node_size = match conn.on_node(&node, redis::cmd("DBSIZE")).await? {
                Value::Int(n) => u64::try_from(n).unwrap_or(0),
                other => return Err(unexpected("DBSIZE", &other)),
            };
            self.node_pages = 0;
        }
        let mut scan = redis::cmd("SCAN");
        scan.arg(self.cursor).arg("MATCH").arg(&self.pattern);
        scan.arg("COUNT").arg(PAGE);
        let reply = conn.on_node(&node, scan).await?;
        let (next, keys): (u64, Vec<Vec<u8>>) =
            redis::from_redis_value_ref(&reply).map_err(|_| unexpected("SCAN", &reply))?;

        // Counted on a copy, kept once the page was read whole.
        let mut counts = self.counts.clone();
        // Every key once, whatever it turns out to be (one gone since the SCAN too).
        counts.keys += keys.len() as u64;
        let mut found = Vec::new();
        if !keys.is_empty() {
            // The types first: reading a hash as a string would fail the whole pipeline.
            let mut types = redis::pipe();
            for key in &keys {
                types.cmd("TYPE").arg(key);
            }
            let types = conn.pipeline_on_node(&node, types, keys.len()).await?;
            let mut strings = Vec::new();
            for (key, kind) in keys.iter().zip(&types) {
                let kind = match kind {
                    Value::SimpleString(kind) => kind.as_str(),
                    Value::Okay => "ok",
                    other => return Err(unexpected("TYPE", other)),
                };
                match kind {
                    "string" => strings.push(key),
                    // Gone since the SCAN: expired or deleted.
                    "none" => {}
                    other => {
                        counts.foreign += 1;
                        found.push((key.clone(), Problem::Foreign(format!("a {other}"))));
                    }
                }
            }
            if !strings.is_empty() {
                let mut read = redis::pipe();
                read.ignore_errors();
                for key in &strings {
                    read.cmd("GETRANGE").arg(key).arg(0).arg(READ - 1);
                    read.cmd("PTTL").arg(key);
                }
                let replies = conn
                    .pipeline_on_node(&node, read, 2 * strings.len())
                    .await?;
                for (key, pair) in strings.iter().zip(replies.chunks(2)) {
                    let (value, pttl) = match pair {
                        // Gone between the two round trips (GETRANGE of a missing key is
                        // empty, its PTTL -2).
                        [_, Value::Int(-2)] => continue,
                        [Value::BulkString(value), Value::Int(pttl)] => (value.clone(), *pttl),
                        // Made another type between the two round trips.
                        [Value::ServerError(e), _] if e.code() == "WRONGTYPE" => {
                            counts.foreign += 1;
                            found.push(((*key).clone(), Problem::Foreign("not a string".into())));
                            continue;
                        }
                        // Gone between the two round trips.
                        _ => continue,
                    };
                    let value = if value.len() >= READ {
                        // A long record: read it whole to decode it.
                        let mut get = redis::cmd("GET");
                        get.arg(*key);
                        match conn.on_node(&node, get).await? {
                            Value::BulkString(value) => value,
                            _ => continue,
                        }
                    } else {
                        value
                    };
                    // Released a moment ago (Valkey 8.1): as good as absent.
                    let Some(value) = codec::live(Some(value)) else {
                        continue;
                    };
                    if let Some(problem) = self.count(&mut counts, key, value, pttl) {
                        found.push(((*key).clone(), problem));
                    }
                }
            }
        }

        // The page was read whole: count it, and move the cursor.
        self.counts = counts;
        for (key, problem) in found {
            if self.findings.len() >= self.max_findings {
                break;
            }
            let id = record_id(&self.store.config().prefix, &key).ok();
            self.findings.push(Finding {
                key: String::from_utf8_lossy(&key).into_owned(),
                id,
                problem,
            });
        }
        self.node_pages += 1;
        if next == 0 {
            self.node += 1;
            self.cursor = 0;
            self.done = self.node >= nodes.len();
        } else {
            self.cursor = next;
        }
        Ok(())
    }

    /// Counts one string; answers its problem when it is stuck, corrupt or foreign.
    fn count(
        &self,
        counts: &mut ScanCounts,
        key: &[u8],
        value: Bytes,
        pttl: i64,
    ) -> Option<Problem> {
        let id = match record_id(&self.store.config().prefix, key) {
            Ok(id) => id,
            Err(why) => {
                counts.foreign += 1;
                return Some(Problem::Foreign(why.to_owned()));
            }
        };
        let record = match codec::decode_record(&id, value.clone(), pttl) {
            Ok(record) => record,
            Err(e) => {
                counts.corrupt += 1;
                return Some(Problem::Corrupt(match e {
                    Error::Corrupt { detail, .. } => detail,
                    other => other.to_string(),
                }));
            }
        };
        let stats = &mut counts.stats;
        match &record.state {
            RecordState::InProgress { .. } => {
                // The signed lease time left, by the server's clock: the key's PTTL minus the
                // margin its record holds. `decode_record` just decoded this head.
                let Some(Head::InProgress { lease_left_ms, .. }) = codec::decode_head(&value, pttl)
                else {
                    return None;
                };
                if lease_left_ms > 0 {
                    stats.in_flight += 1;
                    return None;
                }
                stats.expired_leases += 1;
                let expired_for = lease_left_ms.saturating_neg();
                if expired_for > self.stuck_after_ms {
                    stats.stuck += 1;
                    return Some(Problem::Stuck {
                        expired_for: codec::millis(expired_for),
                        attempt: record.attempt,
                    });
                }
            }
            RecordState::Completed(completion) => match completion.kind {
                idem_core::CompletionKind::Succeeded => stats.succeeded += 1,
                _ => stats.failed += 1,
            },
        }
        None
    }
}

/// The record a key names: `<prefix>{<8 hex>}<encoded id>`.
fn record_id(prefix: &str, key: &[u8]) -> Result<RecordId, &'static str> {
    let rest = key
        .strip_prefix(prefix.as_bytes())
        .ok_or("the key lacks the store's prefix")?;
    let rest = std::str::from_utf8(rest).map_err(|_| "the key's name is not UTF-8")?;
    let encoded = rest
        .get(10..)
        .filter(|_| rest.starts_with('{') && rest.as_bytes()[9] == b'}')
        .ok_or("the key has no hash tag")?;
    let id = RecordId::decode(encoded).ok_or("the key's name is not an encoded record id")?;
    if crate::key::record_key(prefix, &id).as_bytes() != key {
        return Err("the key's hash tag is not its record's");
    }
    Ok(id)
}

/// The `SCAN MATCH` pattern of the store's keys: `<prefix>{????????}<scope length>:<scope>*`
/// with Redis glob characters escaped (braces are literal in Redis patterns).
fn pattern(prefix: &str, scope: Option<&Scope>) -> Vec<u8> {
    let mut out = Vec::new();
    escape(prefix.as_bytes(), &mut out);
    out.extend_from_slice(b"{????????}");
    if let Some(scope) = scope {
        let scope = scope.as_str();
        escape(format!("{}:{scope}", scope.len()).as_bytes(), &mut out);
    }
    out.push(b'*');
    out
}

fn escape(text: &[u8], out: &mut Vec<u8>) {
    for &b in text {
        if matches!(b, b'*' | b'?' | b'[' | b']' | b'\\') {
            out.push(b'\\');
        }
        out.push(b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::Key;

    #[test]
    fn patterns_escape_globs() {
        let scope = Scope::new("a*b[c]").unwrap();
        assert_eq!(
            pattern("idem:", Some(&scope)),
            b"idem:{????????}6:a\\*b\\[c\\]*".to_vec()
        );
        assert_eq!(pattern("p?", None), b"p\\?{????????}*".to_vec());
        // Scope lengths keep "ab" from matching the records of scope "a" with key "b...".
        let a = Scope::new("a").unwrap();
        assert_eq!(pattern("", Some(&a)), b"{????????}1:a*".to_vec());
    }

    #[test]
    fn keys_name_their_records() {
        let id = RecordId::new(Scope::new("alice").unwrap(), Key::new("k{1}").unwrap());
        let key = crate::key::record_key("idem:", &id);
        assert_eq!(record_id("idem:", key.as_bytes()), Ok(id));
        assert!(record_id("other:", key.as_bytes()).is_err());
        // Same shape, wrong tag: not one of the store's keys.
        let forged = format!("idem:{{00000000}}{}", &key["idem:{00000000}".len()..]);
        assert!(record_id("idem:", forged.as_bytes()).is_err());
        assert!(record_id("idem:", b"idem:{0000abcd}x:0").is_err());
        assert!(record_id("idem:", b"idem:").is_err());
    }
}
