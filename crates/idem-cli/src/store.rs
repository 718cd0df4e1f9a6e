//! Opening the store `--store` names ([`StoreUrl`], idem-core's one parser of store URLs),
//! with `--prefix` and `--schema`, with errors that name it without its password and say
//! what is wrong (nothing listening, no answer, another protocol on that port) and what to
//! do.
//!
//! `idem serve` opens its store migrated; the operator commands open theirs without changing
//! the schema unless asked ([`SchemaMode`], `idem migrate`).

use std::io::{Read as _, Write as _};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use idem_core::url::StoreUrl;
use idem_core::{Error, MemoryStore, Store};
use idemkit::outbox::TieredStore;
use idemkit::postgres::PgStore;
use idemkit::redis::{RedisStore, RedisStoreBuilder};

use crate::CliError;

/// Reads a `--store` value.
///
/// # Errors
///
/// [`CliError::Usage`] for an unknown scheme (the message names what is accepted).
pub fn parse(url: &str) -> Result<StoreUrl, CliError> {
    StoreUrl::parse(url).map_err(|e| CliError::Usage(e.to_string()))
}

/// How to open a store.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// The Redis key prefix (`--prefix`); the store's default (`idem:`) when `None`.
    pub prefix: Option<String>,
    /// The PostgreSQL schema (`--schema`); `idem` when `None`.
    pub schema: Option<String>,
    /// What to do with PostgreSQL's schema.
    pub schema_mode: SchemaMode,
    /// Start while Redis is out of reach instead of failing: for `idem serve`, so that a
    /// restart during a Redis outage does not crash-loop. On a tiered store PostgreSQL
    /// answers alone until Redis returns; on a plain Redis store requests get 503 (fail
    /// closed) until it answers. This also marks the store as one a service runs on: only
    /// such a store warns that Redis persists nothing (an operator's command reading
    /// records is no reason to).
    pub without_redis: bool,
}

/// What opening a store does with PostgreSQL's schema.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SchemaMode {
    /// Check that every migration was applied; a missing or outdated schema is an error
    /// that says to run `idem migrate`. Changes nothing.
    #[default]
    Require,
    /// Apply the migrations (`idem migrate`, `idem serve --migrate`).
    Migrate,
    /// Neither check nor migrate (`idem migrate` looks for itself).
    Leave,
}

/// An open store, by backend: the operator commands do more on some than [`Store`] offers.
#[derive(Debug)]
pub enum Opened {
    /// The memory store.
    Memory(Arc<MemoryStore>),
    /// Redis, one server or a cluster.
    Redis(RedisStore),
    /// PostgreSQL.
    Postgres(PgStore),
    /// Redis in front of PostgreSQL.
    Tiered(TieredStore),
}

impl Opened {
    /// The store as the engine and the middleware take it.
    pub fn store(&self) -> Arc<dyn Store> {
        match self {
            Self::Memory(store) => store.clone(),
            Self::Redis(store) => Arc::new(store.clone()),
            Self::Postgres(store) => Arc::new(store.clone()),
            Self::Tiered(store) => Arc::new(store.clone()),
        }
    }

    /// The PostgreSQL store, when there is one (alone or as the arbiter of a tiered store).
    pub fn pg(&self) -> Option<&PgStore> {
        match self {
            Self::Postgres(pg) => Some(pg),
            Self::Tiered(tiered) => Some(tiered.pg()),
            _ => None,
        }
    }
}

/// Opens the store `url` names with `options`.
///
/// # Errors
///
/// [`CliError::Usage`] for a URL, prefix or schema the backend refuses;
/// [`CliError::Open`] when the store cannot be reached (saying why and what to check), or
/// when its PostgreSQL schema is missing or outdated under [`SchemaMode::Require`]. Neither
/// carries the URL's password.
pub async fn open_with(url: &StoreUrl, options: &Options) -> Result<Opened, CliError> {
    match url {
        StoreUrl::Memory => Ok(Opened::Memory(Arc::new(MemoryStore::new()))),
        StoreUrl::Redis(redis) => {
            let opened = if options.without_redis {
                open_redis_or_wait(redis, options, false).await
            } else {
                open_redis(redis, options, false).await
            };
            match opened {
                Ok(store) => Ok(Opened::Redis(store)),
                Err(e) => Err(failure(url, redis, e).await),
            }
        }
        StoreUrl::Postgres(postgres) => {
            let pg = match open_pg(postgres, options).await {
                Ok(pg) => pg,
                Err(e) => return Err(failure(url, postgres, e).await),
            };
            ready_schema(url, &pg, options, false).await?;
            Ok(Opened::Postgres(pg))
        }
        StoreUrl::Tiered { redis, postgres } => {
            let pg = match open_pg(postgres, options).await {
                Ok(pg) => pg,
                Err(e) => return Err(failure(url, postgres, e).await),
            };
            ready_schema(url, &pg, options, true).await?;
            let opened = if options.without_redis {
                open_redis_or_wait(redis, options, true).await
            } else {
                open_redis(redis, options, true).await
            };
            match opened {
                Ok(redis) => Ok(Opened::Tiered(TieredStore::new(redis, pg))),
                Err(e) => Err(failure(url, redis, e).await),
            }
        }
        other => Err(CliError::Unsupported(format!(
            "no store for {other} in this build"
        ))),
    }
}

/// The builder of a Redis store. It warns that Redis persists nothing only for a store a
/// service runs on ([`Options::without_redis`]), and never for the Redis of a tiered store
/// (`tiered`), which needs no persistence: PostgreSQL is the arbiter.
fn redis_builder(url: &str, options: &Options, tiered: bool) -> RedisStoreBuilder {
    let builder = RedisStore::builder(url).with_persistence_check(options.without_redis && !tiered);
    match &options.prefix {
        Some(prefix) => builder.with_prefix(prefix.clone()),
        None => builder,
    }
}

async fn open_redis(url: &str, options: &Options, tiered: bool) -> Result<RedisStore, Error> {
    redis_builder(url, options, tiered).connect().await
}

/// [`open_redis`], or the store built without Redis when it is out of reach, said in the
/// log in one line (and `Redis reachable` once it answers).
async fn open_redis_or_wait(
    url: &str,
    options: &Options,
    tiered: bool,
) -> Result<RedisStore, Error> {
    let name = idem_core::url::redact(url);
    let (redis, answered) = redis_builder(url, options, tiered)
        .connect_or_wait(&name)
        .await?;
    if !answered && tiered {
        tracing::warn!(
            redis = %name,
            "Redis unreachable at start: PostgreSQL answers alone until it returns"
        );
    } else if !answered {
        tracing::warn!(
            redis = %name,
            "Redis unreachable at start: guarded requests get 503 until it answers"
        );
    }
    Ok(redis)
}

async fn open_pg(url: &str, options: &Options) -> Result<PgStore, Error> {
    // The schema name is checked before connecting: a bad one is bad input whether or not
    // the server answers.
    let schema = options
        .schema
        .as_deref()
        .unwrap_or(idemkit::postgres::DEFAULT_SCHEMA);
    let pool = PgStore::pool_options()
        .connect_lazy(url)
        .map_err(|e| Error::Invalid(format!("postgres url: {e}")))?;
    let store = PgStore::new(pool).with_schema(schema)?;
    // Reach the server now, so that a wrong URL fails here.
    store
        .pool()
        .acquire()
        .await
        .map_err(idemkit::postgres::map_error)?;
    Ok(store)
}

/// Migrates, or checks that nothing is left to migrate, as `options` say: opening a store to
/// read it must not need DDL rights nor create schemas.
async fn ready_schema(
    url: &StoreUrl,
    pg: &PgStore,
    options: &Options,
    outbox: bool,
) -> Result<(), CliError> {
    let fail = |e: Error| plain_failure(url, e);
    match options.schema_mode {
        SchemaMode::Leave => return Ok(()),
        SchemaMode::Migrate if outbox => return idemkit::outbox::migrate(pg).await.map_err(fail),
        SchemaMode::Migrate => return pg.migrate().await.map_err(fail),
        SchemaMode::Require => {}
    }
    let pending = pending(pg, outbox).await.map_err(fail)?;
    if pending.is_empty() {
        return Ok(());
    }
    // Version 1 creates the records table: without it there is no idem schema at all.
    let what = if pending.contains(&1) {
        format!("has no idem tables in schema {:?}", pg.schema())
    } else {
        format!(
            "has idem's schema {:?} at an older version (migrations {pending:?} not applied)",
            pg.schema()
        )
    };
    Err(CliError::Open(format!(
        "the database of {url} {what}; run `idem migrate --store <url>{}` first (it needs \
         the right to create tables)",
        if pg.schema() == idemkit::postgres::DEFAULT_SCHEMA {
            String::new()
        } else {
            format!(" --schema {}", pg.schema())
        }
    )))
}

/// The migrations not applied yet: idem's, and the outbox's on a tiered store.
///
/// # Errors
///
/// When the database cannot be read.
pub async fn pending(pg: &PgStore, outbox: bool) -> Result<Vec<i64>, Error> {
    let mut pending = pg.pending_migrations().await?;
    if outbox {
        pending.extend(
            pg.pending_migrations_with(idemkit::outbox::migrator())
                .await?,
        );
    }
    Ok(pending)
}

/// The error of a failed open: bad input stays bad input; anything else names the store,
/// the cause and what to check (`half` is the URL of the server that failed).
async fn failure(url: &StoreUrl, half: &str, e: Error) -> CliError {
    if matches!(e, Error::Invalid(_)) {
        return plain_failure(url, e);
    }
    match diagnose(half, &e).await {
        Some(hint) => CliError::Open(format!("cannot open store {url}: {hint}")),
        None => plain_failure(url, e),
    }
}

/// The error of a failed open, as the driver tells it (without the URL's password).
fn plain_failure(url: &StoreUrl, e: Error) -> CliError {
    // Drivers may quote the URL they were given: never let its password through.
    let detail = url.scrub(&e.to_string());
    match e {
        Error::Invalid(_) => CliError::Usage(format!("cannot open store {url}: {detail}")),
        _ => CliError::Open(format!("cannot open store {url}: {detail}")),
    }
}

/// What is wrong with reaching `url`'s server, found by looking at the error's causes and,
/// when they say nothing clear, at what answers on the port.
async fn diagnose(url: &str, e: &Error) -> Option<String> {
    let (host, port) = host_port(url)?;
    let addr = format!("{host}:{port}");
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(cause) = source {
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                return Some(refused(&addr));
            }
        }
        source = cause.source();
    }
    // The driver's error does not say (a pool that timed out retrying hides the refusals):
    // ask the port itself, off the runtime's threads.
    let expected = if url.starts_with("postgres") {
        Protocol::Postgres
    } else {
        Protocol::Redis
    };
    let target = addr.clone();
    let reach = tokio::task::spawn_blocking(move || probe(&target))
        .await
        .unwrap_or(Reach::Unknown);
    match reach {
        Reach::Refused => Some(refused(&addr)),
        Reach::NoAnswer => Some(format!(
            "no answer from {addr} (timed out): check the host and port, and that no firewall \
             drops the connection"
        )),
        Reach::Speaks(found) if found != expected => Some(format!(
            "{addr} speaks {} and this URL expects {}: {}",
            found.name(),
            expected.name(),
            found.fix(&addr)
        )),
        Reach::Silent => Some(format!(
            "{addr} accepts connections but answered nothing in time (timed out): check that \
             this port is {}'s, and that the server is not stalled",
            expected.name()
        )),
        Reach::Speaks(_) | Reach::Unknown => None,
    }
}

/// What a probe of a port found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// Nothing listens there.
    Refused,
    /// No connection within the probe's time.
    NoAnswer,
    /// A server of this protocol.
    Speaks(Protocol),
    /// Something accepts connections and answers neither probe.
    Silent,
    /// A server that does not tell (or the address does not resolve).
    Unknown,
}

fn refused(addr: &str) -> String {
    format!(
        "nothing listens at {addr} (connection refused): start the server, or check the host \
         and port in the URL"
    )
}

/// The protocols a probe tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Redis,
    Postgres,
    Http,
}

impl Protocol {
    fn name(self) -> &'static str {
        match self {
            Self::Redis => "Redis",
            Self::Postgres => "PostgreSQL",
            Self::Http => "HTTP",
        }
    }

    fn fix(self, addr: &str) -> String {
        match self {
            Self::Redis => format!("use redis://{addr}"),
            Self::Postgres => format!("use postgres://USER@{addr}/DB"),
            Self::Http => "that is a web server, not a store: check the port".to_owned(),
        }
    }
}

/// Asks `addr` what it speaks: a PostgreSQL `SSLRequest` (answered `S` or `N` by PostgreSQL
/// alone), then, on a new connection, an inline `PING` (answered by Redis with `+PONG` or an
/// error, by an HTTP server with a status line). Each exchange is bounded by 1 s. Runs only
/// once opening failed, to explain why.
fn probe(addr: &str) -> Reach {
    let Some(socket) = addr.to_socket_addrs().ok().and_then(|mut a| a.next()) else {
        return Reach::Unknown;
    };
    let limit = Duration::from_secs(1);
    let exchange = |request: &[u8]| -> Result<Vec<u8>, Reach> {
        let mut stream =
            TcpStream::connect_timeout(&socket, limit).map_err(|e| match e.kind() {
                std::io::ErrorKind::ConnectionRefused => Reach::Refused,
                std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Reach::NoAnswer,
                _ => Reach::Unknown,
            })?;
        let mut reply = [0; 16];
        let n = stream
            .set_read_timeout(Some(limit))
            .and_then(|()| stream.write_all(request))
            .and_then(|()| stream.read(&mut reply))
            .unwrap_or(0);
        Ok(reply[..n].to_vec())
    };
    // SSLRequest: length 8, code 80877103.
    let first = match exchange(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f]) {
        Err(reach) => return reach,
        Ok(reply) if reply == b"N" || reply == b"S" => return Reach::Speaks(Protocol::Postgres),
        Ok(reply) => reply,
    };
    match exchange(b"PING\r\n\r\n") {
        Err(reach) => reach,
        Ok(reply) if reply.is_empty() && first.is_empty() => Reach::Silent,
        Ok(reply) if reply.starts_with(b"HTTP/") => Reach::Speaks(Protocol::Http),
        Ok(reply) if reply.starts_with(b"+") || reply.starts_with(b"-") => {
            Reach::Speaks(Protocol::Redis)
        }
        Ok(reply) if reply.first() == Some(&b'E') => Reach::Speaks(Protocol::Postgres),
        Ok(_) => Reach::Unknown,
    }
}

/// The first host and port of a store URL (`scheme://[user[:password]@]host[:port][,...][/...]`),
/// with the scheme's default port.
fn host_port(url: &str) -> Option<(String, u16)> {
    let (scheme, rest) = url.split_once("://")?;
    let default = if scheme.starts_with("postgres") {
        5432
    } else if scheme.starts_with("redis") {
        6379
    } else {
        return None;
    };
    let authority = rest.split(['/', '?', '#']).next()?;
    let hosts = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let first = hosts.split(',').next()?;
    let (host, port) = if let Some(v6) = first.strip_prefix('[') {
        let (host, after) = v6.split_once(']')?;
        (host, after.strip_prefix(':'))
    } else {
        match first.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (first, None),
        }
    };
    let host = if host.is_empty() { "localhost" } else { host };
    let port = port.map_or(Some(default), |p| p.parse().ok())?;
    Some((host.to_owned(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_schemes_are_usage_errors_without_the_password() {
        assert_eq!(parse("memory").unwrap(), StoreUrl::Memory);
        for bad in ["mysql://root:hunter2@db/x", ""] {
            let Err(CliError::Usage(msg)) = parse(bad) else {
                panic!("{bad:?} is no store")
            };
            assert!(!msg.contains("hunter2"), "{msg}");
        }
    }

    #[test]
    fn hosts_and_ports_of_urls() {
        let hp = |url| host_port(url).map(|(h, p)| format!("{h}:{p}"));
        assert_eq!(hp("redis://127.0.0.1").as_deref(), Some("127.0.0.1:6379"));
        assert_eq!(
            hp("postgres://u:p@db:5433/x?sslmode=require").as_deref(),
            Some("db:5433")
        );
        assert_eq!(
            hp("redis+cluster://a:p@h1:7000,h2:7001").as_deref(),
            Some("h1:7000")
        );
        assert_eq!(hp("redis://[::1]:6380/0").as_deref(), Some("::1:6380"));
        assert_eq!(hp("unix:///tmp/redis.sock"), None);
        assert_eq!(hp("redis://h:notaport"), None);
    }

    #[tokio::test]
    async fn opening_an_unreachable_store_names_it_without_its_password() {
        // A port nothing listens on.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = parse(&format!("redis://:hunter2@127.0.0.1:{port}")).unwrap();
        let Err(CliError::Open(msg)) = open_with(&url, &Options::default()).await else {
            panic!("nothing listens on port {port}")
        };
        assert!(msg.contains("redis://:***@127.0.0.1:"), "{msg}");
        assert!(msg.contains("connection refused"), "{msg}");
        assert!(!msg.contains("hunter2"), "{msg}");
    }
}
