//! `idem consume`: reads a RabbitMQ queue, a NATS JetStream subject or a Redis stream and
//! delivers each message once per idempotency key to an HTTP handler of any service.
//!
//! The decisions are idem-consumer's (`Consumer`, run by each broker's `Worker`: leases,
//! fencing, attempts, retries, dead letters); the HTTP call is idem-proxy's pooled upstream
//! client (`Forward`). What is written here is the message's request and how the handler's
//! answer maps onto a handler result: 2xx a value to store, a terminal 4xx a terminal
//! failure, everything else a retryable one.

use std::fmt;
use std::io::Write as _;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use clap::Args;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderName, HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use idem_consumer::{
    Consumer, Context, FingerprintSource, KeySource, Message, OnTerminal, Policy, Summary,
    IDEMPOTENCY_KEY_HEADER,
};
use idem_core::{Failure, Idem, JsonSelection, Scope};
use idem_proxy::{Forward, HostHeader, UpstreamConfig, UpstreamFailure, ATTEMPT};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde::{Deserialize, Serialize};
use tower_service::Service as _;

use crate::{parse_secs, CliError, Done, StoreArg};

/// The forms `--from` takes, for its errors.
const FROM_FORMS: &str = "amqp://USER:PASS@HOST:PORT[/VHOST]/QUEUE (RabbitMQ), \
    nats://HOST:PORT/STREAM/SUBJECT[?consumer=NAME] (NATS JetStream), or \
    redis://[:PASS@]HOST:PORT[/DB]/STREAM[?group=GROUP&consumer=NAME] (Redis Streams)";

/// `idem consume`'s flags.
#[derive(Debug, Args)]
pub struct ConsumeArgs {
    /// Where messages come from: `amqp://USER:PASS@HOST:PORT[/VHOST]/QUEUE` (RabbitMQ;
    /// `%2f` is the vhost `/`), `nats://HOST:PORT/STREAM/SUBJECT[?consumer=NAME]` (NATS
    /// JetStream; consumer default `<STREAM>-idem`), or
    /// `redis://[:PASS@]HOST:PORT[/DB]/STREAM[?group=GROUP&consumer=NAME]` (Redis Streams;
    /// group default `idem`, consumer default one per process). Queues, streams, the group
    /// and the durable consumer are created when missing, with their retry and dead-letter
    /// queues or streams.
    // The URL may hold a password: `--help` must not print the variable's value.
    #[arg(
        long,
        value_name = "URL",
        env = "IDEM_CONSUME_FROM",
        hide_env_values = true
    )]
    from: String,
    /// The handler: `http://HOST:PORT[/PREFIX]` or `https://...`; `--path` is appended.
    #[arg(long, value_name = "URL")]
    to: String,
    #[command(flatten)]
    store: StoreArg,
    /// Apply idem's migrations at start (PostgreSQL and tiered stores).
    #[arg(long)]
    migrate: bool,
    /// On PostgreSQL and tiered stores, delete expired records every SECS.
    #[arg(long, default_value = "60", value_name = "SECS", value_parser = parse_secs)]
    purge_every: Duration,
    /// The scope of the messages' records [default: the queue, `<stream>/<consumer>` on
    /// NATS, `<stream>/<group>` on Redis]. Never the scope of an HTTP API whose keys the
    /// messages carry.
    #[arg(long)]
    scope: Option<String>,
    /// How long a message holds its key while the handler works (renewed meanwhile); a
    /// crashed `idem consume`'s keys are taken over by a redelivery after it.
    #[arg(long, default_value = "30", value_name = "SECS", value_parser = parse_secs)]
    lease: Duration,
    /// How long a handled key is remembered: a copy arriving later runs again.
    #[arg(long, default_value = "86400", value_name = "SECS", value_parser = parse_secs)]
    retention: Duration,
    /// Where a message's key comes from: a message header (`header`, see `--key-header`),
    /// a hash of the JSON payload (`payload`, see `--key-fields` and `--key-ignore`), or
    /// the header when present and the hash otherwise (`header-or-payload`).
    #[arg(long, default_value = "header", value_parser = ["header", "payload", "header-or-payload"])]
    key: String,
    /// The message header holding the key.
    #[arg(long, value_name = "NAME", default_value = IDEMPOTENCY_KEY_HEADER)]
    key_header: String,
    /// With `--key payload`: hash only these JSON pointers of the payload
    /// (comma-separated, e.g. `/order_id,/amount`) [default: the whole payload].
    #[arg(
        long,
        value_name = "POINTERS",
        value_delimiter = ',',
        conflicts_with = "key_ignore"
    )]
    key_fields: Option<Vec<String>>,
    /// With `--key payload`: hash the payload without these JSON pointers (volatile
    /// fields, e.g. `/sent_at,/trace_id`).
    #[arg(long, value_name = "POINTERS", value_delimiter = ',')]
    key_ignore: Option<Vec<String>>,
    /// What tells a duplicate from a reused key: the payload's bytes (`payload`), or its
    /// canonical JSON without the `--key-ignore` fields, or only the `--key-fields` ones
    /// (`json`).
    #[arg(long, default_value = "payload", value_parser = ["payload", "json"])]
    fingerprint: String,
    /// The method of the handler's request.
    #[arg(long, default_value = "POST", value_parser = parse_method)]
    method: Method,
    /// The path of the handler's request, after the `--to` prefix; `{key}` is replaced by
    /// the message's key, percent-encoded.
    #[arg(long, default_value = "/", value_name = "TEMPLATE")]
    path: String,
    /// The request's `Content-Type` when the message has none.
    #[arg(long, default_value = "application/json", value_name = "TYPE")]
    content_type: String,
    /// Message headers passed to the handler as `X-Idem-Message-<NAME>` (comma-separated;
    /// `*` for all) [default: none].
    #[arg(long, value_name = "NAMES", value_delimiter = ',')]
    message_headers: Vec<String>,
    /// The handler's statuses that are final failures (the message is dead-lettered at
    /// once, or stored per `--on-terminal`), comma-separated. Other statuses below 200 or
    /// from 300 are retried.
    #[arg(long, value_name = "CODES", value_delimiter = ',', default_value = "400,404,409,410,422", value_parser = parse_status)]
    terminal_status: Vec<StatusCode>,
    /// How long the handler has to answer with a response head; a timeout is retried,
    /// with the key held until its lease ends (the handler may still be working).
    #[arg(long, default_value = "30", value_name = "SECS", value_parser = parse_secs)]
    timeout: Duration,
    /// The most bytes of a 2xx answer's body kept as the stored value (the rest is cut).
    #[arg(long, default_value = "65536", value_name = "BYTES")]
    max_body: usize,
    /// How many handler calls run at once.
    #[arg(long, default_value = "4", value_name = "N")]
    concurrency: usize,
    /// How many times the handler may run on one message before it is dead-lettered.
    #[arg(long, default_value = "5", value_name = "N")]
    max_attempts: u32,
    /// The delay before the second attempt; it doubles with each further attempt.
    #[arg(long, default_value = "1", value_name = "SECS", value_parser = parse_secs)]
    retry_delay: Duration,
    /// The longest delay between two attempts (a `Retry-After` is honoured up to it).
    #[arg(long, default_value = "60", value_name = "SECS", value_parser = parse_secs)]
    max_retry_delay: Duration,
    /// What a terminal answer does: dead-letter the message and forget the key
    /// (`dead-letter`), store it and ack every copy (`store-and-ack`), or store it and
    /// dead-letter the message (`store-and-dead-letter`).
    #[arg(long, default_value = "dead-letter", value_parser = ["dead-letter", "store-and-ack", "store-and-dead-letter"])]
    on_terminal: String,
    /// Serve `/metrics`, `/livez` and `/readyz` (broker and store reachable) on this address.
    #[arg(long, value_name = "ADDR", value_parser = crate::parse_listen)]
    admin_listen: Option<std::net::SocketAddr>,
    /// On SIGTERM, how long the handler calls in flight may take to finish and be settled;
    /// those still running then are cut off, unsettled, and the broker delivers their
    /// messages again.
    #[arg(long, default_value = "30", value_name = "SECS", value_parser = parse_secs)]
    shutdown_timeout: Duration,
    /// How long a RabbitMQ delivery, JetStream message (`ack_wait`, when the consumer is
    /// created) or Redis Streams entry (`XAUTOCLAIM` idle time) waits for a sign of life
    /// before the broker hands it to another consumer.
    #[arg(long, default_value = "30", value_name = "SECS", value_parser = parse_secs)]
    redelivery: Duration,
}

fn parse_method(text: &str) -> Result<Method, String> {
    let upper = text.trim().to_ascii_uppercase();
    Method::from_bytes(upper.as_bytes())
        .map_err(|_| format!("an HTTP method such as POST expected, not {text:?}"))
}

fn parse_status(text: &str) -> Result<StatusCode, String> {
    text.trim()
        .parse::<u16>()
        .ok()
        .and_then(|code| StatusCode::from_u16(code).ok())
        .filter(|s| s.is_client_error() || s.is_server_error())
        .ok_or_else(|| format!("a status from 400 to 599 expected, not {text:?}"))
}

/// Where messages come from, as `--from` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum BrokerUrl {
    Rabbit {
        /// The connection URL: `--from` without the queue.
        url: String,
        queue: String,
    },
    Nats {
        url: String,
        stream: String,
        subject: String,
        consumer: Option<String>,
    },
    Redis {
        url: String,
        stream: String,
        group: Option<String>,
        consumer: Option<String>,
    },
}

impl BrokerUrl {
    /// Reads `--from`.
    ///
    /// # Errors
    ///
    /// [`CliError::Usage`] naming the broker and the form it expects.
    fn parse(text: &str) -> Result<Self, CliError> {
        let bad = |broker: &str, form: &str, what: &str| {
            CliError::Usage(format!(
                "--from {}: {what}; {broker} is read from {form}",
                redact(text)
            ))
        };
        let mut url = url::Url::parse(text.trim()).map_err(|e| {
            CliError::Usage(format!(
                "--from {} is not a URL ({e}); expected {FROM_FORMS}",
                redact(text)
            ))
        })?;
        let segments: Vec<String> = url
            .path_segments()
            .map(|s| s.map(str::to_owned).collect())
            .unwrap_or_default();
        let segments: Vec<String> = segments.into_iter().filter(|s| !s.is_empty()).collect();
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8_lossy()
                .into_owned()
        };
        match url.scheme() {
            "amqp" | "amqps" => {
                const FORM: &str = "amqp://USER:PASS@HOST:PORT[/VHOST]/QUEUE, e.g. \
                    amqp://guest:guest@127.0.0.1:5672/%2f/orders";
                let Some((queue, vhost)) = segments.split_last() else {
                    return Err(bad("RabbitMQ", FORM, "no queue named"));
                };
                if vhost.len() > 1 {
                    return Err(bad("RabbitMQ", FORM, "a path of VHOST/QUEUE expected"));
                }
                let queue = decode(queue);
                url.set_path(&vhost.first().map_or(String::new(), |v| format!("/{v}")));
                Ok(Self::Rabbit {
                    url: url.to_string(),
                    queue,
                })
            }
            "nats" | "tls" => {
                const FORM: &str = "nats://HOST:PORT/STREAM/SUBJECT[?consumer=NAME], e.g. \
                    nats://127.0.0.1:4222/ORDERS/orders.created";
                let [stream, subject] = segments.as_slice() else {
                    return Err(bad(
                        "NATS JetStream",
                        FORM,
                        "a path of STREAM/SUBJECT expected",
                    ));
                };
                let mut consumer = None;
                for (name, value) in url.query_pairs() {
                    match &*name {
                        "consumer" => consumer = Some(value.into_owned()),
                        other => {
                            return Err(bad(
                                "NATS JetStream",
                                FORM,
                                &format!("unknown parameter {other:?} (only consumer=NAME)"),
                            ))
                        }
                    }
                }
                let (stream, subject) = (decode(stream), decode(subject));
                url.set_path("");
                url.set_query(None);
                Ok(Self::Nats {
                    url: url.to_string(),
                    stream,
                    subject,
                    consumer,
                })
            }
            "redis" | "rediss" => {
                const FORM: &str =
                    "redis://[:PASS@]HOST:PORT[/DB]/STREAM[?group=GROUP&consumer=NAME], \
                    e.g. redis://127.0.0.1:6379/0/orders?group=billing";
                let (db, stream) = match segments.as_slice() {
                    [stream] => (None, stream),
                    [db, stream] if db.parse::<u32>().is_ok() => (Some(db), stream),
                    [db, _] => {
                        return Err(bad(
                            "Redis Streams",
                            FORM,
                            &format!("the database must be a number, not {db:?}"),
                        ))
                    }
                    _ => return Err(bad("Redis Streams", FORM, "a path of [DB/]STREAM expected")),
                };
                let (mut group, mut consumer, mut rest) = (None, None, Vec::new());
                for (name, value) in url.query_pairs() {
                    match &*name {
                        "group" => group = Some(value.into_owned()),
                        "consumer" => consumer = Some(value.into_owned()),
                        _ => rest.push((name.into_owned(), value.into_owned())),
                    }
                }
                let stream = decode(stream);
                url.set_path(&db.map_or(String::new(), |db| format!("/{db}")));
                url.set_query(None);
                if !rest.is_empty() {
                    url.query_pairs_mut().extend_pairs(rest);
                }
                Ok(Self::Redis {
                    url: url.to_string(),
                    stream,
                    group,
                    consumer,
                })
            }
            other => Err(CliError::Usage(format!(
                "--from {}: no broker is read from {other}:// URLs; expected {FROM_FORMS}",
                redact(text)
            ))),
        }
    }

    /// The record scope when `--scope` is not given.
    fn default_scope(&self) -> String {
        match self {
            Self::Rabbit { queue, .. } => queue.clone(),
            Self::Nats {
                stream, consumer, ..
            } => format!(
                "{stream}/{}",
                consumer.clone().unwrap_or_else(|| format!("{stream}-idem"))
            ),
            Self::Redis { stream, group, .. } => {
                format!("{stream}/{}", group.as_deref().unwrap_or("idem"))
            }
        }
    }
}

impl fmt::Display for BrokerUrl {
    /// The source for the start-up line, without a password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Rabbit { url, queue } => {
                write!(f, "RabbitMQ queue {queue:?} at {}", redact(url))
            }
            Self::Nats {
                url,
                stream,
                subject,
                ..
            } => write!(
                f,
                "NATS JetStream stream {stream:?}, subject {subject:?} at {}",
                redact(url)
            ),
            Self::Redis { url, stream, .. } => {
                write!(f, "Redis stream {stream:?} at {}", redact(url))
            }
        }
    }
}

/// `url` without its password, for messages.
fn redact(url: &str) -> String {
    match url::Url::parse(url.trim()) {
        Ok(mut parsed) if parsed.password().is_some() => {
            let _ = parsed.set_password(Some("***"));
            parsed.to_string()
        }
        _ => url.to_owned(),
    }
}

/// What every handler call shares: the client, and how a message becomes a request.
struct Target {
    forward: Forward,
    method: Method,
    /// `--path`, split at each `{key}`.
    path: Vec<String>,
    content_type: HeaderValue,
    /// `None`: every header.
    message_headers: Option<Vec<String>>,
    terminal: Vec<StatusCode>,
    max_body: usize,
    /// How long a key stays held after a call whose outcome is unknown.
    lease: Duration,
}

/// What is stored for a message the handler took: its status and (the start of) its body.
#[derive(Debug, Serialize, Deserialize)]
pub struct Answer {
    status: u16,
    body: String,
}

/// The characters a key keeps in the path: RFC 3986's unreserved ones.
const PATH_KEEP: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

impl Target {
    fn new(args: &ConsumeArgs) -> Result<Self, CliError> {
        let mut upstream =
            UpstreamConfig::new(&args.to).map_err(|e| CliError::Usage(format!("--to: {e}")))?;
        upstream.timeout = args.timeout;
        // The request is made here, not received: the handler's URL is its `Host`.
        upstream.host = HostHeader::Upstream;
        let forward = Forward::new(&upstream).map_err(|e| CliError::Usage(e.to_string()))?;
        if !args.path.starts_with('/') {
            return Err(CliError::Usage(format!(
                "--path must start with /, such as /messages or /orders/{{key}}, not {:?}",
                args.path
            )));
        }
        let path = args.path.split("{key}").map(str::to_owned).collect();
        let content_type = HeaderValue::from_str(&args.content_type).map_err(|_| {
            CliError::Usage(format!(
                "--content-type {:?} is not a header value",
                args.content_type
            ))
        })?;
        let message_headers = if args.message_headers.iter().any(|h| h.trim() == "*") {
            None
        } else {
            Some(
                args.message_headers
                    .iter()
                    .map(|h| h.trim().to_owned())
                    .collect(),
            )
        };
        Ok(Self {
            forward,
            method: args.method.clone(),
            path,
            content_type,
            message_headers,
            terminal: args.terminal_status.clone(),
            max_body: args.max_body,
            lease: args.lease,
        })
    }

    /// The handler's request for `message`, run as `ctx`.
    fn request(&self, message: &Message, ctx: &Context) -> Result<Request<Full<Bytes>>, String> {
        let key = utf8_percent_encode(ctx.key().as_str(), PATH_KEEP).to_string();
        let path = self.path.join(&key);
        let mut req = Request::builder().method(self.method.clone()).uri(path);
        let content_type = message
            .text_header("content-type")
            .and_then(|t| HeaderValue::from_str(t).ok())
            .unwrap_or_else(|| self.content_type.clone());
        req = req
            .header(CONTENT_TYPE, content_type)
            .header("idempotency-key", ctx.key().as_str())
            .header(ATTEMPT, ctx.attempt());
        for (name, value) in message.headers() {
            let wanted = match &self.message_headers {
                None => true,
                Some(names) => names.iter().any(|n| n.eq_ignore_ascii_case(name)),
            };
            if !wanted {
                continue;
            }
            let value = match value {
                idem_consumer::HeaderValue::Text(text) => text.clone(),
                idem_consumer::HeaderValue::Int(n) => n.to_string(),
            };
            let header = HeaderName::from_bytes(format!("x-idem-message-{name}").as_bytes());
            match (header, HeaderValue::from_str(&value)) {
                (Ok(header), Ok(value)) => req = req.header(header, value),
                // A name or value HTTP cannot carry (a space, a line break) is left out.
                _ => tracing::debug!(header = %name, "message header not sent: not valid in HTTP"),
            }
        }
        req.body(Full::new(Bytes::copy_from_slice(message.payload())))
            .map_err(|e| format!("the request for the handler cannot be built: {e}"))
    }

    /// Delivers `message` to the handler, and says what its answer means.
    async fn deliver(&self, message: Message, ctx: Context) -> Result<Answer, Failure<String>> {
        let req = self.request(&message, &ctx).map_err(Failure::Terminal)?;
        let started = tokio::time::Instant::now();
        let sent = self.forward.clone().call(req).await;
        metrics::histogram!("idem_consume_handler_duration_seconds")
            .record(started.elapsed().as_secs_f64());
        let response = match sent {
            Ok(response) => response,
            Err(failure) => return Err(self.unanswered(failure).await),
        };
        let status = response.status();
        answered(status);
        if let Some(after) = retry_after(response.headers().get(RETRY_AFTER)) {
            ctx.retry_after(after);
        }
        let body = self.read_body(response.into_body()).await;
        if status.is_success() {
            return Ok(Answer {
                status: status.as_u16(),
                body,
            });
        }
        let error = format!(
            "the handler answered {status}: {}",
            body.chars().take(200).collect::<String>()
        );
        if self.terminal.contains(&status) {
            Err(Failure::Terminal(error))
        } else {
            Err(Failure::Retryable(error))
        }
    }

    /// A call without an answer: retried. Refused (nothing was sent) releases the key at
    /// once; after a timeout or a broken connection the handler may still be working, so
    /// the key stays held (and renewed) for one more lease before it is released.
    async fn unanswered(&self, failure: UpstreamFailure) -> Failure<String> {
        metrics::counter!("idem_consume_answers_total", "class" => failure.kind()).increment(1);
        if failure.kind() != "upstream-unreachable" {
            tokio::time::sleep(self.lease).await;
        }
        Failure::Retryable(format!("the handler did not answer: {failure}"))
    }

    /// The body's first `max_body` bytes, as text (a body that breaks ends there).
    async fn read_body(&self, mut body: idem_proxy::ProxyBody) -> String {
        let mut bytes = Vec::new();
        while bytes.len() < self.max_body {
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        bytes.extend_from_slice(&data);
                    }
                }
                Some(Err(_)) | None => break,
            }
        }
        bytes.truncate(self.max_body);
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Counts an answer by its class: `2xx`, `4xx`, `5xx`...
fn answered(status: StatusCode) {
    let class = match status.as_u16() {
        200..=299 => "2xx",
        400..=499 => "4xx",
        500..=599 => "5xx",
        _ => "other",
    };
    metrics::counter!("idem_consume_answers_total", "class" => class).increment(1);
}

/// A `Retry-After` of seconds or an HTTP date, as a delay from now.
fn retry_after(value: Option<&HeaderValue>) -> Option<Duration> {
    let text = value?.to_str().ok()?.trim();
    if let Ok(secs) = text.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(text).ok()?;
    Some(at.duration_since(SystemTime::now()).unwrap_or_default())
}

impl ConsumeArgs {
    fn keys(&self) -> Result<(KeySource, FingerprintSource), CliError> {
        let selection = match (&self.key_fields, &self.key_ignore) {
            (Some(only), _) => JsonSelection::Only(only.clone()),
            (None, Some(except)) => JsonSelection::Except(except.clone()),
            (None, None) => JsonSelection::All,
        };
        for pointer in self.key_fields.iter().chain(&self.key_ignore).flatten() {
            if !pointer.is_empty() && !pointer.starts_with('/') {
                return Err(CliError::Usage(format!(
                    "{pointer:?} is not a JSON pointer: write /field or /a/b (RFC 6901)"
                )));
            }
        }
        let keys = match self.key.as_str() {
            "payload" => KeySource::PayloadHash(selection.clone()),
            "header-or-payload" => {
                KeySource::HeaderOrPayloadHash(self.key_header.clone(), selection.clone())
            }
            _ => KeySource::Header(self.key_header.clone()),
        };
        let fingerprints = match self.fingerprint.as_str() {
            "json" => FingerprintSource::Json(selection),
            _ => FingerprintSource::Payload,
        };
        Ok((keys, fingerprints))
    }

    fn policy(&self) -> Policy {
        let on_terminal = match self.on_terminal.as_str() {
            "store-and-ack" => OnTerminal::StoreAndAck,
            "store-and-dead-letter" => OnTerminal::StoreAndDeadLetter,
            _ => OnTerminal::DeadLetter,
        };
        Policy::default()
            .with_max_attempts(self.max_attempts.max(1))
            .with_retry_delay(self.retry_delay)
            .with_max_retry_delay(self.max_retry_delay.max(self.retry_delay))
            .with_on_terminal(on_terminal)
    }
}

/// Runs `idem consume` until SIGTERM or Ctrl-C, then lets the handler calls in flight
/// finish and settles them.
pub async fn run(args: ConsumeArgs) -> Result<Done, CliError> {
    let from = BrokerUrl::parse(&args.from)?;
    let target = Arc::new(Target::new(&args)?);
    let (keys, fingerprints) = args.keys()?;
    let scope_name = args.scope.clone().unwrap_or_else(|| from.default_scope());
    let scope = Scope::new(scope_name.clone())
        .map_err(|e| CliError::Usage(format!("invalid scope {scope_name:?} (--scope): {e}")))?;
    let (url, opened, _purge) = args
        .store
        .open_serving(args.migrate, args.purge_every)
        .await?;
    let config = idem_core::Config::default()
        .with_lease(args.lease)
        .with_retention(args.retention);
    let store = opened.store();
    let idem = Idem::from_arc(store.clone()).with_config(config);
    let consumer = Consumer::new(idem, scope)
        .with_keys(keys)
        .with_fingerprints(fingerprints)
        .with_policy(args.policy());
    let handler = move |message: Message, ctx: Context| {
        let target = target.clone();
        async move { target.deliver(message, ctx).await }
    };
    let concurrency = args.concurrency.max(1);
    let started = |what: &str| {
        tracing::info!(from = %from, to = %args.to, store = %url, concurrency, "idem consume starting");
        // Written with errors ignored: whoever started us may have closed our stdout.
        let mut out = std::io::stdout();
        let _ = writeln!(
            out,
            "idem consume: consuming {what}, delivering to {} (store: {url})",
            args.to
        );
        let _ = out.flush();
    };
    // The signal is turned into a flag, so that the drain's time limit can start from it.
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let signal = crate::shutdown_signal("idem consume");
    tokio::spawn(async move {
        signal.await;
        stop.send_replace(true);
    });
    let shutdown = {
        let mut stopping = stopping.clone();
        async move {
            let _ = stopping.wait_for(|stop| *stop).await;
        }
    };
    let exporter = crate::install_exporter()?;
    let admin = |probe: Probe| -> Result<(), CliError> {
        let Some(addr) = args.admin_listen else {
            return Ok(());
        };
        let listener = std::net::TcpListener::bind(addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .and_then(tokio::net::TcpListener::from_std)
            .map_err(|e| crate::listen_error(addr, &e))?;
        let state = Admin {
            store: store.clone(),
            probe: Arc::new(probe),
            exporter: exporter.clone(),
        };
        tokio::spawn(serve_admin(listener, state));
        Ok(())
    };
    let limit = args.shutdown_timeout;
    let summary = match &from {
        BrokerUrl::Rabbit { url, queue } => {
            use idem_consumer::rabbitmq::{Topology, Worker};
            let broker =
                |e: lapin::Error| CliError::Open(format!("RabbitMQ at {}: {e}", redact(url)));
            let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
                .await
                .map_err(broker)?;
            let conn = Arc::new(conn);
            let topology = Topology::for_queue(queue.clone());
            let channel = conn.create_channel().await.map_err(broker)?;
            topology
                .declare(&channel)
                .await
                .map_err(|e| CliError::Open(format!("RabbitMQ: declaring queue {queue:?}: {e}")))?;
            let _ = channel.close(200, "OK".into()).await;
            // Deliveries held for a delayed requeue count against the prefetch: keep room
            // above the handlers in flight.
            let prefetch = u16::try_from(concurrency.saturating_mul(4).max(16)).unwrap_or(u16::MAX);
            let worker = Worker::new(consumer, topology)
                .with_prefetch(prefetch)
                .with_concurrency(concurrency);
            admin(Probe::Rabbit(conn.clone()))?;
            started(&from.to_string());
            let run = worker.run(&conn, handler, shutdown);
            drive(run, stopping, limit, "RabbitMQ").await?
        }
        BrokerUrl::Nats {
            url,
            stream,
            subject,
            consumer: name,
        } => {
            use idem_consumer::nats::{Topology, Worker};
            let client = async_nats::connect(url.as_str())
                .await
                .map_err(|e| CliError::Open(format!("NATS at {}: {e}", redact(url))))?;
            let js = async_nats::jetstream::new(client.clone());
            let mut topology =
                Topology::new(stream.clone(), subject.clone()).with_ack_wait(args.redelivery);
            if let Some(name) = name {
                topology = topology.with_consumer(name.clone());
            }
            topology.declare(&js).await.map_err(|e| match e {
                idem_consumer::nats::Error::TailWildcard { .. } => {
                    CliError::Usage(format!("--from: {e}"))
                }
                e => CliError::Open(format!("NATS JetStream: {e}")),
            })?;
            let worker = Worker::new(consumer, topology)
                .with_batch(concurrency.saturating_mul(2))
                .with_concurrency(concurrency);
            admin(Probe::Nats(client))?;
            started(&from.to_string());
            let run = worker.run(&js, handler, shutdown);
            drive(run, stopping, limit, "NATS JetStream").await?
        }
        BrokerUrl::Redis {
            url,
            stream,
            group,
            consumer: name,
        } => {
            use idem_consumer::redis_streams::{Topology, Worker};
            let client = redis::Client::open(url.as_str())
                .map_err(|e| CliError::Usage(format!("--from {}: {e}", redact(url))))?;
            let mut conn = client
                .get_connection_manager()
                .await
                .map_err(|e| CliError::Open(format!("Redis at {}: {e}", redact(url))))?;
            let mut topology = Topology::new(stream.clone()).with_claim_idle(args.redelivery);
            if let Some(group) = group {
                topology = topology.with_group(group.clone());
            }
            topology
                .declare(&mut conn)
                .await
                .map_err(|e| CliError::Open(e.to_string()))?;
            let mut worker = Worker::new(consumer, topology)
                .with_batch(concurrency.saturating_mul(2))
                .with_concurrency(concurrency);
            if let Some(name) = name {
                worker = worker.with_name(name.clone());
            }
            admin(Probe::Redis(conn))?;
            started(&from.to_string());
            let run = worker.run(&client, handler, shutdown);
            drive(run, stopping, limit, "Redis Streams").await?
        }
    };
    Ok(Done::ok(match summary {
        Some(summary) => stopped(&summary),
        None => "idem consume: stopped at --shutdown-timeout with handler calls in flight; \
                 their messages were not settled and are delivered again\n"
            .to_owned(),
    }))
}

/// Runs a worker's `run` until it returns, or until `limit` after the shutdown signal
/// (`stopping`): then the handler calls still in flight are dropped, their deliveries
/// unsettled (the broker delivers them again when the connection closes), and `None`.
async fn drive<E: fmt::Display>(
    run: impl std::future::Future<Output = Result<Summary, E>>,
    mut stopping: tokio::sync::watch::Receiver<bool>,
    limit: Duration,
    broker: &str,
) -> Result<Option<Summary>, CliError> {
    let cut_off = async move {
        let _ = stopping.wait_for(|stop| *stop).await;
        tokio::time::sleep(limit).await;
    };
    tokio::select! {
        done = run => done
            .map(Some)
            .map_err(|e| CliError::Open(format!("{broker}: {e}"))),
        () = cut_off => {
            tracing::warn!(timeout = ?limit, "handler calls still in flight at the shutdown timeout were cut off, unsettled");
            Ok(None)
        }
    }
}

/// How `/readyz` checks the broker.
enum Probe {
    Rabbit(Arc<lapin::Connection>),
    Nats(async_nats::Client),
    Redis(redis::aio::ConnectionManager),
}

impl Probe {
    /// `Err` with why when the broker is out of reach.
    async fn check(&self) -> Result<(), String> {
        match self {
            Self::Rabbit(conn) if conn.status().connected() => Ok(()),
            Self::Rabbit(_) => Err("the RabbitMQ connection is closed".into()),
            Self::Nats(client) => match client.connection_state() {
                async_nats::connection::State::Connected => Ok(()),
                state => Err(format!("NATS is {state}")),
            },
            Self::Redis(conn) => {
                let (mut conn, cmd) = (conn.clone(), redis::cmd("PING"));
                let ping = cmd.query_async::<()>(&mut conn);
                match tokio::time::timeout(Duration::from_secs(2), ping).await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(format!("Redis: {e}")),
                    Err(_) => Err("Redis did not answer PING within 2 s".into()),
                }
            }
        }
    }
}

/// What the admin endpoints read.
#[derive(Clone)]
struct Admin {
    store: Arc<dyn idem_core::Store>,
    probe: Arc<Probe>,
    exporter: metrics_exporter_prometheus::PrometheusHandle,
}

/// Serves `GET /metrics` (Prometheus text), `/livez` (200 while the process runs) and
/// `/readyz` (200 while the broker is connected and the store answers a read within 2 s,
/// else 503 saying which is not).
async fn serve_admin(listener: tokio::net::TcpListener, admin: Admin) {
    use axum::extract::State;
    use axum::routing::get;
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(|State(admin): State<Admin>| async move { admin.exporter.render() }),
        )
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .with_state(admin);
    if let Err(e) = axum::serve(listener, app).await {
        tracing::warn!(error = %e, "the admin endpoints stopped");
    }
}

async fn ready(axum::extract::State(admin): axum::extract::State<Admin>) -> (StatusCode, String) {
    if let Err(why) = admin.probe.check().await {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("broker unavailable: {why}\n"),
        );
    }
    // Any read will do: the answer (no such record) says the store is reachable.
    let probe = idem_core::RecordId::new(
        Scope::global(),
        idem_core::Key::new("idem-consume-readyz").expect("a valid key"),
    );
    match tokio::time::timeout(Duration::from_secs(2), admin.store.get(&probe)).await {
        Ok(Ok(_)) => (StatusCode::OK, "ready\n".into()),
        Ok(Err(e)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("store unavailable: {e}\n"),
        ),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "store unavailable: no answer within 2 s\n".into(),
        ),
    }
}

/// The last line: what the run did.
fn stopped(summary: &Summary) -> String {
    format!(
        "idem consume: stopped: {} acked, {} requeued, {} retried, {} dead-lettered, {} \
         unsettled (delivered again by the broker)\n",
        summary.acked, summary.requeued, summary.retried, summary.dead_lettered, summary.unsettled
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_urls_name_the_broker_and_the_parts() {
        assert_eq!(
            BrokerUrl::parse("amqp://guest:guest@127.0.0.1:5672/%2f/orders").unwrap(),
            BrokerUrl::Rabbit {
                url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
                queue: "orders".into()
            }
        );
        assert_eq!(
            BrokerUrl::parse("amqp://127.0.0.1/orders").unwrap(),
            BrokerUrl::Rabbit {
                url: "amqp://127.0.0.1".into(),
                queue: "orders".into()
            }
        );
        assert_eq!(
            BrokerUrl::parse("nats://127.0.0.1:4222/ORDERS/orders.*?consumer=billing").unwrap(),
            BrokerUrl::Nats {
                url: "nats://127.0.0.1:4222".into(),
                stream: "ORDERS".into(),
                subject: "orders.*".into(),
                consumer: Some("billing".into()),
            }
        );
        assert_eq!(
            BrokerUrl::parse("redis://:pw@127.0.0.1:6379/2/orders?group=billing").unwrap(),
            BrokerUrl::Redis {
                url: "redis://:pw@127.0.0.1:6379/2".into(),
                stream: "orders".into(),
                group: Some("billing".into()),
                consumer: None,
            }
        );
        assert_eq!(
            BrokerUrl::parse("redis://127.0.0.1:6379/orders")
                .unwrap()
                .default_scope(),
            "orders/idem"
        );
    }

    #[test]
    fn malformed_from_urls_say_the_form_without_the_password() {
        for (bad, broker) in [
            ("amqp://guest:secret@127.0.0.1:5672", "RabbitMQ"),
            ("amqp://guest:secret@h/a/b/c", "RabbitMQ"),
            ("nats://127.0.0.1:4222/ORDERS", "NATS JetStream"),
            ("nats://127.0.0.1:4222/S/s?durable=x", "NATS JetStream"),
            ("redis://:secret@127.0.0.1:6379", "Redis Streams"),
            ("redis://127.0.0.1:6379/db/orders", "Redis Streams"),
            ("kafka://127.0.0.1:9092/orders", "amqp://"),
            ("orders", "amqp://"),
        ] {
            let Err(CliError::Usage(message)) = BrokerUrl::parse(bad) else {
                panic!("{bad} was taken")
            };
            assert!(message.contains(broker), "{bad}: {message}");
            assert!(!message.contains("secret"), "{bad}: {message}");
        }
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        let value = |text: &'static str| retry_after(Some(&HeaderValue::from_static(text)));
        assert_eq!(value("7"), Some(Duration::from_secs(7)));
        assert_eq!(value("Thu, 01 Jan 1970 00:00:00 GMT"), Some(Duration::ZERO));
        assert_eq!(value("soon"), None);
        assert_eq!(retry_after(None), None);
    }
}
