//! Redis: the raw floor (PING, `SET key value NX PX` on new keys) through the same client
//! library and connection type as the store, and the server's own counters (`INFO
//! commandstats`, `INFO memory`, `MEMORY USAGE`).

use std::collections::BTreeMap;
use std::sync::Arc;

use redis::aio::{ConnectionManager, MultiplexedConnection};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, FromRedisValue};

use crate::phases::drive;
use crate::report::PhaseReport;

/// The scheme of a Redis Cluster URL (as `idemkit::redis::RedisStore` takes it).
const CLUSTER_SCHEME: &str = "redis+cluster://";

/// The connection the floor is measured on: what `RedisStore` uses for the same URL (a
/// `ConnectionManager` over one multiplexed connection, or the cluster client's connection).
#[derive(Clone)]
enum FloorConn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// A Redis server or cluster under test.
pub struct RedisSide {
    conn: FloorConn,
    /// One connection per primary, for `INFO`.
    primaries: Vec<(String, MultiplexedConnection)>,
    /// Where the floor's keys go (this run's prefix).
    prefix: String,
}

/// How many keys [`RedisSide::mean_memory_usage`] samples.
pub const SAMPLES: usize = 200;

/// Calls and microseconds of each command, summed over the primaries.
pub type CommandStats = BTreeMap<String, (u64, u64)>;

impl RedisSide {
    /// Connects to `url` (`redis://` or `redis+cluster://`); the floor's keys start with
    /// `prefix`.
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, String> {
        let err = |e: redis::RedisError| format!("redis {url}: {e}");
        let (conn, primaries) = if let Some(rest) = url.strip_prefix(CLUSTER_SCHEME) {
            let nodes: Vec<String> = rest
                .trim_end_matches('/')
                .split(',')
                .map(|n| format!("redis://{}", n.trim()))
                .collect();
            let client = ClusterClient::new(nodes.clone()).map_err(err)?;
            let conn = client.get_async_connection().await.map_err(err)?;
            let mut seed = single(&nodes[0]).await?;
            let layout: String = redis::cmd("CLUSTER")
                .arg("NODES")
                .query_async(&mut seed)
                .await
                .map_err(err)?;
            let mut primaries = Vec::new();
            for addr in primaries_of(&layout) {
                primaries.push((addr.clone(), single(&format!("redis://{addr}")).await?));
            }
            if primaries.is_empty() {
                return Err(format!("redis {url}: CLUSTER NODES lists no primary"));
            }
            (FloorConn::Cluster(conn), primaries)
        } else {
            let client = redis::Client::open(url).map_err(err)?;
            let manager = ConnectionManager::new(client).await.map_err(err)?;
            (
                FloorConn::Single(manager),
                vec![(url.to_owned(), single(url).await?)],
            )
        };
        Ok(Self {
            conn,
            primaries,
            prefix: prefix.to_owned(),
        })
    }

    /// How many primaries the counters are summed over.
    pub fn primaries(&self) -> usize {
        self.primaries.len()
    }

    async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, String> {
        match self.conn.clone() {
            FloorConn::Single(mut c) => cmd.query_async(&mut c).await,
            FloorConn::Cluster(mut c) => cmd.query_async(&mut c).await,
        }
        .map_err(|e| format!("redis: {e}"))
    }

    /// `n` PINGs from `concurrency` callers.
    pub async fn ping(
        self: &Arc<Self>,
        name: &str,
        n: usize,
        concurrency: usize,
    ) -> Result<PhaseReport, String> {
        let this = self.clone();
        drive(name, n, concurrency, move |_| {
            let this = this.clone();
            async move {
                match this.conn.clone() {
                    FloorConn::Single(mut c) => redis::cmd("PING").query_async::<()>(&mut c).await,
                    // The cluster client sends a key-less PING to every primary and waits
                    // for all; one round trip to one node is the floor.
                    FloorConn::Cluster(mut c) => c
                        .route_command(
                            redis::cmd("PING"),
                            RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary),
                        )
                        .await
                        .map(drop),
                }
                .map_err(|e| format!("redis: {e}"))?;
                Ok("pong")
            }
        })
        .await
    }

    /// `SET key value NX PX` on `n` new keys (value of `value_bytes`), from `concurrency`
    /// callers; the keys expire by themselves after `ttl_ms`.
    pub async fn set_nx(
        self: &Arc<Self>,
        n: usize,
        concurrency: usize,
        value_bytes: usize,
        ttl_ms: u64,
    ) -> Result<PhaseReport, String> {
        let this = self.clone();
        let value: Arc<[u8]> = vec![b'x'; value_bytes].into();
        drive("redis SET NX", n, concurrency, move |i| {
            let (this, value) = (this.clone(), value.clone());
            async move {
                let mut cmd = redis::cmd("SET");
                cmd.arg(this.floor_key(i))
                    .arg(&*value)
                    .arg("NX")
                    .arg("PX")
                    .arg(ttl_ms);
                match this.query::<Option<String>>(&cmd).await? {
                    Some(_) => Ok("set"),
                    None => Ok("existed"),
                }
            }
        })
        .await
    }

    /// The key of the floor's `i`-th `SET NX`.
    pub fn floor_key(&self, i: usize) -> String {
        format!("{}floor:{i}", self.prefix)
    }

    /// `INFO commandstats`, summed over the primaries.
    pub async fn command_stats(&self) -> Result<CommandStats, String> {
        let mut total = CommandStats::new();
        for (_, text) in self.info("commandstats").await? {
            for (name, (calls, usec)) in parse_commandstats(&text) {
                let e = total.entry(name).or_insert((0, 0));
                e.0 += calls;
                e.1 += usec;
            }
        }
        Ok(total)
    }

    /// `used_memory` of `INFO memory`, summed over the primaries.
    pub async fn used_memory(&self) -> Result<u64, String> {
        let mut total = 0;
        for (addr, text) in self.info("memory").await? {
            total += info_field::<u64>(&text, "used_memory")
                .ok_or_else(|| format!("redis {addr}: INFO memory has no used_memory"))?;
        }
        Ok(total)
    }

    /// `used_cpu_sys + used_cpu_user` of `INFO cpu` (the server process's CPU seconds),
    /// summed over the primaries.
    pub async fn used_cpu(&self) -> Result<f64, String> {
        let mut total = 0.0;
        for (addr, text) in self.info("cpu").await? {
            for field in ["used_cpu_sys", "used_cpu_user"] {
                total += info_field::<f64>(&text, field)
                    .ok_or_else(|| format!("redis {addr}: INFO cpu has no {field}"))?;
            }
        }
        Ok(total)
    }

    /// `MEMORY STATS` of every primary, their flat name/value lists one after the other.
    pub async fn memory_stats(&self) -> Result<Vec<redis::Value>, String> {
        let mut out = Vec::new();
        for (addr, conn) in &self.primaries {
            let reply: Vec<redis::Value> = redis::cmd("MEMORY")
                .arg("STATS")
                .query_async(&mut conn.clone())
                .await
                .map_err(|e| format!("redis {addr}: MEMORY STATS: {e}"))?;
            out.extend(reply);
        }
        Ok(out)
    }

    /// The mean `MEMORY USAGE key SAMPLES 0` (the whole value counted; the cluster client
    /// routes it to the key's node) of up to [`SAMPLES`] keys spread evenly over
    /// `key(0..n)`.
    pub async fn mean_memory_usage(
        &self,
        n: usize,
        key: impl Fn(usize) -> Result<String, String>,
    ) -> Result<f64, String> {
        let (mut total, mut count) = (0u64, 0u64);
        for i in (0..n).step_by((n / SAMPLES).max(1)).take(SAMPLES) {
            let mut cmd = redis::cmd("MEMORY");
            cmd.arg("USAGE").arg(key(i)?).arg("SAMPLES").arg(0);
            if let Some(bytes) = self.query::<Option<u64>>(&cmd).await? {
                total += bytes;
                count += 1;
            }
        }
        if count == 0 {
            return Err("MEMORY USAGE found none of the sampled keys".into());
        }
        Ok(total as f64 / count as f64)
    }

    async fn info(&self, section: &str) -> Result<Vec<(String, String)>, String> {
        let mut out = Vec::new();
        for (addr, conn) in &self.primaries {
            let text: String = redis::cmd("INFO")
                .arg(section)
                .query_async(&mut conn.clone())
                .await
                .map_err(|e| format!("redis {addr}: INFO {section}: {e}"))?;
            out.push((addr.clone(), text));
        }
        Ok(out)
    }
}

async fn single(url: &str) -> Result<MultiplexedConnection, String> {
    redis::Client::open(url)
        .map_err(|e| format!("redis {url}: {e}"))?
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| format!("redis {url}: {e}"))
}

/// The `host:port` of every live primary in a `CLUSTER NODES` reply
/// (`<id> <ip:port@cport[,hostname]> <flags> ...`).
fn primaries_of(layout: &str) -> Vec<String> {
    layout
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (_, addr, flags) = (fields.next()?, fields.next()?, fields.next()?);
            let flags: Vec<&str> = flags.split(',').collect();
            if !flags.contains(&"master") || flags.iter().any(|f| f.starts_with("fail")) {
                return None;
            }
            Some(addr.split(['@', ',']).next()?.to_owned())
        })
        .collect()
}

/// `cmdstat_<name>:calls=N,usec=M,...` lines as name -> (calls, usec).
fn parse_commandstats(text: &str) -> CommandStats {
    let mut stats = CommandStats::new();
    for line in text.lines() {
        let Some((name, fields)) = line
            .trim()
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let field = |key: &str| {
            fields
                .split(',')
                .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
                .and_then(|v| v.parse::<u64>().ok())
        };
        if let (Some(calls), Some(usec)) = (field("calls"), field("usec")) {
            stats.insert(name.to_ascii_lowercase(), (calls, usec));
        }
    }
    stats
}

/// What each command did between two snapshots: (calls, usec), commands with no calls left
/// out.
pub fn stats_delta(before: &CommandStats, after: &CommandStats) -> CommandStats {
    after
        .iter()
        .filter_map(|(name, &(calls, usec))| {
            let (c0, u0) = before.get(name).copied().unwrap_or((0, 0));
            let d = (calls.saturating_sub(c0), usec.saturating_sub(u0));
            (d.0 > 0).then(|| (name.clone(), d))
        })
        .collect()
}

/// The value of `key` in an `INFO` reply.
fn info_field<T: std::str::FromStr>(text: &str, key: &str) -> Option<T> {
    text.lines()
        .find_map(|l| l.trim().strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commandstats_lines_parse_and_subtract() {
        let before = parse_commandstats(
            "# Commandstats\r\ncmdstat_ping:calls=10,usec=5,usec_per_call=0.50,rejected_calls=0,failed_calls=0\r\n",
        );
        let after = parse_commandstats(
            "# Commandstats\r\ncmdstat_ping:calls=30,usec=15,usec_per_call=0.50,rejected_calls=0,failed_calls=0\r\n\
             cmdstat_evalsha:calls=4,usec=40,usec_per_call=10.00,rejected_calls=0,failed_calls=0\r\n\
             cmdstat_info:calls=2,usec=40,usec_per_call=20.00,rejected_calls=0,failed_calls=0\r\n",
        );
        let d = stats_delta(&before, &after);
        assert_eq!(d["ping"], (20, 10));
        assert_eq!(d["evalsha"], (4, 40));
        assert_eq!(d.len(), 3);
    }

    #[test]
    fn cluster_nodes_give_live_primaries() {
        let layout = "a1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460\n\
                      b2 127.0.0.1:7001@17001,host master - 0 0 2 connected 5461-10922\n\
                      c3 127.0.0.1:7002@17002 slave a1 0 0 1 connected\n\
                      d4 127.0.0.1:7003@17003 master,fail - 0 0 3 connected\n";
        assert_eq!(primaries_of(layout), ["127.0.0.1:7000", "127.0.0.1:7001"]);
    }

    #[test]
    fn info_fields_by_exact_name() {
        let text = "# Memory\r\nused_memory:1000\r\nused_memory_human:1000B\r\n";
        assert_eq!(info_field(text, "used_memory"), Some(1000));
        assert_eq!(info_field::<u64>(text, "used_memory_rss"), None);
    }
}
