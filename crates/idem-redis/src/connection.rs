//! Connections: a `ConnectionManager` for one server, a cluster connection for Redis Cluster,
//! chosen by the URL.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use idem_core::Error;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr,
};
use redis::{Cmd, ProtocolVersion, RedisFuture, Value};
use tokio::sync::{mpsc, OnceCell};

use crate::config::RedisConfig;
use crate::error::classify;
use crate::notify::{self, PubSub};

/// The URL scheme that selects Redis Cluster.
pub(crate) const CLUSTER_SCHEME: &str = "redis+cluster://";
/// The URL scheme that selects Redis Cluster over TLS.
pub(crate) const CLUSTER_TLS_SCHEME: &str = "rediss+cluster://";
/// The longest pause between two attempts of a reconnection (redis-rs's backoff grows up to
/// it). A call that finds a reconnection in its pause waits that long at most.
const RECONNECT_MAX_DELAY: Duration = Duration::from_millis(500);
/// The query parameter naming a PEM file of certificate authorities to trust instead of the
/// system's roots (a private CA): `rediss://host:6380/?tls_ca_file=/etc/idem/ca.pem`.
const TLS_CA_FILE: &str = "tls_ca_file";
/// The refusal of a TLS URL by a build without TLS.
const NO_TLS: &str = "redis url: rediss:// needs TLS, and idem-redis was built without it: \
                      enable its `tls-rustls` (or `tls-native-tls`) feature";

/// Where the store's connections go. Cheap to clone.
#[derive(Clone)]
pub(crate) enum Connection {
    Standalone(ConnectionManager),
    Cluster(Arc<ClusterHandle>),
}

/// A cluster client and its connection, made on first use (so a store can be built while
/// the cluster is down). Once made, the connection refreshes its slot map and reconnects
/// to nodes by itself.
pub(crate) struct ClusterHandle {
    client: ClusterClient,
    nodes: usize,
    connection: OnceCell<ClusterConnection>,
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Standalone(_) => f.write_str("Standalone"),
            Self::Cluster(handle) => write!(f, "Cluster({} seed nodes)", handle.nodes),
        }
    }
}

impl Connection {
    /// Builds the store's connection for `url` without connecting, and the client of its
    /// waiters' subscriptions, trusting the same certificates. Must run inside a Tokio
    /// runtime.
    pub(crate) fn open(url: &str, config: &RedisConfig) -> Result<(Self, PubSub), Error> {
        let (url, ca_file) = split_ca_file(url)?;
        let url = url.as_str();
        // A cluster: the URL after its scheme, and whether the scheme asks for TLS.
        let cluster = [(CLUSTER_SCHEME, false), (CLUSTER_TLS_SCHEME, true)]
            .into_iter()
            .find_map(|(scheme, tls)| Some((url.strip_prefix(scheme)?, tls)));
        let tls = cluster.map_or(url.starts_with("rediss://"), |(_, tls)| tls);
        if tls && !cfg!(any(feature = "tls-rustls", feature = "tls-native-tls")) {
            return Err(Error::Invalid(NO_TLS.into()));
        }
        if ca_file.is_some() && !tls {
            return Err(Error::Invalid(format!(
                "redis url: {TLS_CA_FILE} is for TLS connections: use rediss:// (or \
                 {CLUSTER_TLS_SCHEME})"
            )));
        }
        let certs = ca_file.map(|path| {
            std::fs::read(&path).map(CaCerts).map_err(|e| {
                let path = path.display();
                Error::Invalid(format!("redis url: cannot read {TLS_CA_FILE} {path}: {e}"))
            })
        });
        let certs = certs.transpose()?;
        // The waiters' subscriptions speak RESP3, which redis-rs needs for pub/sub on a
        // multiplexed connection; what their servers push goes to `pushes`.
        let (push, pushes) = mpsc::unbounded_channel();
        if let Some((rest, tls)) = cluster {
            let nodes = cluster_nodes(rest, tls)?;
            let count = nodes.len();
            let builder = |certs: Option<CaCerts>| {
                let builder = ClusterClientBuilder::new(nodes.clone())
                    .connection_timeout(config.connect_timeout)
                    .response_timeout(config.response_timeout)
                    // Redirections, reconnections and retries (redis-rs's defaults) each
                    // have their own bound; a request as a whole has the caller's (core's
                    // store timeout), not the response timeout redis-rs would put on it,
                    // which a redirection during a failover easily outlasts.
                    .overall_response_timeout(None);
                match certs {
                    None => Ok(builder),
                    #[cfg(feature = "tls-rustls")]
                    Some(certs) => Ok(builder.certs(certs.tls())),
                    #[cfg(not(feature = "tls-rustls"))]
                    Some(_) => Err(Error::Invalid(format!(
                        "redis url: {TLS_CA_FILE} on a cluster needs idem-redis's `tls-rustls` \
                         feature"
                    ))),
                }
            };
            let client = builder(certs.clone())?.build().map_err(invalid)?;
            let subscriber = builder(certs)?
                .use_protocol(ProtocolVersion::RESP3)
                .push_sender(push)
                .build()
                .map_err(invalid)?;
            let handle = ClusterHandle {
                client,
                nodes: count,
                connection: OnceCell::new(),
            };
            let client = notify::Client::Cluster(subscriber);
            return Ok((Self::Cluster(Arc::new(handle)), PubSub { client, pushes }));
        }
        let client = match certs {
            None => redis::Client::open(url).map_err(invalid)?,
            #[cfg(any(feature = "tls-rustls", feature = "tls-native-tls"))]
            Some(certs) => redis::Client::build_with_tls(url, certs.tls()).map_err(invalid)?,
            #[cfg(not(any(feature = "tls-rustls", feature = "tls-native-tls")))]
            Some(_) => return Err(Error::Invalid(NO_TLS.into())),
        };
        let manager = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.connect_timeout))
            .set_response_timeout(Some(config.response_timeout))
            .set_number_of_retries(config.reconnect_retries)
            .set_min_delay(Duration::from_millis(20))
            .set_max_delay(RECONNECT_MAX_DELAY);
        let info = client.get_connection_info().clone();
        let resp3 = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        let subscriber = redis::Client::open(info.set_redis_settings(resp3)).map_err(invalid)?;
        let manager = ConnectionManager::new_lazy_with_config(client, manager);
        let client = notify::Client::One(subscriber, push);
        Ok((
            Self::Standalone(manager.map_err(invalid)?),
            PubSub { client, pushes },
        ))
    }

    /// A handle to send commands on, connecting first if needed.
    pub(crate) async fn get(&self) -> Result<Conn, Error> {
        match self {
            Self::Standalone(manager) => Ok(Conn::Standalone(manager.clone())),
            Self::Cluster(handle) => handle
                .connection
                .get_or_try_init(|| handle.client.get_async_connection())
                .await
                .cloned()
                .map(Conn::Cluster)
                .map_err(classify),
        }
    }
}

fn invalid(e: redis::RedisError) -> Error {
    Error::Invalid(format!("redis url: {e}"))
}

/// One handle on the store's connection, for the length of a call.
pub(crate) enum Conn {
    Standalone(ConnectionManager),
    Cluster(ClusterConnection),
}

/// A server to send a command to: the one server, or a cluster primary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Node {
    Only,
    Primary { host: String, port: u16 },
}

impl Conn {
    /// `WAIT replicas timeout` on the connection that wrote `key`: the multiplexed
    /// connection of a standalone store, or in a cluster the connection to the primary of
    /// `key`'s slot. Returns how many replicas acknowledged.
    pub(crate) async fn wait(
        &mut self,
        key: &str,
        replicas: u32,
        timeout: Duration,
    ) -> Result<u32, Error> {
        let mut wait = redis::cmd("WAIT");
        wait.arg(replicas)
            .arg(u64::try_from(timeout.as_millis().max(1)).unwrap_or(u64::MAX));
        let reply = match self {
            Self::Standalone(manager) => wait.query_async::<Value>(manager).await,
            Self::Cluster(cluster) => {
                let route = Route::with_key(key.as_bytes(), SlotAddr::Master);
                cluster
                    .route_command(
                        wait,
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
                    )
                    .await
            }
        }
        .map_err(classify)?;
        match reply {
            Value::Int(n) => Ok(u32::try_from(n).unwrap_or(0)),
            other => Err(crate::error::unexpected("WAIT", &other)),
        }
    }

    /// `INFO <section>` of every primary (one text for a standalone server).
    pub(crate) async fn info(&mut self, section: &str) -> Result<Vec<String>, redis::RedisError> {
        let mut info = redis::cmd("INFO");
        info.arg(section);
        self.on_primaries(info).await
    }

    /// The text of what every primary answers `cmd` (one primary for a standalone server).
    async fn on_primaries(&mut self, cmd: Cmd) -> Result<Vec<String>, redis::RedisError> {
        let reply = match self {
            Self::Standalone(manager) => cmd.query_async::<Value>(manager).await?,
            Self::Cluster(cluster) => {
                let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                cluster.route_command(cmd, all).await?
            }
        };
        let mut texts = Vec::new();
        collect_text(reply, &mut texts);
        Ok(texts)
    }

    /// Whether every primary persists nothing: no append-only file (`INFO persistence`) and
    /// no RDB save points (`CONFIG GET save`). `false` when it cannot be told (a managed
    /// service that refuses `CONFIG`).
    pub(crate) async fn persists_nothing(&mut self) -> Result<bool, redis::RedisError> {
        let texts = self.info("persistence").await?;
        let mut save = redis::cmd("CONFIG");
        save.arg("GET").arg("save");
        let Ok(saves) = self.on_primaries(save).await else {
            return Ok(false);
        };
        let aof_off = values(&texts, "aof_enabled").all(|v| v == "0");
        // CONFIG GET answers [name, value] pairs: every value must be empty.
        let no_snapshots = saves.iter().all(|v| v == "save" || v.trim().is_empty());
        Ok(aof_off && no_snapshots && !texts.is_empty())
    }

    /// The servers holding records: the one server, or every cluster primary (from
    /// `CLUSTER SLOTS`).
    pub(crate) async fn primaries(&mut self) -> Result<Vec<Node>, Error> {
        let Self::Cluster(cluster) = self else {
            return Ok(vec![Node::Only]);
        };
        let mut slots = redis::cmd("CLUSTER");
        slots.arg("SLOTS");
        let reply = cluster
            .route_command(
                slots,
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary),
            )
            .await
            .map_err(classify)?;
        let Value::Array(ranges) = &reply else {
            return Err(crate::error::unexpected("CLUSTER SLOTS", &reply));
        };
        let mut nodes = Vec::new();
        for range in ranges {
            // [start, end, [host, port, id, ...], replicas...]
            let primary = match range {
                Value::Array(parts) => parts.get(2),
                _ => None,
            };
            let Some(Value::Array(addr)) = primary else {
                return Err(crate::error::unexpected("CLUSTER SLOTS", &reply));
            };
            let [Value::BulkString(host), Value::Int(port), ..] = addr.as_slice() else {
                return Err(crate::error::unexpected("CLUSTER SLOTS", &reply));
            };
            let node = Node::Primary {
                host: String::from_utf8_lossy(host).into_owned(),
                port: u16::try_from(*port).unwrap_or(0),
            };
            if !nodes.contains(&node) {
                nodes.push(node);
            }
        }
        Ok(nodes)
    }

    /// Sends `cmd` to `node`.
    pub(crate) async fn on_node(&mut self, node: &Node, cmd: Cmd) -> Result<Value, Error> {
        match (self, node) {
            (Self::Cluster(cluster), Node::Primary { host, port }) => cluster
                .route_command(cmd, RoutingInfo::SingleNode(by_address(host, *port)))
                .await
                .map_err(classify),
            (this, _) => cmd.query_async(this).await.map_err(classify),
        }
    }

    /// Sends a pipeline of `count` commands to `node`, in one round trip.
    pub(crate) async fn pipeline_on_node(
        &mut self,
        node: &Node,
        pipe: redis::Pipeline,
        count: usize,
    ) -> Result<Vec<Value>, Error> {
        match (self, node) {
            (Self::Cluster(cluster), Node::Primary { host, port }) => cluster
                .route_pipeline(pipe, 0, count, by_address(host, *port))
                .await
                .map_err(classify),
            (this, _) => pipe.query_async(this).await.map_err(classify),
        }
    }
}

fn by_address(host: &str, port: u16) -> SingleNodeRoutingInfo {
    SingleNodeRoutingInfo::ByAddress {
        host: host.to_owned(),
        port,
    }
}

/// The values of the `name:` lines of `INFO` texts.
pub(crate) fn values<'a>(texts: &'a [String], name: &'a str) -> impl Iterator<Item = &'a str> {
    let lines = texts.iter().flat_map(|text| text.lines());
    lines.filter_map(move |line| Some(line.strip_prefix(name)?.strip_prefix(':')?.trim()))
}

/// Gathers the text of an `INFO` reply, which a cluster answers with a map of node to text.
fn collect_text(value: Value, out: &mut Vec<String>) {
    match value {
        Value::BulkString(bytes) => out.push(String::from_utf8_lossy(&bytes).into_owned()),
        Value::SimpleString(text) => out.push(text),
        Value::VerbatimString { text, .. } => out.push(text),
        Value::Map(pairs) => pairs.into_iter().for_each(|(_, v)| collect_text(v, out)),
        Value::Array(items) => items.into_iter().for_each(|v| collect_text(v, out)),
        _ => {}
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Standalone(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Standalone(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Standalone(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// PEM bytes of the certificate authorities to trust, as redis-rs takes them.
#[derive(Debug, Clone)]
#[cfg_attr(
    not(any(feature = "tls-rustls", feature = "tls-native-tls")),
    allow(dead_code)
)]
struct CaCerts(Vec<u8>);

/// Takes the `tls_ca_file` parameter out of a URL's query (redis-rs does not know it): the
/// URL without it, and the path it names.
fn split_ca_file(url: &str) -> Result<(String, Option<std::path::PathBuf>), Error> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), None));
    };
    let (query, fragment) = match query.split_once('#') {
        Some((query, fragment)) => (query, Some(fragment)),
        None => (query, None),
    };
    let mut ca_file = None;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some((TLS_CA_FILE, value)) => {
                let path = percent_encoding::percent_decode_str(value)
                    .decode_utf8()
                    .map_err(|_| {
                        Error::Invalid(format!("redis url: {TLS_CA_FILE} is not valid UTF-8"))
                    })?;
                ca_file = Some(std::path::PathBuf::from(path.as_ref()));
            }
            _ => kept.push(pair),
        }
    }
    let mut out = base.to_owned();
    if !kept.is_empty() {
        out.push('?');
        out.push_str(&kept.join("&"));
    }
    if let Some(fragment) = fragment {
        out.push('#');
        out.push_str(fragment);
    }
    Ok((out, ca_file))
}

#[cfg(any(feature = "tls-rustls", feature = "tls-native-tls"))]
impl CaCerts {
    fn tls(self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(self.0),
        }
    }
}

/// Splits `[user[:password]@]host:port[,host:port...][/]` into one `redis://` (or, with
/// `tls`, `rediss://`) URL per node.
fn cluster_nodes(rest: &str, tls: bool) -> Result<Vec<String>, Error> {
    let (scheme, node_scheme) = match tls {
        true => (CLUSTER_TLS_SCHEME, "rediss://"),
        false => (CLUSTER_SCHEME, "redis://"),
    };
    // The hosts only: the user and password stay out of the message.
    let shown = rest.rsplit_once('@').map_or(rest, |(_, hosts)| hosts);
    let invalid = |why: &str| {
        Error::Invalid(format!(
            "redis cluster url {scheme}{shown}: {why}; expected \
             {scheme}[user:password@]host:port[,host:port...]"
        ))
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains(['/', '?', '#']) {
        return Err(invalid(
            "a path or query is not supported (Redis Cluster has database 0 only)",
        ));
    }
    let (auth, hosts) = match rest.rsplit_once('@') {
        Some((auth, hosts)) => (format!("{auth}@"), hosts),
        None => (String::new(), rest),
    };
    let nodes: Vec<String> = hosts
        .split(',')
        .map(str::trim)
        .map(|node| {
            let (host, port) = node
                .rsplit_once(':')
                .ok_or_else(|| invalid("a node has no port"))?;
            if host.is_empty() || port.parse::<u16>().is_err() {
                return Err(invalid("a node is not host:port"));
            }
            Ok(format!("{node_scheme}{auth}{node}"))
        })
        .collect::<Result<_, _>>()?;
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_urls() {
        assert_eq!(
            cluster_nodes("127.0.0.1:7000,127.0.0.1:7001/", false).unwrap(),
            ["redis://127.0.0.1:7000", "redis://127.0.0.1:7001"]
        );
        assert_eq!(
            cluster_nodes("u:p@h:1", false).unwrap(),
            ["redis://u:p@h:1"]
        );
        for bad in ["", "h", "h:x", ":1", "h:1/2", "h:1?a=b"] {
            assert!(
                matches!(cluster_nodes(bad, false), Err(Error::Invalid(_))),
                "{bad}"
            );
        }
        let Err(Error::Invalid(message)) = cluster_nodes("u:secret@h", false) else {
            panic!("accepted a node with no port")
        };
        assert!(!message.contains("secret"), "{message}");
    }
}
