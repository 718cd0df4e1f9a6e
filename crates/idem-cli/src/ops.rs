//! The operator commands: `inspect`, `evict`, `stats`, `stuck`, `purge`, `migrate`. Each
//! result is one type, printed by [`print`]: as one line of JSON with `--json` (its
//! `Serialize`), else as text (its `Display`).

use std::borrow::Cow;
use std::fmt;
use std::io::{IsTerminal as _, Write as _};
use std::time::Duration;

use idem_core::{CompletionKind, Error, Key, Record, RecordId, RecordState, Scope, Store};
use idemkit::redis::{Problem, Scan};
use serde::{Serialize, Serializer};
use tokio::time::Instant;

use crate::args::{RecordArgs, SurveyArgs};
use crate::error::{CliError, Done};
use crate::store::Opened;

/// A command's result as it prints: `result` as one line of JSON with `json`, else its text.
///
/// # Errors
///
/// [`CliError::Io`] when `result` cannot be written as JSON.
fn print<T: Serialize + fmt::Display>(result: &T, json: bool) -> Result<String, CliError> {
    if !json {
        return Ok(result.to_string());
    }
    // Through a `Value`, whose objects hold their keys sorted: the order of every `--json`
    // object does not depend on the order of the fields.
    let doc = serde_json::to_value(result).map_err(std::io::Error::from)?;
    Ok(format!("{doc}\n"))
}

/// The record `idem inspect` or `idem evict` names: the key, in `--scope` (or the scope of
/// `--scope-header-value`).
///
/// # Errors
///
/// [`CliError::Usage`] for a key or scope idem refuses.
pub fn record_id(args: &RecordArgs) -> Result<RecordId, CliError> {
    let key = Key::new(args.key.clone())
        .map_err(|e| CliError::Usage(format!("invalid key {:?}: {e}", args.key)))?;
    let scope = match &args.scope_header_value {
        Some(value) => crate::proxy::caller_scope(&args.scope_header, value)?,
        None => Scope::new(args.scope.clone())
            .map_err(|e| CliError::Usage(format!("invalid scope: {e}")))?,
    };
    Ok(RecordId::new(scope, key))
}

/// Reads one record and renders it, human-readable or as JSON.
///
/// # Errors
///
/// [`CliError::NotFound`] when the record is absent or expired; store errors.
pub async fn inspect(store: &dyn Store, id: &RecordId, json: bool) -> Result<Done, CliError> {
    let record = store
        .get(id)
        .await
        .map_err(|e| unreadable(id, e))?
        .ok_or_else(|| CliError::NotFound(absent(id)))?;
    Ok(Done::ok(print(&Inspected::of(&record), json)?))
}

/// A record, as `idem inspect` shows it.
#[derive(Serialize)]
struct Inspected<'a> {
    scope: &'a str,
    key: &'a str,
    fingerprint: String,
    attempt: u32,
    #[serde(rename = "expires_in_ms", serialize_with = "ms")]
    expires_in: Duration,
    #[serde(flatten)]
    state: InspectedState<'a>,
}

/// A record's state: `"state"` and the lease or the completion.
#[derive(Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
enum InspectedState<'a> {
    InProgress { lease: Lease },
    Completed { completion: Completed<'a> },
}

/// The lease of a record in progress.
#[derive(Serialize)]
struct Lease {
    token: String,
    #[serde(rename = "remaining_ms", serialize_with = "ms")]
    remaining: Duration,
    expired: bool,
}

/// The completion of a completed record: its response, body as (lossy) text.
#[derive(Serialize)]
struct Completed<'a> {
    kind: &'static str,
    status: u16,
    headers: Vec<(&'a str, Cow<'a, str>)>,
    body_bytes: usize,
    body: Cow<'a, str>,
}

impl<'a> Inspected<'a> {
    fn of(record: &'a Record) -> Self {
        let state = match &record.state {
            RecordState::InProgress {
                token,
                lease_remaining,
            } => InspectedState::InProgress {
                lease: Lease {
                    token: token.to_string(),
                    remaining: *lease_remaining,
                    expired: lease_remaining.is_zero(),
                },
            },
            RecordState::Completed(completion) => {
                let response = &completion.response;
                InspectedState::Completed {
                    completion: Completed {
                        kind: kind(completion.kind),
                        status: response.status,
                        headers: response
                            .headers
                            .iter()
                            .map(|(n, v)| (n.as_str(), String::from_utf8_lossy(v)))
                            .collect(),
                        body_bytes: response.body.len(),
                        body: String::from_utf8_lossy(&response.body),
                    },
                }
            }
        };
        Self {
            scope: record.id.scope().as_str(),
            key: record.id.key().as_str(),
            fingerprint: record.fingerprint.to_hex(),
            attempt: record.attempt,
            expires_in: record.expires_in,
            state,
        }
    }
}

impl fmt::Display for Inspected<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scope = if self.scope.is_empty() {
            "(global)"
        } else {
            self.scope
        };
        writeln!(f, "scope        {scope}")?;
        writeln!(f, "key          {}", self.key)?;
        match &self.state {
            InspectedState::InProgress { lease } => {
                writeln!(f, "state        in progress")?;
                if lease.expired {
                    writeln!(
                        f,
                        "lease        {}, expired (the next request takes it over)",
                        lease.token
                    )?;
                } else {
                    writeln!(
                        f,
                        "lease        {}, {} left",
                        lease.token,
                        human(lease.remaining)
                    )?;
                }
            }
            InspectedState::Completed { completion } => {
                writeln!(
                    f,
                    "state        completed ({}, status {})",
                    completion.kind, completion.status
                )?;
                for (name, value) in &completion.headers {
                    writeln!(f, "header       {name}: {value}")?;
                }
                let body = &completion.body;
                let shown: String = body.chars().take(200).collect();
                let more = if shown.len() < body.len() { " ..." } else { "" };
                writeln!(
                    f,
                    "body         {} bytes: {shown}{more}",
                    completion.body_bytes
                )?;
            }
        }
        writeln!(f, "attempt      {}", self.attempt)?;
        writeln!(f, "expires in   {}", human(self.expires_in))?;
        writeln!(f, "fingerprint  {}", self.fingerprint)
    }
}

/// Deletes one record whatever its state.
///
/// # Errors
///
/// [`CliError::NotFound`] when there was none; store errors.
pub async fn evict(store: &dyn Store, id: &RecordId, json: bool) -> Result<Done, CliError> {
    let record = store.evict(id).await?;
    // Its tombstone too (routes with `after_retention = "refuse"`), so the key runs again.
    let tombstone = store.evict(&idem_core::tombstone_id(id)).await?;
    if !record && !tombstone {
        return Err(CliError::NotFound(absent(id)));
    }
    let evicted = Evicted {
        evicted: true,
        scope: id.scope().as_str(),
        key: id.key().as_str(),
        tombstone,
    };
    Ok(Done::ok(print(&evicted, json)?))
}

/// What `idem evict` deleted.
#[derive(Serialize)]
struct Evicted<'a> {
    evicted: bool,
    scope: &'a str,
    key: &'a str,
    /// Whether the key's tombstone was deleted too.
    tombstone: bool,
}

impl fmt::Display for Evicted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "evicted {}", describe(self.scope, self.key))
    }
}

/// What `stats` and `stuck` look at, and for how long.
#[derive(Debug, Clone)]
pub struct Survey {
    /// One scope, or all.
    pub scope: Option<Scope>,
    /// In-progress records whose lease expired longer ago than this are stuck.
    pub stuck_after: Duration,
    /// The whole command's time limit: at it, the counts so far are printed, marked
    /// partial, and the command exits 4.
    pub timeout: Duration,
    /// Print JSON instead of text.
    pub json: bool,
}

impl Survey {
    /// What the flags of `stats` or `stuck` ask to look at, printed as JSON with `json`.
    ///
    /// # Errors
    ///
    /// [`CliError::Usage`] for a scope idem refuses.
    pub fn of(args: &SurveyArgs, json: bool) -> Result<Self, CliError> {
        let scope = args
            .scope
            .clone()
            .map(Scope::new)
            .transpose()
            .map_err(|e| CliError::Usage(format!("invalid scope: {e}")))?;
        Ok(Self {
            scope,
            stuck_after: Duration::from_secs(args.stuck_after),
            timeout: args.timeout,
            json,
        })
    }
}

/// Counts records by state; in-progress records whose lease expired more than
/// `stuck_after` ago are the "stuck" alarm. On Redis (alone, or the tiered store's first
/// tier), also the corrupt and foreign keys under the store's prefix, page by page (with
/// progress on stderr when it is a terminal) until done or `timeout`.
///
/// # Errors
///
/// Store errors; on PostgreSQL, a count that does not end within `timeout`.
pub async fn stats(opened: &Opened, survey: &Survey) -> Result<Done, CliError> {
    let started = Instant::now();
    let mut stats = idem_core::Stats::default();
    let mut pg_corrupt = None;
    let mut redis = None;
    let mut stopped_at = None;
    // On a tiered store the states come from PostgreSQL, the arbiter, and the broken keys
    // from Redis, where a corrupt record fails the requests that read it first.
    let redis_alone = opened.pg().is_none() && opened.redis().is_some();
    if !redis_alone {
        stats = db_stats(opened, survey).await?;
    }
    if let Some(pg) = opened.pg() {
        pg_corrupt = Some(pg_corrupt_count(pg, survey).await?);
    }
    if let Some(store) = opened.redis() {
        let mut scan = store.scan(survey.scope.as_ref(), survey.stuck_after);
        let left = survey.timeout.saturating_sub(started.elapsed());
        if !walk(&mut scan, left, "stats").await? {
            stopped_at = Some(scan.primaries());
        }
        if redis_alone {
            stats = scan.counts().stats;
        }
        redis = Some(scan.counts().clone());
    }
    // Corrupt records in every tier counted: none when no tier counts them (memory).
    let corrupt = match (redis.as_ref().map(|r| r.corrupt), pg_corrupt) {
        (None, None) => None,
        (redis, pg) => Some(redis.unwrap_or(0) + pg.unwrap_or(0)),
    };
    let counted = Counted {
        complete: stopped_at.is_none(),
        scope: survey.scope.as_ref().map(Scope::as_str),
        in_flight: stats.in_flight,
        expired_leases: stats.expired_leases,
        stuck: stats.stuck,
        stuck_after: survey.stuck_after,
        succeeded: stats.succeeded,
        failed: stats.failed,
        corrupt,
        foreign: redis.as_ref().map(|r| r.foreign),
        keys_read: redis.as_ref().map(|r| r.keys),
        stopped: stopped_at.map(|(primary, primaries)| Stopped {
            reason: "timeout",
            timeout: survey.timeout,
            primary,
            primaries,
        }),
    };
    Ok(Done::partial_unless(
        counted.complete,
        print(&counted, survey.json)?,
    ))
}

/// What `idem stats` counted.
#[derive(Serialize)]
struct Counted<'a> {
    /// `false` when the time limit stopped it.
    complete: bool,
    scope: Option<&'a str>,
    in_flight: u64,
    expired_leases: u64,
    stuck: u64,
    #[serde(rename = "stuck_after_ms", serialize_with = "ms")]
    stuck_after: Duration,
    succeeded: u64,
    failed: u64,
    /// Corrupt records in every tier that counts them (Redis, PostgreSQL).
    corrupt: Option<u64>,
    /// Redis only: keys under the prefix that are not idem's.
    foreign: Option<u64>,
    /// Redis only: keys read.
    #[serde(skip_serializing_if = "Option::is_none")]
    keys_read: Option<u64>,
    /// Where a partial count stopped.
    #[serde(skip_serializing_if = "Option::is_none")]
    stopped: Option<Stopped>,
}

/// Where a count stopped at its time limit: primary `primary` of `primaries`.
#[derive(Serialize)]
struct Stopped {
    reason: &'static str,
    #[serde(rename = "timeout_ms", serialize_with = "ms")]
    timeout: Duration,
    primary: usize,
    primaries: usize,
}

impl fmt::Display for Counted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(stopped) = &self.stopped {
            writeln!(
                f,
                "PARTIAL         stopped at --timeout {} on primary {} of {}: the counts \
                 below are a lower bound",
                human(stopped.timeout),
                stopped.primary,
                stopped.primaries
            )?;
        }
        let scope = self
            .scope
            .map_or("(all)", |s| if s.is_empty() { "(global)" } else { s });
        writeln!(f, "scope           {scope}")?;
        writeln!(f, "in flight       {}", self.in_flight)?;
        writeln!(f, "expired leases  {}", self.expired_leases)?;
        writeln!(
            f,
            "stuck           {} (lease expired over {} ago, no retry came){}",
            self.stuck,
            human(self.stuck_after),
            alarm(self.stuck)
        )?;
        writeln!(f, "succeeded       {}", self.succeeded)?;
        writeln!(f, "failed          {}", self.failed)?;
        if let Some(corrupt) = self.corrupt {
            writeln!(
                f,
                "corrupt         {corrupt} (not decodable: each answers every request with an \
                 error){}",
                alarm(corrupt)
            )?;
        }
        if let (Some(foreign), Some(keys)) = (self.foreign, self.keys_read) {
            writeln!(
                f,
                "foreign         {foreign} (under the prefix, not idem's: another type or name)"
            )?;
            writeln!(f, "keys read       {keys}")?;
        }
        if self.corrupt.unwrap_or(0) + self.foreign.unwrap_or(0) > 0 || self.stuck > 0 {
            writeln!(f, "(`idem stuck` lists them)")?;
        }
        Ok(())
    }
}

/// The mark of a count that should be zero.
fn alarm(count: u64) -> &'static str {
    if count > 0 {
        "  <- ALARM"
    } else {
        ""
    }
}

/// [`Store::stats`] on a store that counts in one call (PostgreSQL, memory), within
/// `survey.timeout`.
async fn db_stats(opened: &Opened, survey: &Survey) -> Result<idem_core::Stats, CliError> {
    let store: std::sync::Arc<dyn Store> = match opened.pg() {
        Some(pg) => std::sync::Arc::new(pg.clone()),
        None => opened.store(),
    };
    let count = store.stats(survey.scope.as_ref(), survey.stuck_after);
    let late = "the count did not end within --timeout {} (it is one statement on PostgreSQL); \
        raise --timeout";
    within(survey, count, (store.name(), late)).await
}

/// How many records [`PgStore::corrupt`](idemkit::postgres::PgStore::corrupt) finds, within
/// `survey.timeout`.
async fn pg_corrupt_count(
    pg: &idemkit::postgres::PgStore,
    survey: &Survey,
) -> Result<u64, CliError> {
    let count = pg.corrupt(survey.scope.as_ref(), 0);
    let (total, _) = within(survey, count, POSTGRES_LATE).await?;
    Ok(total)
}

/// PostgreSQL's answer late: the store and the message, `{}` the timeout.
const POSTGRES_LATE: (&str, &str) = ("postgres", "no answer within --timeout {}");

/// The store's `answer` within `survey.timeout`; else unavailable, as `late` says.
async fn within<T>(
    survey: &Survey,
    answer: impl std::future::Future<Output = Result<T, Error>>,
    (store, late): (&'static str, &str),
) -> Result<T, CliError> {
    tokio::time::timeout(survey.timeout, answer)
        .await
        .map_err(|_| {
            let message = late.replace("{}", &human(survey.timeout));
            CliError::Store(Error::unavailable(store, message))
        })?
        .map_err(CliError::from)
}

/// Walks a Redis scan until done or `timeout`, with progress on stderr when it is a
/// terminal. `true` when done.
async fn walk(scan: &mut Scan, timeout: Duration, what: &'static str) -> Result<bool, CliError> {
    let started = Instant::now();
    let deadline = started + timeout;
    let mut progress = Progress::new(what, started);
    let complete = loop {
        match tokio::time::timeout_at(deadline, scan.step()).await {
            Ok(Ok(true)) => progress.show(scan),
            Ok(Ok(false)) => break true,
            Ok(Err(e)) => {
                progress.clear();
                return Err(e.into());
            }
            // The page in flight is dropped uncounted: the counts are those of whole pages.
            Err(_) => break false,
        }
    };
    progress.clear();
    Ok(complete)
}

/// A progress line on stderr, rewritten in place, only when stderr is a terminal.
struct Progress {
    what: &'static str,
    on: bool,
    started: Instant,
    shown: Option<Instant>,
}

impl Progress {
    fn new(what: &'static str, started: Instant) -> Self {
        Self {
            what,
            on: std::io::stderr().is_terminal(),
            started,
            shown: None,
        }
    }

    fn show(&mut self, scan: &Scan) {
        if !self.on
            || self
                .shown
                .is_some_and(|at| at.elapsed() < Duration::from_millis(200))
        {
            return;
        }
        self.shown = Some(Instant::now());
        let (primary, primaries) = scan.primaries();
        let _ = write!(
            std::io::stderr(),
            "\ridem {}: {} keys read, primary {primary} of {primaries} about {:.0}% scanned, {}\x1b[K",
            self.what,
            scan.counts().keys,
            scan.primary_progress() * 100.0,
            human(self.started.elapsed())
        );
    }

    fn clear(&self) {
        if self.on && self.shown.is_some() {
            let _ = write!(std::io::stderr(), "\r\x1b[K");
        }
    }
}

/// Lists the stuck records (lease expired over `stuck_after` ago, no retry), and on Redis
/// the corrupt and foreign keys under the prefix, at most `limit` of them.
///
/// # Errors
///
/// Store errors; on PostgreSQL, a listing that does not end within `timeout`.
pub async fn stuck(opened: &Opened, survey: &Survey, limit: u32) -> Result<Done, CliError> {
    let started = Instant::now();
    let mut records: Vec<Found> = Vec::new();
    if let Some(pg) = opened.pg() {
        let stuck = pg.stuck(survey.scope.as_ref(), survey.stuck_after, limit);
        let found = within(survey, stuck, POSTGRES_LATE).await?;
        records.extend(found.into_iter().map(|record| Found {
            attempt: Some(record.attempt),
            expired_for_ms: Some(millis(record.expired_for)),
            ..Found::record(&record.id, "stuck")
        }));
        let room = u32::try_from(records.len()).map_or(0, |n| limit.saturating_sub(n));
        let corrupt = pg.corrupt(survey.scope.as_ref(), room);
        let (_, corrupt) = within(survey, corrupt, POSTGRES_LATE).await?;
        let detail = "metadata of another version or an unknown completion kind";
        records.extend(corrupt.iter().map(|id| Found {
            detail: Some(detail.into()),
            ..Found::record(id, "corrupt")
        }));
    }
    // Redis: its stuck records (alone), its corrupt and foreign keys (alone or tiered).
    let mut complete = true;
    if let Some(redis) = opened.redis() {
        let room = (limit as usize).saturating_sub(records.len());
        let mut scan = redis
            .scan(survey.scope.as_ref(), survey.stuck_after)
            .with_findings(room);
        let left = survey.timeout.saturating_sub(started.elapsed());
        complete = walk(&mut scan, left, "stuck").await?;
        records.extend(scan.findings().iter().map(Found::of));
    } else if opened.pg().is_none() {
        return Err(CliError::Unsupported(
            "no stuck records to list here".into(),
        ));
    }
    let listed = Listed {
        complete,
        stuck_after: survey.stuck_after,
        limit,
        records,
        timeout: survey.timeout,
    };
    Ok(Done::partial_unless(complete, print(&listed, survey.json)?))
}

/// What `idem stuck` lists.
#[derive(Serialize)]
struct Listed {
    /// `false` when the time limit stopped it.
    complete: bool,
    #[serde(rename = "stuck_after_ms", serialize_with = "ms")]
    stuck_after: Duration,
    limit: u32,
    records: Vec<Found>,
    /// The time limit, which a partial list names.
    #[serde(skip)]
    timeout: Duration,
}

/// One record or key found wrong.
#[derive(Serialize)]
struct Found {
    /// The Redis key, for what a Redis scan found.
    #[serde(skip_serializing_if = "Option::is_none")]
    redis_key: Option<String>,
    /// The record's scope and key: none for a Redis key that names no record.
    scope: Option<String>,
    key: Option<String>,
    /// `stuck`, `corrupt`, `foreign` (or `other`).
    problem: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    attempt: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    expired_for_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
}

impl Found {
    /// A record found with `problem`, nothing more said.
    fn record(id: &RecordId, problem: &'static str) -> Self {
        Self {
            redis_key: None,
            scope: Some(id.scope().as_str().to_owned()),
            key: Some(id.key().as_str().to_owned()),
            problem,
            attempt: None,
            expired_for_ms: None,
            detail: None,
        }
    }

    /// One key a Redis scan found wrong.
    fn of(finding: &idemkit::redis::Finding) -> Self {
        let mut found = Self {
            redis_key: Some(finding.key.clone()),
            scope: finding.id.as_ref().map(|id| id.scope().as_str().to_owned()),
            key: finding.id.as_ref().map(|id| id.key().as_str().to_owned()),
            problem: "other",
            attempt: None,
            expired_for_ms: None,
            detail: None,
        };
        (found.problem, found.detail) = match &finding.problem {
            Problem::Stuck {
                expired_for,
                attempt,
            } => {
                found.attempt = Some(*attempt);
                found.expired_for_ms = Some(millis(*expired_for));
                ("stuck", None)
            }
            Problem::Corrupt(why) => ("corrupt", Some(why.clone())),
            Problem::Foreign(what) => ("foreign", Some(what.clone())),
            other => ("other", Some(other.to_string())),
        };
        found
    }
}

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match (self.scope.as_deref(), self.key.as_deref()) {
            (Some(scope), Some(key)) => describe(scope, key),
            // Quoted as JSON quotes it.
            _ => format!(
                "redis key {}",
                serde_json::Value::from(self.redis_key.clone())
            ),
        };
        let detail = match self.problem {
            "stuck" => format!(
                "attempt {}, lease expired {} ago, no retry came",
                self.attempt.unwrap_or_default(),
                human(Duration::from_millis(self.expired_for_ms.unwrap_or(0)))
            ),
            _ => self.detail.clone().unwrap_or_default(),
        };
        writeln!(f, "{:<8} {name}: {detail}", self.problem)
    }
}

impl fmt::Display for Listed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.complete {
            writeln!(
                f,
                "PARTIAL: stopped at --timeout {}; the list below is what was found so far",
                human(self.timeout)
            )?;
        }
        for found in &self.records {
            write!(f, "{found}")?;
        }
        if self.records.is_empty() {
            writeln!(
                f,
                "nothing stuck (no lease expired over {} ago without a retry){}",
                human(self.stuck_after),
                if self.complete { "" } else { " so far" }
            )?;
        } else {
            if self.records.len() >= self.limit as usize {
                writeln!(f, "(first {}; --limit shows more)", self.limit)?;
            }
            writeln!(
                f,
                "`idem evict KEY --scope SCOPE` deletes one, so that its key runs again"
            )?;
        }
        Ok(())
    }
}

/// Deletes expired records, in batches: on PostgreSQL (and the tiered store's PostgreSQL)
/// only; Redis expires its records itself.
///
/// # Errors
///
/// Store errors; [`CliError::Unsupported`] on the memory store.
pub async fn purge(opened: &Opened, timeout: Duration, json: bool) -> Result<Done, CliError> {
    let Some(pg) = opened.pg() else {
        let purged = Purged {
            purged: 0,
            complete: true,
            schema: None,
            note: Some(
                "Redis deletes expired records itself (each has a time to live): nothing to purge",
            ),
        };
        return Ok(Done::ok(print(&purged, json)?));
    };
    const BATCH: u32 = 1000;
    let deadline = Instant::now() + timeout;
    let mut purged = 0u64;
    let complete = loop {
        match tokio::time::timeout_at(deadline, pg.purge_expired(BATCH)).await {
            Ok(Ok(n)) => {
                purged += n;
                if n < u64::from(BATCH) {
                    break true;
                }
            }
            Ok(Err(e)) => return Err(e.into()),
            // A batch cut short is rolled back whole by PostgreSQL.
            Err(_) => break false,
        }
    };
    let purged = Purged {
        purged,
        complete,
        schema: Some(pg.schema()),
        note: None,
    };
    Ok(Done::partial_unless(complete, print(&purged, json)?))
}

/// What `idem purge` deleted, from which schema; or why there was nothing to do.
#[derive(Serialize)]
struct Purged<'a> {
    purged: u64,
    /// `false` when the time limit stopped it.
    complete: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    schema: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<&'static str>,
}

impl fmt::Display for Purged<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(note) = self.note {
            return writeln!(f, "{note}");
        }
        let partial = if self.complete {
            ""
        } else {
            "PARTIAL (stopped at --timeout): "
        };
        writeln!(
            f,
            "{partial}purged {} expired records from schema {:?}",
            self.purged,
            self.schema.unwrap_or_default()
        )
    }
}

/// Applies the migrations PostgreSQL's schema lacks (idem's, and the outbox's on a tiered
/// store); the only command that changes a schema.
///
/// # Errors
///
/// Store errors (a role without the right to create tables, ...).
pub async fn migrate(opened: &Opened, json: bool) -> Result<Done, CliError> {
    let Some(pg) = opened.pg() else {
        let migrated = Migrated {
            schema: None,
            applied: Vec::new(),
            note: Some("Redis keeps no schema: nothing to migrate"),
        };
        return Ok(Done::ok(print(&migrated, json)?));
    };
    let pending = opened.pending_migrations().await?;
    if opened.tiered().is_some() {
        idemkit::outbox::migrate(pg).await?;
    } else {
        pg.migrate().await?;
    }
    let migrated = Migrated {
        schema: Some(pg.schema()),
        applied: pending,
        note: None,
    };
    Ok(Done::ok(print(&migrated, json)?))
}

/// The migrations `idem migrate` applied, to which schema; or why there was nothing to do.
#[derive(Serialize)]
struct Migrated<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    schema: Option<&'a str>,
    applied: Vec<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<&'static str>,
}

impl fmt::Display for Migrated<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let schema = self.schema.unwrap_or_default();
        match self.note {
            Some(note) => writeln!(f, "{note}"),
            None if self.applied.is_empty() => {
                writeln!(f, "schema {schema:?} is up to date: nothing to apply")
            }
            None => writeln!(
                f,
                "schema {schema:?}: applied migrations {:?}",
                self.applied
            ),
        }
    }
}

/// A record that cannot be read says what is wrong with it and how to clear it.
fn unreadable(id: &RecordId, e: Error) -> CliError {
    let evict = format!(
        "`idem evict {}{}` deletes it, so that the key runs again",
        id.key().as_str(),
        if id.scope().as_str().is_empty() {
            String::new()
        } else {
            format!(" --scope {}", id.scope().as_str())
        }
    );
    match &e {
        Error::Corrupt { detail, .. } => CliError::Corrupt(format!(
            "the record for {} is corrupt: {detail}; every request for it fails until {evict}",
            name(id)
        )),
        Error::Backend { .. } if e.to_string().contains("WRONGTYPE") => CliError::Corrupt(format!(
            "the key of {} holds a Redis value of another type, not an idem record; \
                 {evict}",
            name(id)
        )),
        _ => CliError::Store(e),
    }
}

/// The answer for a record that is not there; in the global scope it adds that `idem
/// serve` keys its records by caller, the usual reason a key is not found there.
fn absent(id: &RecordId) -> String {
    let mut text = format!("no record for {}", name(id));
    if id.scope().as_str().is_empty() {
        text.push_str(
            "; `idem serve` keeps keys per caller: give the caller's name, e.g. --scope alice \
             for `Authorization: Bearer alice` (`idem stats` counts records in every scope)",
        );
    }
    text
}

/// A record's name in a message: `key "k" in scope "s"`, or `key "k" (global scope)`.
fn describe(scope: &str, key: &str) -> String {
    if scope.is_empty() {
        format!("key {key:?} (global scope)")
    } else {
        format!("key {key:?} in scope {scope:?}")
    }
}

/// [`describe`] of `id`.
fn name(id: &RecordId) -> String {
    describe(id.scope().as_str(), id.key().as_str())
}

fn kind(kind: CompletionKind) -> &'static str {
    match kind {
        CompletionKind::Succeeded => "succeeded",
        CompletionKind::Failed => "failed",
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Writes a duration as whole milliseconds (the `_ms` fields).
fn ms<S: Serializer>(d: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_u64(millis(*d))
}

/// `1h02m03s`, `4m05s`, `6.5s`.
fn human(d: Duration) -> String {
    let secs = d.as_secs();
    if secs >= 3600 {
        format!("{}h{:02}m{:02}s", secs / 3600, secs % 3600 / 60, secs % 60)
    } else if secs >= 60 {
        format!("{}m{:02}s", secs / 60, secs % 60)
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(human(Duration::from_millis(6500)), "6.5s");
        assert_eq!(human(Duration::from_secs(245)), "4m05s");
        assert_eq!(human(Duration::from_secs(3723)), "1h02m03s");
    }
}
