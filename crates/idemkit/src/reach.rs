//! Why a store's server cannot be reached, and what to do about it: the explanations an
//! [`OpenError`](crate::OpenError) gives when opening a store fails (nothing listens, no answer, another
//! protocol on that port, TLS asked of a server without it).

use std::io::{Read as _, Write as _};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use idem_core::Error;

/// What is wrong with reaching `url`'s server after opening a store failed with `e`, said
/// with its fix: found by looking at the error's causes and, when they say nothing clear, at
/// what answers on the port (a probe of at most two short exchanges, off the runtime's
/// threads). `None` when neither tells more than `e` itself.
pub(crate) async fn explain(url: &str, e: &Error) -> Option<String> {
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
    // ask the port itself.
    let reach = ask(&addr).await;
    describe(url, &addr, reach)
}

/// What answers at `url`'s address instead of the server the URL expects (another
/// protocol, or a Redis without the TLS a `rediss://` URL asks for), said as [`explain`]
/// says it; `None` when nothing answers there, or nothing that tells. A service may start
/// and wait for a server that is not there yet, never for one that another server's port
/// will never become.
#[cfg(feature = "redis")]
pub(crate) async fn foreign(url: &str) -> Option<String> {
    let (host, port) = host_port(url)?;
    let addr = format!("{host}:{port}");
    match ask(&addr).await {
        reach @ Reach::Speaks(_) => describe(url, &addr, reach),
        _ => None,
    }
}

/// [`probe`] of `addr`, off the runtime's threads.
async fn ask(addr: &str) -> Reach {
    let target = addr.to_owned();
    tokio::task::spawn_blocking(move || probe(&target))
        .await
        .unwrap_or(Reach::Unknown)
}

/// What `reach`, found at `addr`, means for `url`, with its fix; `None` when it is what the
/// URL expects, or tells nothing.
fn describe(url: &str, addr: &str, reach: Reach) -> Option<String> {
    let expected = if url.starts_with("postgres") {
        Protocol::Postgres
    } else {
        Protocol::Redis
    };
    let tls = url.starts_with("rediss");
    match reach {
        Reach::Refused => Some(refused(addr)),
        Reach::NoAnswer => Some(format!(
            "no answer from {addr} (timed out): check the host and port, and that no firewall \
             drops the connection"
        )),
        // A TLS handshake to a plain-text Redis gets no TLS answer: the connection times out.
        Reach::Speaks(Protocol::Redis) if tls => Some(format!(
            "{addr} speaks Redis without TLS and this rediss:// URL asks for TLS: use \
             redis://{addr}, or the server's TLS port (its tls-port setting)"
        )),
        Reach::Speaks(found) if found != expected => Some(format!(
            "{addr} speaks {} and this URL expects {}: {}",
            found.name(),
            expected.name(),
            found.fix(addr)
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
    Amqp,
    Nats,
}

impl Protocol {
    fn name(self) -> &'static str {
        match self {
            Self::Redis => "Redis",
            Self::Postgres => "PostgreSQL",
            Self::Http => "HTTP",
            Self::Amqp => "AMQP (RabbitMQ)",
            Self::Nats => "NATS",
        }
    }

    fn fix(self, addr: &str) -> String {
        match self {
            Self::Redis => format!("use redis://{addr}"),
            Self::Postgres => format!("use postgres://USER@{addr}/DB"),
            Self::Http => "that is a web server, not a store: check the port".to_owned(),
            Self::Amqp | Self::Nats => {
                "that is a message broker, not a store: check the port".to_owned()
            }
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
        // An AMQP server answers any other greeting with its own protocol header; a NATS
        // server speaks first, with INFO.
        Ok(reply) if reply.starts_with(b"AMQP") => return Reach::Speaks(Protocol::Amqp),
        Ok(reply) if reply.starts_with(b"INFO ") => return Reach::Speaks(Protocol::Nats),
        Ok(reply) if is_http(&reply) => return Reach::Speaks(Protocol::Http),
        Ok(reply) => reply,
    };
    match exchange(b"PING\r\n\r\n") {
        Err(reach) => reach,
        Ok(reply) if reply.is_empty() && first.is_empty() => Reach::Silent,
        Ok(reply) if is_http(&reply) => Reach::Speaks(Protocol::Http),
        Ok(reply) if reply.starts_with(b"+") || reply.starts_with(b"-") => {
            Reach::Speaks(Protocol::Redis)
        }
        Ok(reply) if reply.first() == Some(&b'E') => Reach::Speaks(Protocol::Postgres),
        Ok(_) => Reach::Unknown,
    }
}

/// Whether `reply` is a web server's: a status line, or the bare HTML error page some send
/// to a request without an HTTP version (Python's `http.server` does, as for HTTP/0.9).
fn is_http(reply: &[u8]) -> bool {
    reply.starts_with(b"HTTP/") || reply.starts_with(b"<!DOCTYPE") || reply.starts_with(b"<html")
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

/// Whether `error` says Redis is out of reach (nothing listening, no answer, the connection
/// dropped), as opposed to reached and refusing us (a certificate from another authority, a
/// wrong password): only the first is worth starting without it.
#[cfg(feature = "redis")]
pub(crate) fn is_unreachable(error: &Error) -> bool {
    use std::io::ErrorKind;
    if !error.is_retryable() {
        return false;
    }
    type Shared = std::sync::Arc<dyn std::error::Error + Send + Sync>;
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(cause) = source {
        // redis-rs keeps an I/O error in an `Arc`, whose own `source` skips it.
        let io = cause.downcast_ref::<std::io::Error>().or_else(|| {
            cause
                .downcast_ref::<Shared>()
                .and_then(|shared| shared.downcast_ref::<std::io::Error>())
        });
        if let Some(io) = io {
            return matches!(
                io.kind(),
                ErrorKind::ConnectionRefused
                    | ErrorKind::ConnectionReset
                    | ErrorKind::ConnectionAborted
                    | ErrorKind::NotConnected
                    | ErrorKind::BrokenPipe
                    | ErrorKind::TimedOut
                    | ErrorKind::HostUnreachable
                    | ErrorKind::NetworkUnreachable
                    | ErrorKind::AddrNotAvailable
                    | ErrorKind::NotFound
            );
        }
        source = cause.source();
    }
    // No I/O error underneath: the call's own time limit ran out, or the server answered
    // that it cannot serve yet (LOADING, ...).
    true
}

/// Builds the Redis store without connecting and logs `Redis reachable` once it answers
/// (trying every second): for a service whose other tier answers meanwhile (the tiered
/// store, whose PostgreSQL decides alone, and the relay, whose outbox keeps the rows),
/// after a connect failed with an error that [`is_unreachable`] accepts. `name` is how the
/// log names this Redis (without its password).
#[cfg(feature = "redis")]
pub(crate) fn connect_later(
    builder: idem_redis::RedisStoreBuilder,
    name: &str,
) -> Result<idem_redis::RedisStore, Error> {
    use idem_core::{Key, RecordId, Scope, Store as _};
    let redis = builder.connect_lazy()?;
    let (probe, name) = (redis.clone(), name.to_owned());
    tokio::spawn(async move {
        let id = RecordId::new(Scope::global(), Key::new("idem-reachability-probe")?);
        while probe.get(&id).await.is_err() {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        tracing::info!(redis = %name, "Redis reachable");
        Ok::<_, idem_core::KeyError>(())
    });
    Ok(redis)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
