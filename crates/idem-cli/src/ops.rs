//! The operator commands: `inspect`, `evict`, `stats`, `stuck`, `purge`, `migrate`.

use std::fmt::Write as _;
use std::io::{IsTerminal as _, Write as _};
use std::time::Duration;

use idem_core::{CompletionKind, Error, Key, Record, RecordId, RecordState, Scope, Store};
use idemkit::redis::{Problem, Scan};
use tokio::time::Instant;

use crate::args::{RecordArgs, SurveyArgs};
use crate::error::{CliError, Done};
use crate::store::Opened;

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
    let text = || record_text(&record);
    Ok(Done::ok(render(json, || record_json(&record), text)))
}

/// The output of a command: `doc` as one line of JSON with `--json`, else `text`.
fn render(
    json: bool,
    doc: impl FnOnce() -> serde_json::Value,
    text: impl FnOnce() -> String,
) -> String {
    if json {
        format!("{}\n", doc())
    } else {
        text()
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
    let doc = || {
        let (scope, key) = (id.scope().as_str(), id.key().as_str());
        serde_json::json!({"evicted": true, "scope": scope, "key": key, "tombstone": tombstone})
    };
    let text = || format!("evicted {}\n", describe(id));
    Ok(Done::ok(render(json, doc, text)))
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

/// How a count ended.
struct Counted {
    stats: idem_core::Stats,
    /// Redis only: corrupt and foreign keys, keys read.
    redis: Option<idemkit::redis::ScanCounts>,
    /// PostgreSQL only (alone or tiered): completed records that cannot be read.
    pg_corrupt: Option<u64>,
    /// `false` when the time limit stopped it.
    complete: bool,
    /// Where a partial count stopped: primaries `(i, n)`.
    primaries: (usize, usize),
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
    let mut counted = Counted {
        stats: idem_core::Stats::default(),
        redis: None,
        pg_corrupt: None,
        complete: true,
        primaries: (0, 0),
    };
    // On a tiered store the states come from PostgreSQL, the arbiter, and the broken keys
    // from Redis, where a corrupt record fails the requests that read it first.
    let redis_alone = opened.pg().is_none() && opened.redis().is_some();
    if !redis_alone {
        counted.stats = db_stats(opened, survey).await?;
    }
    if let Some(pg) = opened.pg() {
        counted.pg_corrupt = Some(pg_corrupt(pg, survey).await?);
    }
    if let Some(redis) = opened.redis() {
        let mut scan = redis.scan(survey.scope.as_ref(), survey.stuck_after);
        let left = survey.timeout.saturating_sub(started.elapsed());
        counted.complete = walk(&mut scan, left, "stats").await?;
        if redis_alone {
            counted.stats = scan.counts().stats;
        }
        counted.redis = Some(scan.counts().clone());
        counted.primaries = scan.primaries();
    }
    let json = || stats_json(&counted, survey);
    let output = render(survey.json, json, || stats_text(&counted, survey));
    Ok(Done::partial_unless(counted.complete, output))
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
async fn pg_corrupt(pg: &idemkit::postgres::PgStore, survey: &Survey) -> Result<u64, CliError> {
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

/// Corrupt records in every tier counted: `None` when no tier counts them (memory).
fn corrupt(counted: &Counted) -> Option<u64> {
    match (
        counted.redis.as_ref().map(|r| r.corrupt),
        counted.pg_corrupt,
    ) {
        (None, None) => None,
        (redis, pg) => Some(redis.unwrap_or(0) + pg.unwrap_or(0)),
    }
}

fn stats_json(counted: &Counted, survey: &Survey) -> serde_json::Value {
    let stats = &counted.stats;
    let mut doc = serde_json::json!({
        "complete": counted.complete,
        "scope": survey.scope.as_ref().map(Scope::as_str),
        "in_flight": stats.in_flight,
        "expired_leases": stats.expired_leases,
        "stuck": stats.stuck,
        "stuck_after_ms": millis(survey.stuck_after),
        "succeeded": stats.succeeded,
        "failed": stats.failed,
        "corrupt": null,
        "foreign": null,
    });
    if let Some(corrupt) = corrupt(counted) {
        doc["corrupt"] = corrupt.into();
    }
    if let Some(redis) = &counted.redis {
        doc["foreign"] = redis.foreign.into();
        doc["keys_read"] = redis.keys.into();
    }
    if !counted.complete {
        doc["stopped"] = serde_json::json!({
            "reason": "timeout",
            "timeout_ms": millis(survey.timeout),
            "primary": counted.primaries.0,
            "primaries": counted.primaries.1,
        });
    }
    doc
}

fn stats_text(counted: &Counted, survey: &Survey) -> String {
    let stats = &counted.stats;
    let mut out = String::new();
    if !counted.complete {
        let _ = writeln!(
            out,
            "PARTIAL         stopped at --timeout {} on primary {} of {}: the counts below \
             are a lower bound",
            human(survey.timeout),
            counted.primaries.0,
            counted.primaries.1
        );
    }
    let _ = writeln!(
        out,
        "scope           {}",
        survey
            .scope
            .as_ref()
            .map_or("(all)", |s| if s.as_str().is_empty() {
                "(global)"
            } else {
                s.as_str()
            })
    );
    let _ = writeln!(out, "in flight       {}", stats.in_flight);
    let _ = writeln!(out, "expired leases  {}", stats.expired_leases);
    let _ = writeln!(
        out,
        "stuck           {} (lease expired over {} ago, no retry came){}",
        stats.stuck,
        human(survey.stuck_after),
        if stats.stuck > 0 { "  <- ALARM" } else { "" }
    );
    let _ = writeln!(out, "succeeded       {}", stats.succeeded);
    let _ = writeln!(out, "failed          {}", stats.failed);
    if let Some(corrupt) = corrupt(counted) {
        let _ = writeln!(
            out,
            "corrupt         {corrupt} (not decodable: each answers every request with an error){}",
            if corrupt > 0 { "  <- ALARM" } else { "" }
        );
    }
    if let Some(redis) = &counted.redis {
        let _ = writeln!(
            out,
            "foreign         {} (under the prefix, not idem's: another type or name)",
            redis.foreign
        );
        let _ = writeln!(out, "keys read       {}", redis.keys);
    }
    let foreign = counted.redis.as_ref().map_or(0, |r| r.foreign);
    if corrupt(counted).unwrap_or(0) + foreign > 0 || stats.stuck > 0 {
        let _ = writeln!(out, "(`idem stuck` lists them)");
    }
    out
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
    let mut rows: Vec<serde_json::Value> = Vec::new();
    if let Some(pg) = opened.pg() {
        let stuck = pg.stuck(survey.scope.as_ref(), survey.stuck_after, limit);
        let found = within(survey, stuck, POSTGRES_LATE).await?;
        for record in found {
            rows.push(serde_json::json!({
                "scope": record.id.scope().as_str(),
                "key": record.id.key().as_str(),
                "problem": "stuck",
                "attempt": record.attempt,
                "expired_for_ms": millis(record.expired_for),
            }));
        }
        let room = u32::try_from(rows.len()).map_or(0, |n| limit.saturating_sub(n));
        let corrupt = pg.corrupt(survey.scope.as_ref(), room);
        let (_, corrupt) = within(survey, corrupt, POSTGRES_LATE).await?;
        for id in corrupt {
            rows.push(serde_json::json!({
                "scope": id.scope().as_str(),
                "key": id.key().as_str(),
                "problem": "corrupt",
                "detail": "metadata of another version or an unknown completion kind",
            }));
        }
    }
    // Redis: its stuck records (alone), its corrupt and foreign keys (alone or tiered).
    let mut complete = true;
    if let Some(redis) = opened.redis() {
        let room = (limit as usize).saturating_sub(rows.len());
        let mut scan = redis
            .scan(survey.scope.as_ref(), survey.stuck_after)
            .with_findings(room);
        let left = survey.timeout.saturating_sub(started.elapsed());
        complete = walk(&mut scan, left, "stuck").await?;
        rows.extend(scan.findings().iter().map(finding_row));
    } else if opened.pg().is_none() {
        return Err(CliError::Unsupported(
            "no stuck records to list here".into(),
        ));
    }
    let doc = || {
        serde_json::json!({
            "complete": complete,
            "stuck_after_ms": millis(survey.stuck_after),
            "limit": limit,
            "records": rows,
        })
    };
    let output = render(survey.json, doc, || {
        stuck_text(&rows, complete, survey, limit)
    });
    Ok(Done::partial_unless(complete, output))
}

/// One key a Redis scan found wrong, as `stuck --json` lists it.
fn finding_row(finding: &idemkit::redis::Finding) -> serde_json::Value {
    let mut row = serde_json::json!({
        "redis_key": finding.key,
        "scope": finding.id.as_ref().map(|id| id.scope().as_str()),
        "key": finding.id.as_ref().map(|id| id.key().as_str()),
    });
    let (problem, detail) = match &finding.problem {
        Problem::Stuck {
            expired_for,
            attempt,
        } => {
            row["attempt"] = (*attempt).into();
            row["expired_for_ms"] = millis(*expired_for).into();
            ("stuck", None)
        }
        Problem::Corrupt(why) => ("corrupt", Some(why.clone())),
        Problem::Foreign(what) => ("foreign", Some(what.clone())),
        other => ("other", Some(other.to_string())),
    };
    row["problem"] = problem.into();
    if let Some(detail) = detail {
        row["detail"] = detail.into();
    }
    row
}

fn stuck_text(rows: &[serde_json::Value], complete: bool, survey: &Survey, limit: u32) -> String {
    let mut out = String::new();
    if !complete {
        let _ = writeln!(
            out,
            "PARTIAL: stopped at --timeout {}; the list below is what was found so far",
            human(survey.timeout)
        );
    }
    for row in rows {
        let name = match (row["scope"].as_str(), row["key"].as_str()) {
            (Some(""), Some(key)) => format!("key {key:?} (global scope)"),
            (Some(scope), Some(key)) => format!("key {key:?} in scope {scope:?}"),
            _ => format!("redis key {}", row["redis_key"]),
        };
        let detail = match row["problem"].as_str() {
            Some("stuck") => format!(
                "attempt {}, lease expired {} ago, no retry came",
                row["attempt"],
                human(Duration::from_millis(
                    row["expired_for_ms"].as_u64().unwrap_or(0)
                ))
            ),
            _ => row["detail"].as_str().unwrap_or_default().to_owned(),
        };
        let _ = writeln!(
            out,
            "{:<8} {name}: {detail}",
            row["problem"].as_str().unwrap_or_default()
        );
    }
    if rows.is_empty() {
        let _ = writeln!(
            out,
            "nothing stuck (no lease expired over {} ago without a retry){}",
            human(survey.stuck_after),
            if complete { "" } else { " so far" }
        );
    } else {
        if rows.len() >= limit as usize {
            let _ = writeln!(out, "(first {limit}; --limit shows more)");
        }
        let _ = writeln!(
            out,
            "`idem evict KEY --scope SCOPE` deletes one, so that its key runs again"
        );
    }
    out
}

/// Deletes expired records, in batches: on PostgreSQL (and the tiered store's PostgreSQL)
/// only; Redis expires its records itself.
///
/// # Errors
///
/// Store errors; [`CliError::Unsupported`] on the memory store.
pub async fn purge(opened: &Opened, timeout: Duration, json: bool) -> Result<Done, CliError> {
    let Some(pg) = opened.pg() else {
        let text =
            "Redis deletes expired records itself (each has a time to live): nothing to purge";
        let doc = || serde_json::json!({"purged": 0, "complete": true, "note": text});
        return Ok(Done::ok(render(json, doc, || format!("{text}\n"))));
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
    let doc = || serde_json::json!({"purged": purged, "complete": complete, "schema": pg.schema()});
    let partial = if complete {
        ""
    } else {
        "PARTIAL (stopped at --timeout): "
    };
    let output = render(json, doc, || {
        format!(
            "{partial}purged {purged} expired records from schema {:?}\n",
            pg.schema()
        )
    });
    Ok(Done::partial_unless(complete, output))
}

/// Applies the migrations PostgreSQL's schema lacks (idem's, and the outbox's on a tiered
/// store); the only command that changes a schema.
///
/// # Errors
///
/// Store errors (a role without the right to create tables, ...).
pub async fn migrate(opened: &Opened, json: bool) -> Result<Done, CliError> {
    let Some(pg) = opened.pg() else {
        let text = "Redis keeps no schema: nothing to migrate";
        let doc = || serde_json::json!({"applied": [], "note": text});
        return Ok(Done::ok(render(json, doc, || format!("{text}\n"))));
    };
    let pending = opened.pending_migrations().await?;
    if opened.tiered().is_some() {
        idemkit::outbox::migrate(pg).await?;
    } else {
        pg.migrate().await?;
    }
    let doc = || serde_json::json!({"schema": pg.schema(), "applied": pending});
    Ok(Done::ok(render(json, doc, || {
        if pending.is_empty() {
            format!("schema {:?} is up to date: nothing to apply\n", pg.schema())
        } else {
            format!("schema {:?}: applied migrations {pending:?}\n", pg.schema())
        }
    })))
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
            describe(id)
        )),
        Error::Backend { .. } if e.to_string().contains("WRONGTYPE") => CliError::Corrupt(format!(
            "the key of {} holds a Redis value of another type, not an idem record; \
                 {evict}",
            describe(id)
        )),
        _ => CliError::Store(e),
    }
}

/// The answer for a record that is not there; in the global scope it adds that `idem
/// serve` keys its records by caller, the usual reason a key is not found there.
fn absent(id: &RecordId) -> String {
    let mut text = format!("no record for {}", describe(id));
    if id.scope().as_str().is_empty() {
        text.push_str(
            "; `idem serve` keeps keys per caller: give the caller's name, e.g. --scope alice \
             for `Authorization: Bearer alice` (`idem stats` counts records in every scope)",
        );
    }
    text
}

fn describe(id: &RecordId) -> String {
    if id.scope().as_str().is_empty() {
        format!("key {:?} (global scope)", id.key().as_str())
    } else {
        format!(
            "key {:?} in scope {:?}",
            id.key().as_str(),
            id.scope().as_str()
        )
    }
}

fn record_json(record: &Record) -> serde_json::Value {
    let mut doc = serde_json::json!({
        "scope": record.id.scope().as_str(),
        "key": record.id.key().as_str(),
        "fingerprint": record.fingerprint.to_hex(),
        "attempt": record.attempt,
        "expires_in_ms": millis(record.expires_in),
    });
    match &record.state {
        RecordState::InProgress {
            token,
            lease_remaining,
        } => {
            doc["state"] = "in_progress".into();
            doc["lease"] = serde_json::json!({
                "token": token.to_string(),
                "remaining_ms": millis(*lease_remaining),
                "expired": lease_remaining.is_zero(),
            });
        }
        RecordState::Completed(completion) => {
            doc["state"] = "completed".into();
            let response = &completion.response;
            doc["completion"] = serde_json::json!({
                "kind": kind(completion.kind),
                "status": response.status,
                "headers": response
                    .headers
                    .iter()
                    .map(|(n, v)| serde_json::json!([n, String::from_utf8_lossy(v)]))
                    .collect::<Vec<_>>(),
                "body_bytes": response.body.len(),
                "body": String::from_utf8_lossy(&response.body),
            });
        }
    }
    doc
}

fn record_text(record: &Record) -> String {
    let mut out = String::new();
    let scope = record.id.scope().as_str();
    let _ = writeln!(
        out,
        "scope        {}",
        if scope.is_empty() { "(global)" } else { scope }
    );
    let _ = writeln!(out, "key          {}", record.id.key().as_str());
    match &record.state {
        RecordState::InProgress {
            token,
            lease_remaining,
        } => {
            let _ = writeln!(out, "state        in progress");
            if lease_remaining.is_zero() {
                let _ = writeln!(
                    out,
                    "lease        {token}, expired (the next request takes it over)"
                );
            } else {
                let _ = writeln!(
                    out,
                    "lease        {token}, {} left",
                    human(*lease_remaining)
                );
            }
        }
        RecordState::Completed(completion) => {
            let response = &completion.response;
            let _ = writeln!(
                out,
                "state        completed ({}, status {})",
                kind(completion.kind),
                response.status
            );
            for (name, value) in &response.headers {
                let _ = writeln!(
                    out,
                    "header       {name}: {}",
                    String::from_utf8_lossy(value)
                );
            }
            let body = String::from_utf8_lossy(&response.body);
            let shown: String = body.chars().take(200).collect();
            let more = if shown.len() < body.len() { " ..." } else { "" };
            let _ = writeln!(
                out,
                "body         {} bytes: {shown}{more}",
                response.body.len()
            );
        }
    }
    let _ = writeln!(out, "attempt      {}", record.attempt);
    let _ = writeln!(out, "expires in   {}", human(record.expires_in));
    let _ = writeln!(out, "fingerprint  {}", record.fingerprint.to_hex());
    out
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
