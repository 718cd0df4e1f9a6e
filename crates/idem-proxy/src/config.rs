//! The proxy's settings, written once: each is one field of [`UpstreamSpec`] or
//! [`RouteSpec`], which the routes file (`idem proxy --config FILE`, TOML) deserialises into
//! and the `idem proxy` flags fill (the structs are `clap::Args` too). Each kind of value
//! (seconds, milliseconds, methods, header names, paths, JSON pointers, statuses) has one
//! parser, its type's `FromStr`, which the flags use as it is and the file through
//! `TryFrom<String>`. An error in the file names the file, the line, the field and what is
//! expected. The guide's chapter docs/proxy.md shows a file with every field.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};
use idem_core::{AfterRetention, JsonSelection};
use idem_http::{Anonymous, JsonRpc, MissingKey, OnDisconnect};
use serde::de::{self, Deserializer};
use serde::Deserialize;

use crate::forward::{HostHeader, UpstreamConfig};
use crate::route::Route;
use crate::ProxyError;

/// The routes file: `[upstream]`, `[defaults]` and the `[[route]]` tables.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyFile {
    /// `[upstream]`: where requests go.
    #[serde(default)]
    upstream: UpstreamSpec,
    /// `[defaults]`: settings for every route, under the route's own.
    #[serde(default)]
    defaults: RouteSpec,
    /// `[[route]]`: the guarded routes, first match wins. None: one route, `/`.
    #[serde(default, rename = "route")]
    routes: Vec<RouteSpec>,
}

/// Where requests go: `[upstream]` in the file, and the flags `--upstream`,
/// `--upstream-timeout`, `--upstream-ca-file` and `--host`. Every field is optional; the
/// flags win over the file. Each field's doc is its flag's help.
#[derive(Debug, Clone, Default, clap::Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamSpec {
    /// The service requests go to: `http://HOST:PORT[/PREFIX]` or `https://...`.
    #[arg(long = "upstream", value_name = "URL")]
    url: Option<String>,
    /// How long the upstream has to answer with a response head [default: 30].
    #[arg(long = "upstream-timeout", value_name = "SECS")]
    timeout_secs: Option<Secs>,
    /// A PEM file of certificate authorities trusted for an `https://` upstream, besides
    /// the system's.
    #[arg(long = "upstream-ca-file", value_name = "FILE")]
    ca_file: Option<PathBuf>,
    /// The `Host` the upstream receives: the client's (`keep`) or the upstream URL's
    /// [default: keep].
    #[arg(long, value_enum)]
    host: Option<HostSpec>,
}

// The variants of the enums below carry `//` comments, not docs: clap would list docs under
// each flag's `--help`, and the flag's own help already says what each value does.

/// `host = "keep" | "upstream"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
enum HostSpec {
    // The client's `Host`.
    Keep,
    // The upstream's host and port.
    Upstream,
}

/// A route's settings: a `[[route]]` table, `[defaults]`, or the flags. An absent field
/// takes the value of the flags, then of `[defaults]`, then the built-in default its doc
/// names. A field's doc is its flag's help; a field without a flag (`#[arg(skip)]`) is
/// documented for the file.
#[derive(Debug, Clone, Default, clap::Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteSpec {
    /// The guarded methods, comma-separated [default: POST,PATCH].
    #[arg(long, value_delimiter = ',')]
    methods: Option<Vec<MethodName>>,
    /// The guarded path prefix [default: /].
    #[arg(long, value_name = "PREFIX")]
    path: Option<PathPrefix>,
    /// `jsonrpc_methods`: makes the route a JSON-RPC route guarding the calls of these
    /// methods (such as `["tools/call"]`); every other message passes through untouched,
    /// and `methods` defaults to `["POST"]` (default: not a JSON-RPC route).
    #[arg(skip)]
    jsonrpc_methods: Option<Vec<String>>,
    /// `key_pointer`: where a JSON-RPC call's key is, a JSON pointer into the request
    /// object; `key_header` is read when it finds no string, and `""` reads the header
    /// only (default `/params/_meta/idempotencyKey`).
    #[arg(skip)]
    key_pointer: Option<JsonPointer>,
    /// `ignore_meta`: `params._meta` entries left out of a JSON-RPC call's fingerprint
    /// (default `["progressToken"]`).
    #[arg(skip)]
    ignore_meta: Option<Vec<String>>,
    /// `store_errors`: store and replay JSON-RPC errors and tool results with
    /// `isError: true` (default `false`: the key is released, and a retry runs again).
    #[arg(skip)]
    store_errors: Option<bool>,
    /// The header carrying the key [default: Idempotency-Key].
    #[arg(long, value_name = "NAME")]
    key_header: Option<Header>,
    /// A guarded request without a key: refused with 400, or passed through [default:
    /// reject].
    #[arg(long, value_enum)]
    missing_key: Option<MissingKeySpec>,
    /// The request header whose value, hashed, scopes the keys [default: Authorization].
    #[arg(long, value_name = "NAME")]
    scope_header: Option<Header>,
    /// A request without the scope header: refused with 401, or keyed in one scope shared
    /// by every such caller [default: refuse].
    #[arg(long, value_enum)]
    anonymous: Option<AnonymousSpec>,
    /// `fingerprint_headers`: request headers that take part in the fingerprint (default
    /// none).
    #[arg(skip)]
    fingerprint_headers: Option<Vec<Header>>,
    /// `ignore_json`: JSON pointers left out of the fingerprint (default none).
    #[arg(skip)]
    ignore_json: Option<Vec<JsonPointer>>,
    /// How long a request holds its key while the upstream works; a crashed proxy's keys
    /// are taken over by a retry after it [default: 30].
    #[arg(long = "lease", value_name = "SECS")]
    lease_secs: Option<Secs>,
    /// How long a stored response is replayed [default: 86400].
    #[arg(long = "retention", value_name = "SECS")]
    retention_secs: Option<Secs>,
    /// Make a request for a key in flight wait up to MS milliseconds for the first one's
    /// response, instead of answering 409 at once.
    #[arg(long, value_name = "MS")]
    wait_ms: Option<Millis>,
    /// The longest a duplicate waits for the first response when it asks with
    /// `Prefer: wait=N` [default: 10000].
    #[arg(long, value_name = "MS")]
    max_wait_ms: Option<Millis>,
    /// A request on a key whose stored response was forgotten (its retention ended): run
    /// it again, or refuse it with 410 while the key's tombstone is kept [default: run].
    #[arg(long, value_enum)]
    after_retention: Option<AfterRetentionSpec>,
    /// How long a tombstone is kept after the stored response is forgotten, with
    /// --after-retention refuse [default: 604800].
    #[arg(long, value_name = "SECS")]
    tombstone_secs: Option<Secs>,
    /// `max_request_body` in bytes (default 1 MiB).
    #[arg(skip)]
    max_request_body: Option<usize>,
    /// `max_response_body` in bytes (default 1 MiB).
    #[arg(skip)]
    max_response_body: Option<usize>,
    /// `store_status`: statuses stored, as classes (`"2xx"`) or codes (`"303"`); default:
    /// 2xx and the final 4xx (not 401, 403, 408, 409, 423, 425, 429).
    #[arg(skip)]
    store_status: Option<Vec<StatusSpec>>,
    /// When the upstream's answer is lost after the request was sent (a timeout, a reset),
    /// release the key at once instead of leaving it in flight until its lease ends.
    // A switch on the command line: present is `true`, absent leaves the file's value.
    #[arg(long, num_args = 0, default_missing_value = "true")]
    release_unknown: Option<bool>,
    /// `on_disconnect`: `"continue"` (a streamed response is read to its end and stored
    /// when its client leaves, the default) or `"cancel"` (the upstream connection is
    /// closed, the key released, nothing stored).
    #[arg(skip)]
    on_disconnect: Option<OnDisconnectSpec>,
    /// `sse_ids`: number the events of a `text/event-stream` answer that carry no `id:`
    /// (default `false`).
    #[arg(skip)]
    sse_ids: Option<bool>,
}

/// `on_disconnect = "continue" | "cancel"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum OnDisconnectSpec {
    // Read on and store.
    Continue,
    // Drop the stream and release the key.
    Cancel,
}

/// `after_retention = "run" | "refuse"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
enum AfterRetentionSpec {
    // Run again.
    Run,
    // Refuse with 410 while the tombstone is kept.
    Refuse,
}

/// `missing_key = "reject" | "pass"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
enum MissingKeySpec {
    // 400.
    Reject,
    // Sent on unguarded.
    Pass,
}

/// `anonymous = "refuse" | "shared"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
enum AnonymousSpec {
    // 401.
    Refuse,
    // One shared scope.
    Shared,
}

/// Builds a newtype whose one parser, `$parse`, is its `FromStr` (what a flag's value goes
/// through) and its `TryFrom<String>` (what a string of the file goes through), with an
/// error that says what is expected.
macro_rules! parsed_string {
    ($(#[$doc:meta])* $name:ident($inner:ty), $parse:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Deserialize)]
        #[serde(try_from = "String")]
        struct $name($inner);

        impl FromStr for $name {
            type Err = String;

            fn from_str(text: &str) -> Result<Self, String> {
                let parse: fn(&str) -> Result<$inner, String> = $parse;
                parse(text).map($name)
            }
        }

        impl TryFrom<String> for $name {
            type Error = String;

            fn try_from(text: String) -> Result<Self, String> {
                text.parse()
            }
        }
    };
}

parsed_string!(
    /// An HTTP method in capitals: methods are case-sensitive (RFC 9110 section 9.1), so
    /// `post` is not taken for `POST`.
    MethodName(Method),
    |text| {
        let text = text.trim();
        if !text.is_empty() && text.bytes().all(|b| b.is_ascii_uppercase()) {
            Method::from_bytes(text.as_bytes()).map_err(|e| e.to_string())
        } else {
            Err(format!("expected an HTTP method in capitals such as \"POST\", not {text:?}"))
        }
    }
);

parsed_string!(
    /// A header name.
    Header(HeaderName),
    |text| HeaderName::from_bytes(text.trim().as_bytes())
        .map_err(|_| format!("expected a header name such as \"X-Api-Key\", not {text:?}"))
);

parsed_string!(
    /// A path prefix, starting with `/`.
    PathPrefix(String),
    |text| if text.starts_with('/') && !text.contains(['?', '#']) {
        Ok(text.to_owned())
    } else {
        Err(format!("expected a path starting with / (no query), such as \"/payments\", not {text:?}"))
    }
);

parsed_string!(
    /// A JSON pointer (RFC 6901): empty, or starting with `/`.
    JsonPointer(String),
    |text| if text.is_empty() || text.starts_with('/') {
        Ok(text.to_owned())
    } else {
        Err(format!("expected a JSON pointer such as \"/sent_at\", not {text:?}"))
    }
);

parsed_string!(
    /// A status class (`"2xx"`) or code (`"303"`).
    StatusSpec(StatusRange),
    |text| {
        let expected = || format!("expected a status class such as \"2xx\" or a code such as \"303\", not {text:?}");
        match text.as_bytes() {
            [class @ b'1'..=b'5', b'x' | b'X', b'x' | b'X'] => Ok(StatusRange::Class(class - b'0')),
            _ => text
                .parse::<u16>()
                .ok()
                .and_then(|code| StatusCode::from_u16(code).ok())
                .filter(|code| (100..600).contains(&code.as_u16()))
                .map(StatusRange::Code)
                .ok_or_else(expected),
        }
    }
);

/// Statuses named in `store_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StatusRange {
    /// Every status of a class: 2 for 2xx.
    Class(u8),
    /// One status.
    Code(StatusCode),
}

impl StatusRange {
    fn contains(self, status: StatusCode) -> bool {
        match self {
            Self::Class(class) => status.as_u16() / 100 == u16::from(class),
            Self::Code(code) => code == status,
        }
    }
}

/// A number of seconds above zero, fractions allowed: the one reading of every `SECS` flag
/// of `idem` (as text, [`FromStr`]) and every `_secs` field of its files (a TOML number).
///
/// ```
/// use idem_proxy::Secs;
/// let half: Secs = "0.5".parse().unwrap();
/// assert_eq!(half.0, std::time::Duration::from_millis(500));
/// assert!("0".parse::<Secs>().unwrap_err().contains("above zero"));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Secs(pub Duration);

impl Secs {
    /// What every reading of seconds says when it fails.
    const EXPECTED: &'static str = "expected a number of seconds above zero, such as 30 or 0.5";

    /// The one check of seconds, whether they came as text or as a number.
    fn new(secs: f64) -> Option<Self> {
        Duration::try_from_secs_f64(secs)
            .ok()
            .filter(|d| !d.is_zero())
            .map(Secs)
    }
}

impl FromStr for Secs {
    type Err = String;

    /// # Errors
    ///
    /// What is expected and the text given, when it is not a number of seconds above zero.
    fn from_str(text: &str) -> Result<Self, String> {
        text.trim()
            .parse()
            .ok()
            .and_then(Secs::new)
            .ok_or_else(|| format!("{}, not {text:?}", Self::EXPECTED))
    }
}

impl<'de> Deserialize<'de> for Secs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Number {
            Int(u64),
            Float(f64),
        }
        let secs = match Number::deserialize(d).map_err(|_| de::Error::custom(Self::EXPECTED))? {
            Number::Int(n) => n as f64,
            Number::Float(f) => f,
        };
        Secs::new(secs).ok_or_else(|| de::Error::custom(Self::EXPECTED))
    }
}

/// A whole number of milliseconds (`wait_ms`, `max_wait_ms`).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(from = "u64")]
struct Millis(Duration);

impl From<u64> for Millis {
    fn from(ms: u64) -> Self {
        Millis(Duration::from_millis(ms))
    }
}

impl FromStr for Millis {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        text.trim().parse::<u64>().map(Millis::from).map_err(|_| {
            format!("expected a whole number of milliseconds, such as 5000, not {text:?}")
        })
    }
}

impl ProxyFile {
    /// Reads and checks `path`.
    ///
    /// # Errors
    ///
    /// [`ProxyError::Config`] naming the file, the line, the field and what is expected.
    pub fn read(path: &Path) -> Result<Self, ProxyError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ProxyError::Config(format!(
                "cannot read the config file {}: {e}",
                path.display()
            ))
        })?;
        Self::parse(&path.display().to_string(), &text)
    }

    /// Checks the text of a file named `name`.
    ///
    /// # Errors
    ///
    /// As [`ProxyFile::read`].
    pub(crate) fn parse(name: &str, text: &str) -> Result<Self, ProxyError> {
        toml::from_str(text).map_err(|e: toml::de::Error| {
            let message = e.message().trim_end();
            let Some(span) = e.span() else {
                return ProxyError::Config(format!("{name}: {message}"));
            };
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let line_start = before.rfind('\n').map_or(0, |i| i + 1);
            let column = before[line_start..].chars().count() + 1;
            let line_text = text[line_start..].lines().next().unwrap_or("");
            // `[route]` for `[[route]]`: serde's "invalid type: map, expected a sequence"
            // names neither the table nor the fix.
            let table = line_text
                .trim()
                .strip_prefix('[')
                .and_then(|t| t.strip_suffix(']'))
                .filter(|t| !t.starts_with('['));
            if let Some(table) = table.filter(|_| message.contains("expected a sequence")) {
                return ProxyError::Config(format!(
                    "{name}, line {line}: `[{table}]` is one table, and `{table}` is an array \
                     of tables: write `[[{table}]]` above each one"
                ));
            }
            // The field: the key this line assigns, when the error is in its value.
            let field = line_text
                .split_once('=')
                .map(|(key, _)| key.trim())
                .filter(|key| !key.is_empty() && span.start > line_start + key.len());
            match field {
                Some(field) => ProxyError::Config(format!(
                    "{name}, line {line}, column {column}, field `{field}`: {message}"
                )),
                None => {
                    ProxyError::Config(format!("{name}, line {line}, column {column}: {message}"))
                }
            }
        })
    }
}

/// Everything a proxy runs with: the upstream and its routes.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Settings {
    /// Where requests go.
    pub upstream: UpstreamConfig,
    /// The guarded routes, first match wins.
    pub routes: Vec<Route>,
}

impl Settings {
    /// The settings of `file` with `flags` over its `[defaults]` (and its `[upstream]`),
    /// under each route's own fields. `flags.path` and `flags.methods` name the single
    /// route used when the file has none.
    ///
    /// # Errors
    ///
    /// [`ProxyError::Config`] when no upstream URL is given, or it is not one.
    pub fn resolve(
        file: &ProxyFile,
        flags: &RouteSpec,
        upstream: &UpstreamSpec,
    ) -> Result<Self, ProxyError> {
        let url = upstream
            .url
            .as_ref()
            .or(file.upstream.url.as_ref())
            .ok_or_else(|| {
                ProxyError::Config(
                    "no upstream: give --upstream URL (or `url` under [upstream] in --config)"
                        .into(),
                )
            })?;
        let mut up = UpstreamConfig::new(url)?;
        if let Some(Secs(t)) = upstream.timeout_secs.or(file.upstream.timeout_secs) {
            up.timeout = t;
        }
        up.ca_file = upstream
            .ca_file
            .clone()
            .or_else(|| file.upstream.ca_file.clone());
        if let Some(host) = upstream.host.or(file.upstream.host) {
            up.host = match host {
                HostSpec::Keep => HostHeader::Keep,
                HostSpec::Upstream => HostHeader::Upstream,
            };
        }
        let base = flags.over(&file.defaults);
        for route in file.routes.iter().map(|r| r.over(&base)) {
            route.check_jsonrpc()?;
            route.check_tombstone()?;
        }
        if file.routes.is_empty() {
            base.check_tombstone()?;
        }
        let routes = if file.routes.is_empty() {
            vec![base.to_route()]
        } else {
            file.routes
                .iter()
                .map(|r| r.over(&base).to_route())
                .collect()
        };
        Ok(Self {
            upstream: up,
            routes,
        })
    }
}

impl RouteSpec {
    /// These settings, with `under`'s where these have none.
    fn over(&self, under: &RouteSpec) -> RouteSpec {
        macro_rules! pick {
            ($($field:ident),*) => { RouteSpec { $($field: self.$field.clone().or_else(|| under.$field.clone())),* } };
        }
        pick!(
            path,
            jsonrpc_methods,
            key_pointer,
            ignore_meta,
            store_errors,
            methods,
            key_header,
            missing_key,
            scope_header,
            anonymous,
            fingerprint_headers,
            ignore_json,
            lease_secs,
            retention_secs,
            wait_ms,
            max_wait_ms,
            after_retention,
            tombstone_secs,
            max_request_body,
            max_response_body,
            store_status,
            release_unknown,
            on_disconnect,
            sse_ids
        )
    }

    /// Refuses JSON-RPC settings on a route that is not a JSON-RPC route, and a JSON-RPC
    /// route that guards no method: either is a file that does not say what its writer
    /// meant.
    fn check_jsonrpc(&self) -> Result<(), ProxyError> {
        let path = self.path.as_ref().map_or("/", |p| p.0.as_str());
        match &self.jsonrpc_methods {
            Some(methods) if methods.is_empty() || methods.iter().any(String::is_empty) => {
                Err(ProxyError::Config(format!(
                    "route {path}: `jsonrpc_methods` names the guarded JSON-RPC methods, such \
                     as [\"tools/call\"]; it may not be empty or hold an empty name"
                )))
            }
            Some(_) => Ok(()),
            None => {
                let set = [
                    ("key_pointer", self.key_pointer.is_some()),
                    ("ignore_meta", self.ignore_meta.is_some()),
                    ("store_errors", self.store_errors.is_some()),
                ];
                match set.iter().find(|(_, set)| *set) {
                    Some((field, _)) => Err(ProxyError::Config(format!(
                        "route {path}: `{field}` applies to JSON-RPC routes only: add \
                         `jsonrpc_methods = [\"tools/call\"]` (the methods to guard) to the route"
                    ))),
                    None => Ok(()),
                }
            }
        }
    }

    /// Refuses `tombstone_secs` on a route that keeps no tombstones.
    fn check_tombstone(&self) -> Result<(), ProxyError> {
        // Only when nothing says what happens after the retention: a route may set "run"
        // under defaults that keep tombstones for the others.
        if self.tombstone_secs.is_some() && self.after_retention.is_none() {
            let path = self.path.as_ref().map_or("/", |p| p.0.as_str());
            return Err(ProxyError::Config(format!(
                "route {path}: `tombstone_secs` applies only where keys are refused after their \
                 retention: add `after_retention = \"refuse\"` (or --after-retention refuse), \
                 or remove `tombstone_secs`"
            )));
        }
        Ok(())
    }

    /// The route these settings describe; an absent field takes its built-in default.
    fn to_route(&self) -> Route {
        let mut route = Route::default();
        if let Some(PathPrefix(path)) = &self.path {
            route.path.clone_from(path);
        }
        let mut http = route.http;
        if let Some(methods) = &self.methods {
            http = http.with_methods(methods.iter().map(|m| m.0.clone()));
        }
        if let Some(methods) = &self.jsonrpc_methods {
            // Every JSON-RPC message is a POST; the others (an MCP session's GET stream,
            // its DELETE) go to the upstream untouched.
            if self.methods.is_none() {
                http = http.with_methods([Method::POST]);
            }
            let mut rpc = JsonRpc::new(methods.iter().cloned());
            match &self.key_pointer {
                Some(JsonPointer(pointer)) if pointer.is_empty() => {
                    rpc = rpc.without_key_pointer();
                }
                Some(JsonPointer(pointer)) => rpc = rpc.with_key_pointer(pointer.clone()),
                None => {}
            }
            if let Some(entries) = &self.ignore_meta {
                rpc = rpc.with_ignore_meta(entries.iter().cloned());
            }
            if let Some(store) = self.store_errors {
                rpc = rpc.with_store_errors(store);
            }
            http = http.with_jsonrpc(rpc);
        }
        if let Some(Header(name)) = &self.key_header {
            http = http.with_header(name.clone());
        }
        if let Some(missing) = self.missing_key {
            http = http.with_missing_key(match missing {
                MissingKeySpec::Reject => MissingKey::Reject,
                MissingKeySpec::Pass => MissingKey::PassThrough,
            });
        }
        if let Some(Header(name)) = &self.scope_header {
            route.scope_header = name.clone();
        }
        if let Some(anonymous) = self.anonymous {
            http = http.with_anonymous(match anonymous {
                AnonymousSpec::Refuse => Anonymous::Refuse,
                AnonymousSpec::Shared => Anonymous::Shared,
            });
        }
        // The 401's challenge names the scope header's scheme when it is `Authorization`.
        if route.scope_header != http::header::AUTHORIZATION {
            if let Ok(value) =
                http::HeaderValue::from_str(&format!("ApiKey header=\"{}\"", route.scope_header))
            {
                http = http.with_challenge(value);
            }
        }
        if let Some(headers) = &self.fingerprint_headers {
            http = http.with_fingerprint_headers(headers.iter().map(|h| h.0.clone()));
        }
        if let Some(pointers) = &self.ignore_json {
            http = http.with_json_selection(JsonSelection::Except(
                pointers.iter().map(|p| p.0.clone()).collect(),
            ));
        }
        if let Some(limit) = self.max_request_body {
            http = http.with_max_request_body(limit);
        }
        if let Some(limit) = self.max_response_body {
            http = http.with_max_response_body(limit);
        }
        if let Some(on_disconnect) = self.on_disconnect {
            http = http.with_on_disconnect(match on_disconnect {
                OnDisconnectSpec::Continue => OnDisconnect::Continue,
                OnDisconnectSpec::Cancel => OnDisconnect::Cancel,
            });
        }
        if let Some(on) = self.sse_ids {
            http = http.with_sse_ids(on);
        }
        if let Some(statuses) = &self.store_status {
            let ranges: Vec<StatusRange> = statuses.iter().map(|s| s.0).collect();
            http = http.with_store_status(move |status| ranges.iter().any(|r| r.contains(status)));
        }
        route.http = http;
        if let Some(Secs(lease)) = self.lease_secs {
            route.engine = route.engine.with_lease(lease);
        }
        if let Some(Secs(retention)) = self.retention_secs {
            route.engine = route.engine.with_retention(retention);
        }
        if let Some(Millis(wait)) = self.wait_ms {
            route.engine.wait = Some(wait);
        }
        if let Some(Millis(max_wait)) = self.max_wait_ms {
            route.http = route.http.with_max_wait(max_wait);
        }
        if self.after_retention == Some(AfterRetentionSpec::Refuse) {
            route.engine.after_retention = AfterRetention::Refuse;
        }
        if let Some(Secs(tombstone)) = self.tombstone_secs {
            route.engine.tombstone = tombstone;
        }
        if let Some(release) = self.release_unknown {
            route.release_unknown = release;
        }
        route
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
[upstream]
url = "http://127.0.0.1:3000"
timeout_secs = 2.5
host = "upstream"

[defaults]
lease_secs = 10

[[route]]
path = "/payments"
methods = ["POST"]
scope_header = "X-Api-Key"
fingerprint_headers = ["X-Currency"]
ignore_json = ["/sent_at"]
store_status = ["2xx", "404"]

[[route]]
path = "/orders"
lease_secs = 60
missing_key = "pass"
anonymous = "shared"
on_disconnect = "cancel"
sse_ids = true
"#;

    /// An `[upstream]` for the files that test routes.
    const UPSTREAM: &str = "[upstream]\nurl = \"http://127.0.0.1:3000\"\n";

    /// The settings of `text`, with no flags.
    fn resolved(text: &str) -> Settings {
        let file = ProxyFile::parse("proxy.toml", text).unwrap();
        Settings::resolve(&file, &RouteSpec::default(), &UpstreamSpec::default()).unwrap()
    }

    #[test]
    fn the_example_file_resolves_to_its_routes() {
        let settings = resolved(EXAMPLE);
        assert_eq!(settings.upstream.timeout, Duration::from_millis(2500));
        assert_eq!(settings.upstream.host, HostHeader::Upstream);
        let [payments, orders] = &settings.routes[..] else {
            panic!("two routes expected: {:?}", settings.routes);
        };
        assert_eq!(payments.path, "/payments");
        assert_eq!(payments.http.methods, [Method::POST]);
        assert_eq!(payments.scope_header, "x-api-key");
        assert_eq!(payments.engine.lease, Duration::from_secs(10));
        assert!((payments.http.store_status)(StatusCode::NOT_FOUND));
        assert!(!(payments.http.store_status)(StatusCode::BAD_REQUEST));
        assert_eq!(orders.engine.lease, Duration::from_secs(60));
        assert_eq!(orders.http.missing_key, MissingKey::PassThrough);
        assert_eq!(orders.http.anonymous, Anonymous::Shared);
        assert_eq!(orders.http.methods, [Method::POST, Method::PATCH]);
        assert_eq!(payments.http.on_disconnect, OnDisconnect::Continue);
        assert_eq!(orders.http.on_disconnect, OnDisconnect::Cancel);
        assert!(!payments.http.sse_ids);
        assert!(orders.http.sse_ids);
    }

    #[test]
    fn flags_override_the_files_defaults_and_routes_override_flags() {
        let file = ProxyFile::parse("proxy.toml", EXAMPLE).unwrap();
        let flags = RouteSpec {
            lease_secs: Some(Secs(Duration::from_secs(5))),
            ..RouteSpec::default()
        };
        let upstream = UpstreamSpec {
            url: Some("http://127.0.0.1:4000".into()),
            ..UpstreamSpec::default()
        };
        let settings = Settings::resolve(&file, &flags, &upstream).unwrap();
        assert_eq!(settings.upstream.url, "http://127.0.0.1:4000/");
        assert_eq!(settings.routes[0].engine.lease, Duration::from_secs(5));
        assert_eq!(settings.routes[1].engine.lease, Duration::from_secs(60));
    }

    /// `idem proxy`'s settings flags, as idem-cli flattens them.
    #[derive(Debug, clap::Parser)]
    struct Flags {
        #[command(flatten)]
        upstream: UpstreamSpec,
        #[command(flatten)]
        route: RouteSpec,
    }

    #[test]
    fn flags_read_each_value_with_the_files_parser() {
        use clap::Parser as _;
        let flags = Flags::try_parse_from([
            "proxy",
            "--upstream",
            "http://127.0.0.1:3000",
            "--upstream-timeout",
            "2.5",
            "--host",
            "upstream",
            "--methods",
            "POST,PUT",
            "--path",
            "/payments",
            "--scope-header",
            "X-Api-Key",
            "--missing-key",
            "pass",
            "--lease",
            "0.5",
            "--wait-ms",
            "250",
            "--after-retention",
            "refuse",
            "--tombstone-secs",
            "3600",
            "--release-unknown",
        ])
        .unwrap();
        let settings =
            Settings::resolve(&ProxyFile::default(), &flags.route, &flags.upstream).unwrap();
        assert_eq!(settings.upstream.timeout, Duration::from_millis(2500));
        assert_eq!(settings.upstream.host, HostHeader::Upstream);
        let [route] = &settings.routes[..] else {
            panic!("one route expected: {:?}", settings.routes);
        };
        assert_eq!(route.path, "/payments");
        assert_eq!(route.http.methods, [Method::POST, Method::PUT]);
        assert_eq!(route.scope_header, "x-api-key");
        assert_eq!(route.http.missing_key, MissingKey::PassThrough);
        assert_eq!(route.engine.lease, Duration::from_millis(500));
        assert_eq!(route.engine.wait, Some(Duration::from_millis(250)));
        assert_eq!(route.engine.after_retention, AfterRetention::Refuse);
        assert_eq!(route.engine.tombstone, Duration::from_secs(3600));
        assert!(route.release_unknown);

        // A switch left off leaves the file's value.
        let file = ProxyFile::parse("proxy.toml", "[defaults]\nrelease_unknown = true\n").unwrap();
        let flags =
            Flags::try_parse_from(["proxy", "--upstream", "http://127.0.0.1:3000"]).unwrap();
        let settings = Settings::resolve(&file, &flags.route, &flags.upstream).unwrap();
        assert!(settings.routes[0].release_unknown);

        // A bad value says what the file would say.
        for (flag, value, expected) in [
            (
                "--methods",
                "post",
                "expected an HTTP method in capitals such as \"POST\", not \"post\"",
            ),
            (
                "--lease",
                "0",
                "expected a number of seconds above zero, such as 30 or 0.5, not \"0\"",
            ),
            ("--path", "payments", "expected a path starting with /"),
            (
                "--scope-header",
                "X Api",
                "expected a header name such as \"X-Api-Key\"",
            ),
            (
                "--wait-ms",
                "soon",
                "expected a whole number of milliseconds",
            ),
            ("--missing-key", "maybe", "reject"),
        ] {
            let e = Flags::try_parse_from(["proxy", flag, value])
                .unwrap_err()
                .to_string();
            assert!(e.contains(expected), "{flag} {value}: {e}");
        }
    }

    #[test]
    fn a_bad_file_names_the_line_the_field_and_what_is_expected() {
        // The bad field is on each file's last line.
        let cases = [
            (
                "[[route]]\npath = \"/p\"\nmethods = [\"post\"]\n",
                "capitals",
            ),
            ("[[route]]\npaht = \"/p\"\n", "unknown field"),
            ("[upstream]\ntimeout_secs = 0\n", "above zero"),
            ("[[route]]\npath = \"payments\"\n", "starting with /"),
            ("[[route]]\nstore_status = [\"6xx\"]\n", "2xx"),
            ("[[route]]\nscope_header = \"X Api\"\n", "header name"),
            ("[[route]]\nmissing_key = \"maybe\"\n", "reject"),
            ("[[route]]\non_disconnect = \"stop\"\n", "continue"),
            ("[route]\n", "write `[[route]]` above each one"),
        ];
        for (text, expected) in cases {
            let e = ProxyFile::parse("proxy.toml", text)
                .unwrap_err()
                .to_string();
            let line = format!("line {}", text.lines().count());
            let field = text.lines().last().unwrap().split(' ').next().unwrap();
            assert!(e.starts_with("proxy.toml, "), "{e}");
            assert!(e.contains(&line), "{text}: {e}");
            assert!(e.contains(field), "{text}: {e}");
            assert!(e.contains(expected), "{text}: {e}");
        }
    }

    #[test]
    fn no_upstream_is_an_error_naming_both_ways_to_give_one() {
        let e = Settings::resolve(
            &ProxyFile::default(),
            &RouteSpec::default(),
            &UpstreamSpec::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("--upstream") && e.contains("[upstream]"), "{e}");
    }

    #[test]
    fn a_key_lifetime_route_sets_its_engine_and_a_stray_tombstone_is_refused() {
        let text = &[
            UPSTREAM,
            r#"
[[route]]
path = "/payments"
max_wait_ms = 2500
after_retention = "refuse"
tombstone_secs = 3600

[[route]]
path = "/other"
"#,
        ]
        .concat();
        let settings = resolved(text);
        let [payments, other] = &settings.routes[..] else {
            panic!("two routes expected: {:?}", settings.routes);
        };
        assert_eq!(payments.http.max_wait, Duration::from_millis(2500));
        assert_eq!(payments.engine.after_retention, AfterRetention::Refuse);
        assert_eq!(payments.engine.tombstone, Duration::from_secs(3600));
        assert_eq!(other.engine.after_retention, AfterRetention::Run);
        assert_eq!(other.http.max_wait, Duration::from_secs(10));

        // One route may opt out under defaults that keep tombstones.
        let opted_out = text
            .replace("tombstone_secs = 3600\n", "")
            .replace(
                "[[route]]\npath = \"/payments\"",
                "[defaults]\ntombstone_secs = 3600\n\n[[route]]\npath = \"/payments\"",
            )
            .replace(
                "path = \"/other\"",
                "path = \"/other\"\nafter_retention = \"run\"",
            );
        let settings = resolved(&opted_out);
        assert_eq!(
            settings.routes[0].engine.tombstone,
            Duration::from_secs(3600)
        );
        assert_eq!(
            settings.routes[1].engine.after_retention,
            AfterRetention::Run
        );

        let stray = text.replace("after_retention = \"refuse\"\n", "");
        let file = ProxyFile::parse("proxy.toml", &stray).unwrap();
        let e = Settings::resolve(&file, &RouteSpec::default(), &UpstreamSpec::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tombstone_secs") && e.contains("after_retention"),
            "{e}"
        );
    }

    #[test]
    fn a_jsonrpc_route_guards_its_calls_and_posts_only() {
        let text = &[
            UPSTREAM,
            r#"
[[route]]
path = "/mcp"
jsonrpc_methods = ["tools/call"]
key_pointer = "/params/_meta/idempotencyKey"
ignore_meta = ["progressToken", "traceparent"]

[[route]]
path = "/a2a"
jsonrpc_methods = ["message/send"]
key_pointer = "/params/message/messageId"
store_errors = true

[[route]]
path = "/rpc"
jsonrpc_methods = ["pay"]
key_pointer = ""
"#,
        ]
        .concat();
        let settings = resolved(text);
        let [mcp, a2a, rpc] = &settings.routes[..] else {
            panic!("three routes expected: {:?}", settings.routes);
        };
        assert_eq!(mcp.http.methods, [Method::POST]);
        let mcp = mcp.http.jsonrpc.as_ref().unwrap();
        assert_eq!(mcp.methods, ["tools/call"]);
        assert_eq!(
            mcp.key_pointer.as_deref(),
            Some("/params/_meta/idempotencyKey")
        );
        assert_eq!(mcp.ignore_meta, ["progressToken", "traceparent"]);
        assert!(!mcp.store_errors);
        let a2a = a2a.http.jsonrpc.as_ref().unwrap();
        assert_eq!(
            a2a.key_pointer.as_deref(),
            Some("/params/message/messageId")
        );
        assert_eq!(a2a.ignore_meta, ["progressToken"]);
        assert!(a2a.store_errors);
        assert_eq!(rpc.http.jsonrpc.as_ref().unwrap().key_pointer, None);

        for (text, expected) in [
            (
                "[[route]]\npath = \"/mcp\"\nkey_pointer = \"/id\"\n",
                "`key_pointer` applies to JSON-RPC routes only",
            ),
            ("[[route]]\nstore_errors = true\n", "add `jsonrpc_methods"),
            ("[[route]]\njsonrpc_methods = []\n", "may not be empty"),
        ] {
            let file = ProxyFile::parse("proxy.toml", text).unwrap();
            let upstream = UpstreamSpec {
                url: Some("http://127.0.0.1:3000".into()),
                ..UpstreamSpec::default()
            };
            let e = Settings::resolve(&file, &RouteSpec::default(), &upstream)
                .unwrap_err()
                .to_string();
            assert!(e.contains(expected), "{text}: {e}");
        }
        let e = ProxyFile::parse("proxy.toml", "[[route]]\nkey_pointer = \"params\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("JSON pointer"), "{e}");
    }
}
