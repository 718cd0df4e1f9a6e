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
use std::path::PathBuf;
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

use crate::args::parse_secs;
use crate::error::{CliError, Done};
use crate::serving::ServingStore;

/// The forms `--from` takes, for its errors.
const FROM_FORMS: &str = "amqp://USER:PASS@HOST:PORT[/VHOST]/QUEUE (RabbitMQ), \
    nats://HOST:PORT/STREAM/SUBJECT[?consumer=NAME] (NATS JetStream), or \
    redis://[:PASS@]HOST:PORT[/DB]/STREAM[?group=GROUP&consumer=NAME] (Redis Streams)";

/// `idem consume`'s flags. The settings of the handler, keys and retries are also read
/// from `--config` (the same names, `-` written `_`, and durations as `<name>_secs`); a
/// flag wins over the file, and an absent setting takes the default written beside it.
#[derive(Debug, Args)]
pub struct ConsumeArgs {
    #[command(flatten)]
    store: ServingStore,
    /// A TOML file of settings (see docs/consumers.md); flags override it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Check the flags and `--config`, print the settings, and exit without starting.
    #[arg(long)]
    check_config: bool,
    /// Serve `/metrics`, `/livez` and `/readyz` (broker and store reachable) on this address.
    #[arg(long, value_name = "ADDR", value_parser = crate::args::parse_listen)]
    admin_listen: Option<std::net::SocketAddr>,
    /// On SIGTERM, how long the handler calls in flight may take to finish and be settled;
    /// those still running then are cut off, unsettled, and the broker delivers their
    /// messages again.
    #[arg(long, default_value = "30", value_name = "SECS", value_parser = parse_secs)]
    shutdown_timeout: Duration,
    #[command(flatten)]
    settings: SettingsArgs,
}

/// The settings given as flags and in `--config` (the whole file).
#[derive(Debug, Default, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettingsArgs {
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
    from: Option<String>,
    /// The handler: `http://HOST:PORT[/PREFIX]` or `https://...`; `--path` is appended.
    #[arg(long, value_name = "URL")]
    to: Option<String>,
    /// The scope of the messages' records [default: the queue, `<stream>/<consumer>` on
    /// NATS, `<stream>/<group>` on Redis]. Never the scope of an HTTP API whose keys the
    /// messages carry.
    #[arg(long)]
    scope: Option<String>,
    /// How long a message holds its key while the handler works (renewed meanwhile); a
    /// crashed `idem consume`'s keys are taken over by a redelivery after it [default: 30].
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    #[serde(rename = "lease_secs", default, deserialize_with = "secs")]
    lease: Option<Duration>,
    /// How long a handled key is remembered: a copy arriving later runs again [default:
    /// 86400].
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    #[serde(rename = "retention_secs", default, deserialize_with = "secs")]
    retention: Option<Duration>,
    /// Where a message's key comes from: a message header (`header`, see `--key-header`),
    /// a hash of the JSON payload (`payload`, see `--key-fields` and `--key-ignore`), or
    /// the header when present and the hash otherwise (`header-or-payload`) [default:
    /// header].
    #[arg(long, value_enum)]
    key: Option<KeyFrom>,
    /// The message header holding the key [default: x-idempotency-key].
    #[arg(long, value_name = "NAME")]
    key_header: Option<String>,
    /// With `--key payload`: hash only these JSON pointers of the payload
    /// (comma-separated, e.g. `/order_id,/amount`) [default: the whole payload].
    #[arg(long, value_name = "POINTERS", value_delimiter = ',', value_parser = parse_pointer)]
    key_fields: Option<Vec<String>>,
    /// With `--key payload`: hash the payload without these JSON pointers (volatile
    /// fields, e.g. `/sent_at,/trace_id`).
    #[arg(long, value_name = "POINTERS", value_delimiter = ',', value_parser = parse_pointer)]
    key_ignore: Option<Vec<String>>,
    /// What tells a duplicate from a reused key: the payload's bytes (`payload`), or its
    /// canonical JSON without the `--key-ignore` fields, or only the `--key-fields` ones
    /// (`json`) [default: payload].
    #[arg(long, value_enum)]
    fingerprint: Option<FingerprintFrom>,
    /// The method of the handler's request [default: POST].
    #[arg(long, value_parser = parse_method)]
    #[serde(default, deserialize_with = "method")]
    method: Option<Method>,
    /// The path of the handler's request, after the `--to` prefix; `{key}` is replaced by
    /// the message's key, percent-encoded [default: /].
    #[arg(long, value_name = "TEMPLATE")]
    path: Option<String>,
    /// The request's `Content-Type` when the message has none [default: application/json].
    #[arg(long, value_name = "TYPE")]
    content_type: Option<String>,
    /// Message headers passed to the handler as `X-Idem-Message-<NAME>` (comma-separated;
    /// `*` for all) [default: none].
    #[arg(long, value_name = "NAMES", value_delimiter = ',')]
    message_headers: Option<Vec<String>>,
    /// The handler's statuses that are final failures (the message is dead-lettered at
    /// once, or stored per `--on-terminal`), comma-separated; every other status below 200
    /// or from 300 is retried [default: 400,404,409,410,422].
    #[arg(long, value_name = "CODES", value_delimiter = ',', value_parser = parse_status)]
    #[serde(default, deserialize_with = "statuses")]
    terminal_status: Option<Vec<StatusCode>>,
    /// How long the handler has to answer with a response head; a timeout is retried,
    /// with the key held until its lease ends (the handler may still be working) [default:
    /// 30].
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    #[serde(rename = "timeout_secs", default, deserialize_with = "secs")]
    timeout: Option<Duration>,
    /// The most bytes of a 2xx answer's body kept as the stored value (the rest is cut)
    /// [default: 65536].
    #[arg(long, value_name = "BYTES")]
    max_body: Option<usize>,
    /// How many handler calls run at once [default: 4].
    #[arg(long, value_name = "N")]
    concurrency: Option<usize>,
    /// How many times the handler may run on one message before it is dead-lettered
    /// [default: 5].
    #[arg(long, value_name = "N")]
    max_attempts: Option<u32>,
    /// The delay before the second attempt; it doubles with each further attempt
    /// [default: 1].
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    #[serde(rename = "retry_delay_secs", default, deserialize_with = "secs")]
    retry_delay: Option<Duration>,
    /// The longest delay between two attempts (a `Retry-After` is honoured up to it)
    /// [default: 60].
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    #[serde(rename = "max_retry_delay_secs", default, deserialize_with = "secs")]
    max_retry_delay: Option<Duration>,
    /// What a terminal answer does: dead-letter the message and forget the key
    /// (`dead-letter`), store it and ack every copy (`store-and-ack`), or store it and
    /// dead-letter the message (`store-and-dead-letter`) [default: dead-letter].
    #[arg(long, value_enum)]
    on_terminal: Option<OnTerminalSpec>,
    /// How long a RabbitMQ delivery, JetStream message (`ack_wait`, when the consumer is
    /// created) or Redis Streams entry (`XAUTOCLAIM` idle time) waits for a sign of life
    /// before the broker hands it to another consumer [default: 30].
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    #[serde(rename = "redelivery_secs", default, deserialize_with = "secs")]
    redelivery: Option<Duration>,
}

/// `--key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum KeyFrom {
    Header,
    Payload,
    HeaderOrPayload,
}

/// `--fingerprint`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum FingerprintFrom {
    Payload,
    Json,
}

/// `--on-terminal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum OnTerminalSpec {
    DeadLetter,
    StoreAndAck,
    StoreAndDeadLetter,
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

fn parse_pointer(text: &str) -> Result<String, String> {
    let text = text.trim();
    if text.is_empty() || text.starts_with('/') {
        Ok(text.to_owned())
    } else {
        Err(format!(
            "{text:?} is not a JSON pointer: write /field or /a/b (RFC 6901)"
        ))
    }
}

/// A `_secs` field of the file: a number of seconds above zero, fractions allowed.
fn secs<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let secs = idem_proxy::Secs::deserialize(d)?;
    Ok(Some(secs.0))
}

/// `method` in the file.
fn method<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Method>, D::Error> {
    let text = String::deserialize(d)?;
    parse_method(&text)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

/// `terminal_status` in the file: a list of status codes.
fn statuses<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Vec<StatusCode>>, D::Error> {
    let codes = Vec::<u16>::deserialize(d)?;
    codes
        .iter()
        .map(|code| parse_status(&code.to_string()))
        .collect::<Result<_, _>>()
        .map(Some)
        .map_err(serde::de::Error::custom)
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
    fn new(args: &Settings) -> Result<Self, CliError> {
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
            terminal: args.terminal.clone(),
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
    /// the key stays held (and renewed) for one more lease before it is released. A request
    /// that cannot be sent at all will never be: terminal.
    async fn unanswered(&self, failure: UpstreamFailure) -> Failure<String> {
        metrics::counter!("idem_consume_answers_total", "class" => failure.kind()).increment(1);
        let error = format!("the handler did not answer: {failure}");
        match failure.kind() {
            "upstream-unreachable" => {}
            "bad-target" => return Failure::Terminal(error),
            _ => tokio::time::sleep(self.lease).await,
        }
        Failure::Retryable(error)
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

/// Everything `idem consume` runs with, flags over the file over the defaults.
#[derive(Debug)]
struct Settings {
    from: BrokerUrl,
    to: String,
    scope: Scope,
    lease: Duration,
    retention: Duration,
    keys: KeySource,
    fingerprints: FingerprintSource,
    method: Method,
    path: String,
    content_type: String,
    message_headers: Vec<String>,
    terminal: Vec<StatusCode>,
    timeout: Duration,
    max_body: usize,
    concurrency: usize,
    policy: Policy,
    redelivery: Duration,
}

impl Settings {
    /// Reads `--config` (if any) and lays the flags over it.
    ///
    /// # Errors
    ///
    /// [`CliError::Usage`] naming the file, line and field, or the flag, and what is
    /// expected.
    fn resolve(args: &ConsumeArgs) -> Result<Self, CliError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => SettingsArgs::default(),
        };
        let (flags, file_settings) = (&args.settings, &file);
        let from_text = flags.from.clone().or(file.from.clone()).ok_or_else(|| {
            CliError::Usage(format!(
                "no broker to read: pass --from (or `from` in --config), one of {FROM_FORMS}"
            ))
        })?;
        let from = BrokerUrl::parse(&from_text)?;
        let to = flags.to.clone().or(file.to.clone()).ok_or_else(|| {
            CliError::Usage(
                "no handler to deliver to: pass --to (or `to` in --config), e.g. --to \
                 http://127.0.0.1:3000"
                    .into(),
            )
        })?;
        // The flag, else the file, else the default.
        macro_rules! pick {
            ($field:ident, $default:expr) => {
                flags
                    .$field
                    .clone()
                    .or_else(|| file_settings.$field.clone())
                    .unwrap_or_else(|| $default)
            };
        }
        let scope_name = pick!(scope, from.default_scope());
        let scope = Scope::new(scope_name.clone())
            .map_err(|e| CliError::Usage(format!("invalid scope {scope_name:?} (--scope): {e}")))?;
        let key_fields = flags
            .key_fields
            .clone()
            .or_else(|| file_settings.key_fields.clone());
        let key_ignore = flags
            .key_ignore
            .clone()
            .or_else(|| file_settings.key_ignore.clone());
        for pointer in key_fields.iter().chain(&key_ignore).flatten() {
            parse_pointer(pointer).map_err(CliError::Usage)?;
        }
        let selection = match (key_fields, key_ignore) {
            (Some(_), Some(_)) => {
                return Err(CliError::Usage(
                    "give --key-fields (the fields hashed) or --key-ignore (the fields left \
                     out), not both"
                        .into(),
                ))
            }
            (Some(only), None) => JsonSelection::Only(only),
            (None, Some(except)) => JsonSelection::Except(except),
            (None, None) => JsonSelection::All,
        };
        let key_header = pick!(key_header, IDEMPOTENCY_KEY_HEADER.to_owned());
        let keys = match pick!(key, KeyFrom::Header) {
            KeyFrom::Header => KeySource::Header(key_header),
            KeyFrom::Payload => KeySource::PayloadHash(selection.clone()),
            KeyFrom::HeaderOrPayload => {
                KeySource::HeaderOrPayloadHash(key_header, selection.clone())
            }
        };
        let fingerprints = match pick!(fingerprint, FingerprintFrom::Payload) {
            FingerprintFrom::Payload => FingerprintSource::Payload,
            FingerprintFrom::Json => FingerprintSource::Json(selection),
        };
        let retry_delay = pick!(retry_delay, Duration::from_secs(1));
        let on_terminal = match pick!(on_terminal, OnTerminalSpec::DeadLetter) {
            OnTerminalSpec::DeadLetter => OnTerminal::DeadLetter,
            OnTerminalSpec::StoreAndAck => OnTerminal::StoreAndAck,
            OnTerminalSpec::StoreAndDeadLetter => OnTerminal::StoreAndDeadLetter,
        };
        let policy = Policy::default()
            .with_max_attempts(pick!(max_attempts, 5).max(1))
            .with_retry_delay(retry_delay)
            .with_max_retry_delay(pick!(max_retry_delay, Duration::from_secs(60)).max(retry_delay))
            .with_on_terminal(on_terminal);
        Ok(Self {
            from,
            to,
            scope,
            lease: pick!(lease, Duration::from_secs(30)),
            retention: pick!(retention, Duration::from_secs(86_400)),
            keys,
            fingerprints,
            method: pick!(method, Method::POST),
            path: pick!(path, "/".to_owned()),
            content_type: pick!(content_type, "application/json".to_owned()),
            message_headers: pick!(message_headers, Vec::new()),
            terminal: pick!(
                terminal_status,
                [400, 404, 409, 410, 422]
                    .into_iter()
                    .filter_map(|code| StatusCode::from_u16(code).ok())
                    .collect()
            ),
            timeout: pick!(timeout, Duration::from_secs(30)),
            max_body: pick!(max_body, 65_536),
            concurrency: pick!(concurrency, 4).max(1),
            policy,
            redelivery: pick!(redelivery, Duration::from_secs(30)),
        })
    }

    /// What `--check-config` prints.
    fn describe(&self) -> String {
        let statuses: Vec<&str> = self.terminal.iter().map(StatusCode::as_str).collect();
        format!(
            "from {}\nto {} {}{}\nscope {}, keys {:?}, fingerprints {:?}\nlease {:?}, \
             retention {:?}, timeout {:?}, redelivery {:?}, concurrency {}\nterminal \
             statuses {}, {:?}\n",
            self.from,
            self.method,
            self.to.trim_end_matches('/'),
            self.path,
            self.scope,
            self.keys,
            self.fingerprints,
            self.lease,
            self.retention,
            self.timeout,
            self.redelivery,
            self.concurrency,
            statuses.join(","),
            self.policy,
        )
    }
}

/// Reads and checks a `--config` file; an error names the file, and the line and field the
/// TOML parser points at.
fn read_file(path: &std::path::Path) -> Result<SettingsArgs, CliError> {
    let shown = path.display();
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::Usage(format!("cannot read the config file {shown}: {e}")))?;
    toml::from_str(&text).map_err(|e| CliError::Usage(format!("{shown}: {e}")))
}

/// Runs `idem consume` until SIGTERM or Ctrl-C, then lets the handler calls in flight
/// finish and settles them.
pub async fn run(args: ConsumeArgs) -> Result<Done, CliError> {
    let settings = Settings::resolve(&args)?;
    let target = Arc::new(Target::new(&settings)?);
    if args.check_config {
        return Ok(Done::ok(format!("config OK\n{}", settings.describe())));
    }
    let opened = args.store.open().await?;
    let url = opened.url();
    let config = idem_core::Config::default()
        .with_lease(settings.lease)
        .with_retention(settings.retention);
    let store = opened.store();
    let idem = Idem::from_arc(store.clone()).with_config(config);
    let consumer = Consumer::new(idem, settings.scope.clone())
        .with_keys(settings.keys.clone())
        .with_fingerprints(settings.fingerprints.clone())
        .with_policy(settings.policy.clone());
    let from = &settings.from;
    let handler = move |message: Message, ctx: Context| {
        let target = target.clone();
        async move { target.deliver(message, ctx).await }
    };
    let concurrency = settings.concurrency;
    let started = |what: &str| {
        tracing::info!(from = %from, to = %settings.to, store = %url, concurrency, "idem consume starting");
        // Written with errors ignored: whoever started us may have closed our stdout.
        let mut out = std::io::stdout();
        let _ = writeln!(
            out,
            "idem consume: consuming {what}, delivering to {} (store: {url})",
            settings.to
        );
        let _ = out.flush();
    };
    // The signal is turned into a flag, so that the drain's time limit can start from it.
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let signal = crate::signal::shutdown_signal("idem consume");
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
    let exporter = crate::telemetry::install_exporter()?;
    let admin = |probe: Probe| -> Result<(), CliError> {
        let Some(addr) = args.admin_listen else {
            return Ok(());
        };
        let listener = std::net::TcpListener::bind(addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .and_then(tokio::net::TcpListener::from_std)
            .map_err(|e| crate::error::listen_error(addr, &e))?;
        let state = Admin {
            store: store.clone(),
            probe: Arc::new(probe),
            exporter: exporter.clone(),
        };
        tokio::spawn(serve_admin(listener, state));
        Ok(())
    };
    let limit = args.shutdown_timeout;
    let summary = match from {
        BrokerUrl::Rabbit { url, queue } => {
            use idem_consumer::rabbitmq::{Topology, Worker};
            let broker = |e: lapin::Error| unreachable("RabbitMQ", url, &e);
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
                .map_err(|e| unreachable("NATS", url, &e))?;
            let js = async_nats::jetstream::new(client.clone());
            let mut topology =
                Topology::new(stream.clone(), subject.clone()).with_ack_wait(settings.redelivery);
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
                .map_err(|e| unreachable("Redis", url, &e))?;
            let mut topology = Topology::new(stream.clone()).with_claim_idle(settings.redelivery);
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

/// A broker that cannot be reached at start (exit 3), named without its password.
fn unreachable(broker: &str, url: &str, e: &dyn fmt::Display) -> CliError {
    CliError::Open(format!(
        "cannot reach {broker} at {}: {e} (is it running there? check --from)",
        redact(url)
    ))
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
