//! `--phases compare`: idem's Redis store side by side with the published Rust crates whose
//! Redis idempotency stores come closest: `idempotent` 0.3 (`ValkeyStore`, feature `valkey`)
//! and `klauthed-data` 1.0 (`RedisIdempotencyStore`, feature `redis`), both pinned in this
//! crate's manifest (never published).
//!
//! What is the same for every side:
//! - one process, one Redis server, one redis-rs: all three link the workspace's redis 1.8
//!   (the peers ask for `redis = "1"`), each on its own `ConnectionManager` (one multiplexed
//!   connection, RESP2, a response timeout: the peers get redis-rs's defaults, 1 s to
//!   connect and 500 ms per response; idem its own defaults, 1 s and 2 s);
//! - the same idempotency keys, under key prefixes of equal length (idem's key adds its
//!   `{hash tag}` and scope on top, as it does in production);
//! - the same JSON response body, status 201, no headers;
//! - the same concurrency, on the same closed-loop driver ([`drive`]), each operation
//!   computing its own fingerprint of the same request bytes (idem: SHA-256; `idempotent`:
//!   its xxh3; `klauthed-data` has none);
//! - interleaved rounds: round r runs each phase for every side before the next phase, with
//!   the sides' order rotated every round, so a slow moment of the machine hits all sides.
//!
//! A phase is `lifecycle` (claim a new key, store the response) or `replay` (claim a key
//! that was completed: the stored response comes back), at concurrency 1 and
//! `--concurrency`. Replays read the keys the same side completed in the same round.
//! The report keeps each (side, phase)'s median over the rounds, the ratio of idem to the
//! best peer, the Redis server time per operation (`INFO commandstats`, see
//! [`server_usec`]) and the process CPU per operation (`INFO cpu`), and the memory per
//! completed record (`INFO memory` `used_memory` delta over the lifecycle phase, and
//! `MEMORY USAGE` of sampled records).
//!
//! With `--compare-cluster <redis+cluster URL>`, every round also runs idem's lifecycle and
//! replay at `--concurrency` on that cluster, for the cluster / standalone ratio.
//!
//! Beside the sides runs a **fenced floor** (never a peer, never in the ratios): the least
//! that any fenced lifecycle sends on Redis 7.0 with the same client, in raw redis-rs and
//! with no store around it. Its claim is idem's (`SET key <59-byte in-progress record> NX
//! GET PX`, one command; a replay is the same command); its completion is
//! an `EVALSHA` of a two-call script that compares the record's first 17 bytes with the
//! token and `SET`s the completed record (Redis 7.0 has no conditional `SET`, so a compare
//! needs a script); per operation it draws a token and a SHA-256 fingerprint like idem.
//! No waiter wake-up, no timeouts, no resend: what is left of idem's lifecycle. A peer
//! ahead of the floor is ahead of any fenced store on this server and client.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idemkit::redis::{RedisStore, Scripting};
use idemkit::{
    Begin, BeginRequest, Completion, FencingToken, Fingerprint, Key, RecordId, Response, Scope,
    Store,
};
use idempotent::entry::{CachedResponse, ExistingEntry, IdempotencyEntry, Metadata};
use idempotent::fingerprint::{DefaultFingerprintStrategy, FingerprintStrategy};
use idempotent::store::valkey::ValkeyStore;
use idempotent::store::{IdempotencyStore as _, InsertResult};
use idempotent::IdempotencyKey;
use klauthed_data::idempotency::redis::RedisIdempotencyStore;
use klauthed_data::idempotency::{IdempotencyStore as _, Outcome};
use redis::aio::ConnectionManager;

use crate::middleware::process_cpu;
use crate::phases::drive;
use crate::redis_floor::{stats_delta, CommandStats, RedisSide};
use crate::report::{median, PhaseReport};
use crate::{Args, RETENTION};

/// The request every operation fingerprints (method and path, then the body).
const OPERATION: &str = "POST /payments";

/// The JSON response body every side stores: 35 bytes.
const BODY: &str = r#"{"id":"pay_777777","status":"paid"}"#;

/// One store under comparison.
#[derive(Clone)]
enum Side {
    Idem {
        store: RedisStore,
        /// `idem`, `idem (scripts)` (forced to Lua scripts) or `idem (cluster)`.
        name: &'static str,
    },
    Idempotent(Arc<ValkeyStore>),
    Klauthed(RedisIdempotencyStore),
    /// The fenced floor (module docs): raw redis-rs, and the script that completes.
    Floor(ConnectionManager, Arc<redis::Script>),
}

/// The fenced floor's completion: the record's first 17 bytes ('P' and the token) compared
/// with `ARGV[1]`, then the completed record set with its retention.
const FLOOR_COMPLETE: &str = "if redis.call('GETRANGE', KEYS[1], 0, 16) == ARGV[1] then \
     redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1 end return 0";

impl Side {
    fn name(&self) -> &'static str {
        match self {
            Side::Idem { name, .. } => name,
            Side::Idempotent(_) => "idempotent 0.3",
            Side::Klauthed(_) => "klauthed-data 1.0",
            Side::Floor(..) => "fenced floor",
        }
    }

    /// Whether the side is a published crate compared with idem (not idem, not the floor).
    fn is_peer(&self) -> bool {
        matches!(self, Side::Idempotent(_) | Side::Klauthed(_))
    }

    /// The commands the side sends itself (outside scripts) that its scripts may also
    /// call, with how many it sends per operation of each phase; see [`server_usec`].
    fn top_level(&self) -> &'static [(&'static str, f64)] {
        match self {
            Side::Idem { .. } | Side::Floor(..) => IDEM_TOP_LEVEL,
            Side::Idempotent(_) | Side::Klauthed(_) => &[],
        }
    }
}

/// The commands idem's store sends outside scripts on the two phases' paths, per operation,
/// on a server without the compare-and-set commands (`begin` is one `SET .. NX GET PX`;
/// `complete` is `set_if.lua`, whose `GET`, `SET` and `PUBSUB NUMSUB` are counted inside
/// it; capped at the calls seen). Where the server has the commands, no script runs and
/// every command is the side's own. Keep in step with `idem-redis`'s `transitions.rs`. The
/// fenced floor's are the same: its claim's `SET` outside its script.
pub(crate) const IDEM_TOP_LEVEL: &[(&str, f64)] = &[("set", 1.0)];

/// What every side stores and how.
struct Workload {
    prefix: BTreeMap<&'static str, String>,
    body: Bytes,
    json: Arc<serde_json::Value>,
    completion: Arc<Completion>,
    cached: CachedResponse,
}

/// The figures of one (side, phase) in one round.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    ops_per_sec: f64,
    p50_us: f64,
    server_us: f64,
    cpu_us: f64,
    /// This process's CPU time per operation (every thread: the callers, redis-rs's
    /// connection tasks, tokio), µs.
    client_us: f64,
    bytes_per_record: f64,
    /// `bytes_per_record` without the growth of the keyspace's bucket arrays.
    bytes_net_of_tables: f64,
}

/// Runs the comparison and prints (or returns as JSON) its report.
pub async fn run(s: &Args, url: &str, run_id: &str) -> Result<(), String> {
    let side = Arc::new(RedisSide::connect(url, &format!("cmp:{run_id}:")).await?);
    // Prefixes of equal length: idem's `<p>i:`, idempotent's `<p>v` (it adds `-`),
    // klauthed-data's `<p>k:` (it has no prefix: the bench puts it in the key).
    let p = format!("cmp:{run_id}:");
    let prefix: BTreeMap<&'static str, String> = [
        ("idem", format!("{p}i:")),
        ("scripts", format!("{p}s:")),
        ("idempotent", format!("{p}v")),
        ("klauthed", format!("{p}k:")),
        ("floor", format!("{p}f:")),
    ]
    .into();
    let body = Bytes::from_static(BODY.as_bytes());
    let workload = Arc::new(Workload {
        json: Arc::new(serde_json::from_slice(&body).map_err(|e| e.to_string())?),
        completion: Arc::new(Completion::succeeded(Response::new(201, body.clone()))),
        cached: CachedResponse {
            status_code: 201,
            metadata: Metadata::default(),
            body: body.clone(),
        },
        body,
        prefix,
    });

    // idem on `url`, under the prefix named `prefix`.
    let idem = async |name: &'static str, url: &str, prefix: &str, scripting| {
        let store = RedisStore::builder(url)
            .with_prefix(&workload.prefix[prefix])
            .with_scripting(scripting)
            .connect()
            .await
            .map_err(|e| format!("{name} on {url}: {e}"))?;
        Ok::<_, String>(Side::Idem { store, name })
    };
    let (auto, scripts) = (Scripting::Auto, Scripting::Scripts);
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let valkey = ValkeyStore::with_prefix(client.clone(), Some(&workload.prefix["idempotent"]))
        .await
        .map_err(|e| format!("idempotent: {e}"))?;
    let manager = ConnectionManager::new(client.clone())
        .await
        .map_err(|e| format!("klauthed-data: {e}"))?;
    let floor = ConnectionManager::new(client)
        .await
        .map_err(|e| format!("fenced floor: {e}"))?;
    let klauthed = RedisIdempotencyStore::with_ttl_ms(manager, millis(RETENTION));
    let sides = vec![
        idem("idem", url, "idem", auto).await?,
        idem("idem (scripts)", url, "scripts", scripts).await?,
        Side::Idempotent(Arc::new(valkey)),
        Side::Klauthed(klauthed),
        Side::Floor(floor, Arc::new(redis::Script::new(FLOOR_COMPLETE))),
    ];
    let cluster = match &s.compare_cluster {
        Some(url) => Some(idem("idem (cluster)", url, "idem", auto).await?),
        None => None,
    };

    // Untimed: connections made, scripts loaded.
    for side_ in sides.iter().chain(&cluster) {
        let warm = Run {
            phase: "lifecycle",
            keys: "warm".to_owned(),
            n: 500.min(s.keys),
            c: s.concurrency,
        };
        run_phase(side_, &workload, &warm).await?;
    }

    let (c, n1) = (s.concurrency, s.c1_keys.min(s.keys));
    let phases = [
        ("lifecycle", c, s.keys),
        ("replay", c, s.keys),
        ("lifecycle", 1, n1),
        ("replay", 1, n1),
    ];
    let mut samples: BTreeMap<(String, String), Vec<Sample>> = BTreeMap::new();
    let mut breakdown: BTreeMap<(String, String), String> = BTreeMap::new();
    let mut usage: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for round in 0..s.rounds {
        let mut order = sides.clone();
        order.rotate_left(round % sides.len());
        for &(phase, c, n) in &phases {
            // Replays read the keys of this round's concurrent lifecycle.
            let keys = match phase {
                "lifecycle" if c == 1 => format!("r{round}-l1"),
                _ => format!("r{round}-l"),
            };
            let run = Run { phase, keys, n, c };
            for side_ in &order {
                let (sample, parts) = measure(&side, side_, &workload, &run).await?;
                let label = format!("{phase} c={c}");
                samples
                    .entry((side_.name().to_owned(), label.clone()))
                    .or_default()
                    .push(sample);
                breakdown.insert((side_.name().to_owned(), label), parts);
                if phase == "lifecycle" && c > 1 {
                    let key = |i| redis_key(side_, &workload, &format!("{}-{i}", run.keys));
                    let bytes = side.mean_memory_usage(n, key).await;
                    let bytes = bytes.map_err(|e| format!("{}: {e}", side_.name()))?;
                    usage
                        .entry(side_.name().to_owned())
                        .or_default()
                        .push(bytes);
                }
            }
            if let (Some(cl), true) = (&cluster, c > 1) {
                let (sample, _) = measure_plain(cl, &workload, &run).await?;
                samples
                    .entry((cl.name().to_owned(), format!("{phase} c={c}")))
                    .or_default()
                    .push(sample);
            }
        }
    }
    report(s, url, &sides, &cluster, &samples, &breakdown, &usage);
    Ok(())
}

/// One run of a phase: `n` operations of `phase` (`lifecycle` or `replay`), `c` at a time, on
/// keys named after `keys`.
#[derive(Debug)]
struct Run {
    phase: &'static str,
    keys: String,
    n: usize,
    c: usize,
}

/// Runs one phase of one side with the server's counters around it.
async fn measure(
    server: &RedisSide,
    side: &Side,
    w: &Arc<Workload>,
    run: &Run,
) -> Result<(Sample, String), String> {
    let stats = server.command_stats().await?;
    let cpu = server.used_cpu().await?;
    let mem = server.used_memory().await?;
    let tables = keyspace_tables(server).await?;
    let client = process_cpu();
    let (mut sample, report) = measure_plain(side, w, run).await?;
    let client = process_cpu()
        .zip(client)
        .map(|(after, before)| after.saturating_sub(before));
    let delta = stats_delta(&stats, &server.command_stats().await?);
    let ops = report.ops().max(1) as f64;
    let (usec, parts) = server_usec(&delta, side.top_level(), ops);
    sample.server_us = usec / ops;
    sample.cpu_us = (server.used_cpu().await? - cpu) * 1e6 / ops;
    sample.client_us = client.map_or(f64::NAN, |d| d.as_secs_f64() * 1e6 / ops);
    if run.phase == "lifecycle" {
        let used = server.used_memory().await? as f64 - mem as f64;
        sample.bytes_per_record = used / ops;
        let grown = keyspace_tables(server).await? as f64 - tables as f64;
        sample.bytes_net_of_tables = (used - grown) / ops;
    }
    Ok((sample, parts))
}

/// The bytes of the keyspace's bucket arrays (`MEMORY STATS`: every database's
/// `overhead.hashtable.main` and `overhead.hashtable.expires`). They double when the number
/// of keys passes a power of two, and the side whose phase happens to cross one would be
/// charged the whole table (up to 100 B per record of its phase): the figure net of them is
/// each side's own records, the raw delta is kept beside it.
async fn keyspace_tables(server: &RedisSide) -> Result<u64, String> {
    use redis::Value;
    let is_db = |v: &Value| match v {
        Value::BulkString(b) => b.starts_with(b"db."),
        Value::SimpleString(s) => s.starts_with("db."),
        _ => false,
    };
    let mut total = 0;
    for pair in server.memory_stats().await?.chunks(2) {
        if let [name, Value::Array(fields)] = pair {
            if is_db(name) {
                // Only the two hashtable overheads are numbers in a database's entry.
                for field in fields.chunks(2) {
                    if let [_, Value::Int(n)] = field {
                        total += u64::try_from(*n).unwrap_or(0);
                    }
                }
            }
        }
    }
    Ok(total)
}

/// Runs one phase of one side; throughput and latency only.
async fn measure_plain(
    side: &Side,
    w: &Arc<Workload>,
    run: &Run,
) -> Result<(Sample, PhaseReport), String> {
    let report = run_phase(side, w, run).await?;
    let sample = Sample {
        ops_per_sec: report.throughput(),
        p50_us: report.p50().as_secs_f64() * 1e6,
        ..Sample::default()
    };
    Ok((sample, report))
}

/// Redis server time of a phase from its `INFO commandstats` delta, and the breakdown.
///
/// A script's time includes the commands it calls, which Redis also counts under their
/// own names. So: every script call counts; a plain command counts in full when the side
/// ran no script, and otherwise only for the calls the side sends itself (`top_level`:
/// calls per operation, taken at the command's mean time per call); the rest of its calls
/// were made inside the scripts and are listed as such.
pub(crate) fn server_usec(
    delta: &CommandStats,
    top_level: &[(&str, f64)],
    ops: f64,
) -> (f64, String) {
    let scripted = |name: &str| {
        matches!(
            name,
            "evalsha" | "evalsha_ro" | "eval" | "eval_ro" | "fcall" | "fcall_ro"
        )
    };
    let scripts = delta.keys().any(|n| scripted(n));
    let mut total = 0.0;
    let mut parts = Vec::new();
    for (name, &(calls, usec)) in delta {
        // The snapshots' own INFO and MEMORY STATS calls are not the phase's work.
        if name == "info" || name == "memory|stats" {
            continue;
        }
        let per_call = usec as f64 / calls as f64;
        let own = if !scripts || scripted(name) {
            calls as f64
        } else {
            top_level
                .iter()
                .find(|(n, _)| n == name)
                .map_or(0.0, |(_, per_op)| (per_op * ops).min(calls as f64))
        };
        total += own * per_call;
        let inner = calls as f64 - own;
        if own > 0.0 {
            parts.push(format!("{name} {:.2}/op x {per_call:.2} µs", own / ops));
        }
        if inner > 0.5 {
            parts.push(format!(
                "(in script) {name} {:.2}/op x {per_call:.2} µs",
                inner / ops
            ));
        }
    }
    (total, parts.join(", "))
}

/// Runs `run` on one side: `lifecycle` claims and completes new keys, `replay` claims the
/// keys a lifecycle completed.
async fn run_phase(side: &Side, w: &Arc<Workload>, run: &Run) -> Result<PhaseReport, String> {
    let phase = run.phase;
    let (side, w, keys) = (side.clone(), w.clone(), Arc::<str>::from(run.keys.as_str()));
    drive(phase, run.n, run.c, move |i| {
        let (side, w, key) = (side.clone(), w.clone(), format!("{keys}-{i}"));
        async move {
            match phase {
                "lifecycle" => lifecycle(&side, &w, key).await,
                _ => replay(&side, &w, key).await,
            }
        }
    })
    .await
}

/// Claims a new key and stores the response.
async fn lifecycle(side: &Side, w: &Workload, key: String) -> Result<&'static str, String> {
    match side {
        Side::Idem { store, .. } => {
            let id = idem_id(&key)?;
            match idem_begin(store, w, &id).await? {
                Begin::Acquired(lease) => store
                    .complete(&lease, &w.completion, RETENTION)
                    .await
                    .map(|()| "executed")
                    .map_err(|e| e.to_string()),
                other => Err(format!("idem: a new key was not acquired: {other:?}")),
            }
        }
        Side::Idempotent(store) => {
            let key = IdempotencyKey::new(key).map_err(|e| e.to_string())?;
            let fp = DefaultFingerprintStrategy.compute(OPERATION, &w.body);
            let entry = IdempotencyEntry::new(fp, RETENTION);
            match store.try_insert(&key, entry.clone()).await {
                Ok(InsertResult::Claimed { fencing_token }) => store
                    .complete(&key, entry.complete(w.cached.clone()), fencing_token)
                    .await
                    .map(|()| "executed")
                    .map_err(|e| format!("idempotent: {e:?}")),
                other => Err(format!("idempotent: a new key was not claimed: {other:?}")),
            }
        }
        Side::Klauthed(store) => {
            let key = format!("{}{key}", w.prefix["klauthed"]);
            match store.begin(&key).await {
                Ok(Outcome::New) => store
                    .complete(&key, (*w.json).clone())
                    .await
                    .map(|()| "executed")
                    .map_err(|e| format!("klauthed-data: {e}")),
                other => Err(format!(
                    "klauthed-data: a new key was not claimed: {other:?}"
                )),
            }
        }
        Side::Floor(conn, script) => {
            let key = format!("{}{key}", w.prefix["floor"]);
            let (fingerprint, token) = floor_identity(w);
            let mut conn = conn.clone();
            match floor_claim(&mut conn, &key, &fingerprint, &token).await? {
                redis::Value::Nil => {}
                other => {
                    return Err(format!(
                        "fenced floor: a new key was not claimed: {other:?}"
                    ))
                }
            }
            let mut head = [b'P'; 17];
            head[1..].copy_from_slice(&token);
            let mut record = Vec::with_capacity(41 + w.body.len());
            record.push(b'C');
            record.extend_from_slice(&fingerprint);
            record.extend_from_slice(&expires_at().to_be_bytes());
            record.push(1);
            record.extend_from_slice(&[0x80, 0, 201]);
            record.extend_from_slice(&w.body);
            let done: i64 = script
                .key(&key)
                .arg(head.as_slice())
                .arg(record)
                .arg(millis(RETENTION))
                .invoke_async(&mut conn)
                .await
                .map_err(|e| format!("fenced floor: {e}"))?;
            if done == 1 {
                Ok("executed")
            } else {
                Err("fenced floor: the completion found another record".into())
            }
        }
    }
}

/// The fenced floor's per-operation work that idem does too: a SHA-256 fingerprint of the
/// request and a random 16-byte token.
fn floor_identity(w: &Workload) -> ([u8; 32], [u8; 16]) {
    use sha2::{Digest, Sha256};
    let fingerprint: [u8; 32] = Sha256::digest(request(w)).into();
    (fingerprint, *FencingToken::random().as_bytes())
}

/// The fenced floor's claim: `SET key <in-progress record> NX GET PX`, one command; its
/// answer (nil when claimed, else the record).
async fn floor_claim(
    conn: &mut ConnectionManager,
    key: &str,
    fingerprint: &[u8; 32],
    token: &[u8; 16],
) -> Result<redis::Value, String> {
    let mut record = [0u8; 59];
    record[0] = b'P';
    record[1..17].copy_from_slice(token);
    record[17..23].copy_from_slice(&millis(RETENTION).to_be_bytes()[2..]);
    record[23..55].copy_from_slice(fingerprint);
    record[55..59].copy_from_slice(&1u32.to_be_bytes());
    redis::cmd("SET")
        .arg(key)
        .arg(record.as_slice())
        .arg("NX")
        .arg("GET")
        .arg("PX")
        .arg(30_000 + millis(RETENTION))
        .query_async(conn)
        .await
        .map_err(|e| format!("fenced floor: {e}"))
}

/// The completed record's expiry, in Unix seconds, as idem writes it.
fn expires_at() -> u32 {
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .saturating_add(RETENTION);
    u32::try_from(at.as_secs()).unwrap_or(u32::MAX)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Claims a key that [`lifecycle`] completed: it replays.
async fn replay(side: &Side, w: &Workload, key: String) -> Result<&'static str, String> {
    let replayed = match side {
        Side::Idem { store, .. } => {
            let id = idem_id(&key)?;
            match idem_begin(store, w, &id).await? {
                Begin::Replay(r) => r.completion.response.body == w.body,
                other => return Err(format!("idem: no replay: {other:?}")),
            }
        }
        Side::Idempotent(store) => {
            let key = IdempotencyKey::new(key).map_err(|e| e.to_string())?;
            let fp = DefaultFingerprintStrategy.compute(OPERATION, &w.body);
            match store
                .try_insert(&key, IdempotencyEntry::new(fp, RETENTION))
                .await
            {
                Ok(InsertResult::Exists(ExistingEntry::Completed(entry))) => {
                    entry.fingerprint_matches(fp) && entry.response().body == w.body
                }
                other => return Err(format!("idempotent: no replay: {other:?}")),
            }
        }
        Side::Klauthed(store) => {
            let key = format!("{}{key}", w.prefix["klauthed"]);
            match store.begin(&key).await {
                Ok(Outcome::Completed(value)) => value == *w.json,
                other => return Err(format!("klauthed-data: no replay: {other:?}")),
            }
        }
        Side::Floor(conn, _) => {
            let key = format!("{}{key}", w.prefix["floor"]);
            let (fingerprint, token) = floor_identity(w);
            match floor_claim(&mut conn.clone(), &key, &fingerprint, &token).await? {
                redis::Value::BulkString(record) => {
                    record.get(1..33) == Some(fingerprint.as_slice())
                        && record.get(41..) == Some(&w.body[..])
                }
                other => return Err(format!("fenced floor: no replay: {other:?}")),
            }
        }
    };
    if replayed {
        Ok("replayed")
    } else {
        Err(format!("{}: the replayed response differs", side.name()))
    }
}

/// The Redis key of a side's record of `key`.
fn redis_key(side: &Side, w: &Workload, key: &str) -> Result<String, String> {
    Ok(match side {
        Side::Idem { store, .. } => store.record_key(&idem_id(key)?),
        Side::Idempotent(_) => format!("{}-{key}", w.prefix["idempotent"]),
        Side::Klauthed(_) => format!("{}{key}", w.prefix["klauthed"]),
        Side::Floor(..) => format!("{}{key}", w.prefix["floor"]),
    })
}

fn idem_id(key: &str) -> Result<RecordId, String> {
    Ok(RecordId::new(
        Scope::global(),
        Key::new(key).map_err(|e| e.to_string())?,
    ))
}

/// The request bytes idem and the fenced floor fingerprint per operation: the operation, a
/// newline, the body.
fn request(w: &Workload) -> Vec<u8> {
    let mut request = Vec::with_capacity(OPERATION.len() + 1 + w.body.len());
    request.extend_from_slice(OPERATION.as_bytes());
    request.push(b'\n');
    request.extend_from_slice(&w.body);
    request
}

async fn idem_begin(store: &RedisStore, w: &Workload, id: &RecordId) -> Result<Begin, String> {
    store
        .begin(BeginRequest {
            id,
            fingerprint: Fingerprint::of_bytes(&request(w)),
            token: FencingToken::random(),
            lease: Duration::from_secs(30),
            retention: RETENTION,
        })
        .await
        .map_err(|e| format!("idem: {e}"))
}

#[allow(clippy::too_many_arguments)]
fn report(
    s: &Args,
    url: &str,
    sides: &[Side],
    cluster: &Option<Side>,
    samples: &BTreeMap<(String, String), Vec<Sample>>,
    breakdown: &BTreeMap<(String, String), String>,
    usage: &BTreeMap<String, Vec<f64>>,
) {
    let labels = [
        format!("lifecycle c={}", s.concurrency),
        format!("replay c={}", s.concurrency),
        "lifecycle c=1".to_owned(),
        "replay c=1".to_owned(),
    ];
    let med = |side: &str, label: &str, f: fn(&Sample) -> f64| {
        samples
            .get(&(side.to_owned(), label.to_owned()))
            .map(|v| median(&v.iter().map(f).collect::<Vec<_>>()))
            .unwrap_or(f64::NAN)
    };
    let names: Vec<&str> = sides.iter().map(Side::name).collect();
    let peers: Vec<&str> = sides
        .iter()
        .filter(|s| s.is_peer())
        .map(Side::name)
        .collect();
    let mut doc = serde_json::json!({
        "url": url, "keys": s.keys, "c1_keys": s.c1_keys, "concurrency": s.concurrency,
        "rounds": s.rounds, "body_bytes": BODY.len(), "phases": [],
    });
    let mut rows = Vec::new();
    for label in &labels {
        let idem = med("idem", label, |x| x.ops_per_sec);
        let (best_name, best) = peers
            .iter()
            .map(|n| (*n, med(n, label, |x| x.ops_per_sec)))
            .fold(("", 0.0), |a, b| if b.1 > a.1 { b } else { a });
        let mut phase = serde_json::json!({"phase": label, "ratio_idem_to_best_peer": idem / best, "best_peer": best_name});
        for name in &names {
            phase[*name] = serde_json::json!({
                "ops_per_sec": med(name, label, |x| x.ops_per_sec),
                "p50_us": med(name, label, |x| x.p50_us),
                "server_us_per_op": med(name, label, |x| x.server_us),
                "cpu_us_per_op": med(name, label, |x| x.cpu_us),
                "client_cpu_us_per_op": med(name, label, |x| x.client_us),
                "rounds_ops_per_sec": samples.get(&(name.to_string(), label.clone())).map(|v| v.iter().map(|x| x.ops_per_sec).collect::<Vec<_>>()),
                "commandstats": breakdown.get(&(name.to_string(), label.clone())),
            });
        }
        rows.push((label.clone(), idem, best_name, best));
        doc["phases"].as_array_mut().expect("array").push(phase);
    }
    let memory: Vec<(String, f64, f64, f64)> = names
        .iter()
        .map(|n| {
            (
                n.to_string(),
                med(n, &labels[0], |x| x.bytes_per_record),
                med(n, &labels[0], |x| x.bytes_net_of_tables),
                usage.get(*n).map_or(f64::NAN, |v| median(v)),
            )
        })
        .collect();
    doc["memory"] = memory
        .iter()
        .map(|(n, used, net, usage)| serde_json::json!({"side": n, "used_memory_per_record": used, "used_memory_net_of_tables": net, "memory_usage": usage}))
        .collect();
    if let Some(cl) = cluster {
        doc["cluster"] = labels[..2]
            .iter()
            .map(|l| {
                let c = med(cl.name(), l, |x| x.ops_per_sec);
                serde_json::json!({"phase": l, "ops_per_sec": c, "ratio_to_standalone": c / med("idem", l, |x| x.ops_per_sec)})
            })
            .collect();
    }
    if s.json {
        println!("{doc:#}");
        return;
    }
    println!(
        "comparison on {}: {} rounds, {} keys (c=1: {}), concurrency {}, body {} B; medians",
        url,
        s.rounds,
        s.keys,
        s.c1_keys.min(s.keys),
        s.concurrency,
        BODY.len()
    );
    print!("{:<16}", "phase");
    for n in &names {
        print!(" {n:>18}");
    }
    println!(" {:>8}  best peer", "idem/best");
    for (label, idem, best_name, best) in &rows {
        print!("{label:<16}");
        for n in &names {
            print!(" {:>16.0}/s", med(n, label, |x| x.ops_per_sec));
        }
        println!(" {:>8.2}  {best_name}", idem / best);
    }
    println!("\nRedis server time per operation (INFO commandstats; INFO cpu of the whole process in brackets), µs");
    for label in &labels {
        print!("{label:<16}");
        for n in &names {
            print!(
                " {:>8.2} [{:>6.2}]",
                med(n, label, |x| x.server_us),
                med(n, label, |x| x.cpu_us)
            );
        }
        println!();
    }
    println!("\nclient CPU per operation (this process, every thread), µs");
    for label in &labels {
        print!("{label:<16}");
        for n in &names {
            print!(" {:>17.2}", med(n, label, |x| x.client_us));
        }
        println!();
    }
    for ((side, label), parts) in breakdown {
        println!("  {side}, {label}: {parts}");
    }
    println!(
        "\nmemory per completed record, B: used_memory delta / the same net of the keyspace's \
         bucket arrays / MEMORY USAGE (sampled)"
    );
    for (n, used, net, usage) in &memory {
        println!("  {n:<20} {used:>7.1} / {net:>7.1} / {usage:>7.1}");
    }
    if let Some(cl) = cluster {
        println!(
            "\n{} (3 primaries) against the standalone figures of the same run:",
            cl.name()
        );
        for l in &labels[..2] {
            let c = med(cl.name(), l, |x| x.ops_per_sec);
            println!(
                "  {l:<16} {c:>10.0}/s  {:.2} of standalone",
                c / med("idem", l, |x| x.ops_per_sec)
            );
        }
    }
}
