//! The status monitor: where a client learns what became of its key without sending the
//! request again. Under [`crate::Config::monitor_path`] (default `/.idem/keys`):
//!
//! - `GET {path}/by-key/{key}`: `key` percent-encoded, looked up in the caller's own
//!   scope; every guarded answer names it in `Link: <…>; rel="monitor"`;
//! - `GET {path}/{id}`: the same answers, by an opaque id that does not reveal the key or
//!   the scope: the `Location` of a `202` (`Prefer: respond-async`);
//! - `OPTIONS {path}`: the route's key lifetime (lease, retention, waits, tombstones) as
//!   JSON, without a request.
//!
//! The answers: in flight, `202` with `Retry-After`; completed, the stored response as a
//! replay; expired under a tombstone, `410` (`key-expired`); anything else (released,
//! never stored, abandoned by a worker that died, never used, or another principal's key),
//! `404` (`not-completed`): the key can be retried. The lookup is a store read, so it works
//! from any instance over the same store.
//!
//! The opaque id is the scope and key sealed with AES-SIV (RFC 5297: deterministic, so a
//! duplicate is named the same monitor, and authenticated, so an id cannot be forged or
//! altered) under a key every instance shares: drawn by the first `respond-async` request
//! and kept in the store itself (a record of its own, in a scope no caller's can be, for
//! ten years), so there is nothing to configure.

use std::time::Duration;

use aes_siv::siv::Aes128Siv;
use aes_siv::KeyInit;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use bytes::Bytes;
use http::header::{CONTENT_TYPE, LINK, LOCATION, RETRY_AFTER};
use http::request::Parts;
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode};
use idem_core::telemetry::time_limit;
use idem_core::{
    AfterRetention, Begin, BeginRequest, Completion, Error, FencingToken, Fingerprint, Key,
    RecordId, RecordState, Replay, Scope,
};
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

use crate::body::ResponseBody;
use crate::config::Anonymous;
use crate::error::Problem;
use crate::response::replay_response;
use crate::shared::Shared;

/// After the sealing key could not be read, answers go without a monitor for this long
/// rather than each wait for the store again.
const AFTER_FAILURE: Duration = Duration::from_secs(1);

/// The record holding the sealing key, in a reserved scope no caller's can be.
fn secret_id() -> RecordId {
    let scope = Scope::reserved("idem").expect("a short scope");
    RecordId::new(scope, Key::new("monitor-secret").expect("a valid key"))
}

/// How long the sealing key is kept: monitor ids stay valid as long as it is.
const SECRET_TTL: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// Associated data of every seal: a monitor id is good for nothing else.
const PURPOSE: &[u8] = b"idem monitor id v1";

/// The sealing key shared by every instance on the store: read, or drawn and stored by the
/// first instance to need it (a second drawing at the same moment waits for the first).
async fn secret(shared: &Shared) -> Result<[u8; 32], Error> {
    let get = || async {
        let store = shared.idem.store();
        let id = secret_id();
        let fingerprint = Fingerprint::of_bytes(PURPOSE);
        let limit = shared.idem.config().store_timeout;
        for _ in 0..100 {
            let req = BeginRequest {
                id: &id,
                fingerprint,
                token: FencingToken::random(),
                lease: Duration::from_secs(10),
                retention: SECRET_TTL,
            };
            let begun = time_limit(store.name(), limit, store.begin(req)).await?;
            match begun {
                Begin::Acquired(lease) | Begin::TookOver(lease) => {
                    let mut drawn = [0u8; 32];
                    drawn[..16].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
                    drawn[16..].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
                    let kept = idem_core::Response::new(0, Bytes::copy_from_slice(&drawn));
                    let completion = Completion::succeeded(kept);
                    let kept = store.complete(&lease, &completion, SECRET_TTL);
                    time_limit(store.name(), limit, kept).await?;
                    return Ok(drawn);
                }
                Begin::Replay(replay) => {
                    return <[u8; 32]>::try_from(&replay.completion.response.body[..]).map_err(
                        |_| Error::corrupt(store.name(), "the monitor key is not 32 bytes"),
                    );
                }
                // Another instance is drawing it.
                Begin::InFlight { .. } => tokio::time::sleep(Duration::from_millis(20)).await,
                Begin::Mismatch | Begin::Expired { .. } => {
                    return Err(Error::corrupt(store.name(), "the monitor key's record"));
                }
            }
        }
        Err(Error::unavailable(
            store.name(),
            "the monitor key was being written for 2 s",
        ))
    };
    let sealer = &shared.sealer;
    if let Some(key) = sealer.key.get() {
        return Ok(*key);
    }
    let last = *sealer
        .failed
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if last.is_some_and(|at| at.elapsed() < AFTER_FAILURE) {
        return Err(Error::unavailable(
            shared.idem.store().name(),
            "the monitor key could not be read a moment ago",
        ));
    }
    let read = sealer.key.get_or_try_init(get).await.copied();
    if read.is_err() {
        *sealer
            .failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(tokio::time::Instant::now());
    }
    read
}

/// The opaque monitor id of `id`; `None` (logged) when the sealing key cannot be read.
pub(crate) async fn opaque(shared: &Shared, id: &RecordId) -> Option<String> {
    let key = match secret(shared).await {
        Ok(key) => key,
        Err(e) => {
            tracing::debug!(error = %e, "no monitor id: the sealing key cannot be read");
            return None;
        }
    };
    let (scope, name) = (id.scope().as_str(), id.key().as_str());
    // Both fit in 255 bytes: the scope's length in one byte, then the scope, then the key.
    let mut plain = Vec::with_capacity(1 + scope.len() + name.len());
    plain.push(u8::try_from(scope.len()).ok()?);
    plain.extend_from_slice(scope.as_bytes());
    plain.extend_from_slice(name.as_bytes());
    let sealed = Aes128Siv::new(&key.into())
        .encrypt([PURPOSE], &plain)
        .ok()?;
    Some(URL_SAFE_NO_PAD.encode(sealed))
}

/// The record an opaque id names, if it is one this store's instances sealed.
fn unseal(key: &[u8; 32], opaque: &str) -> Option<RecordId> {
    let sealed = URL_SAFE_NO_PAD.decode(opaque).ok()?;
    let plain = Aes128Siv::new(&(*key).into())
        .decrypt([PURPOSE], &sealed)
        .ok()?;
    let (&len, rest) = plain.split_first()?;
    let (scope, name) = rest.split_at_checked(usize::from(len))?;
    let scope = Scope::new(String::from_utf8(scope.to_vec()).ok()?).ok()?;
    let key = Key::new(String::from_utf8(name.to_vec()).ok()?).ok()?;
    Some(RecordId::new(scope, key))
}

/// Adds `Link: <{monitor}>; rel="monitor"` to `headers`.
pub(crate) fn insert_link(headers: &mut HeaderMap, monitor: &str) {
    if let Ok(link) = HeaderValue::try_from(format!("<{monitor}>; rel=\"monitor\"")) {
        headers.append(LINK, link);
    }
}

/// The `202 Accepted` of work that runs on, or of a duplicate of it that asked for
/// `respond-async`: `Location` of the monitor (when it can be named) and `Retry-After`.
pub(crate) fn accepted(shared: &Shared, location: Option<&str>) -> Response<ResponseBody> {
    let body = r#"{"status":"in_progress"}"#;
    let mut response = Response::new(ResponseBody::full(Bytes::from_static(body.as_bytes())));
    *response.status_mut() = StatusCode::ACCEPTED;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let after = shared.config.in_flight_retry_after.as_secs().max(1);
    headers.insert(RETRY_AFTER, HeaderValue::from(after));
    if let Some(location) = location.and_then(|l| HeaderValue::try_from(l).ok()) {
        headers.insert(LOCATION, location);
    }
    response
}

/// Whether `path` is the monitor's or under it.
pub(crate) fn is_monitor(shared: &Shared, path: &str) -> bool {
    let base = base(shared);
    !base.is_empty()
        && path
            .strip_prefix(base)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// The monitor's path without a trailing `/` (empty: no monitor).
fn base(shared: &Shared) -> &str {
    shared.config.monitor_path.trim_end_matches('/')
}

/// Where the `202` of a `respond-async` request sends its client: the key's monitor by an
/// opaque id, or, when the sealing key cannot be read, by its key.
pub(crate) async fn location(shared: &Shared, id: &RecordId) -> String {
    match opaque(shared, id).await {
        Some(opaque) => format!("{}/{opaque}", base(shared)),
        None => by_key_path(&shared.config.monitor_path, id.key().as_str()),
    }
}

/// What the monitor knows of the key a request names: `None` when it knows nothing (no
/// record, or not this caller's), for the caller to answer 404 or ask another route.
pub(crate) async fn answer(shared: &Shared, parts: &Parts) -> Option<Response<ResponseBody>> {
    let config = &shared.config;
    let rest = parts.uri.path().strip_prefix(base(shared)).unwrap_or("");
    if rest.is_empty() || rest == "/" {
        return Some(if parts.method == Method::OPTIONS {
            describe(shared)
        } else {
            method_not_allowed("OPTIONS")
        });
    }
    if parts.method != Method::GET && parts.method != Method::HEAD {
        return Some(method_not_allowed("GET, HEAD"));
    }
    let scope = match shared.scope.as_ref().and_then(|scope| scope(parts)) {
        Some(scope) => scope,
        None if config.anonymous == Anonymous::Shared => Scope::global(),
        None => {
            let problem = Problem::principal_missing(config.challenge.clone());
            return Some(problem.into_response());
        }
    };
    let rest = &rest[1..];
    let id = match rest.strip_prefix("by-key/") {
        Some(encoded) => {
            let key = percent_encoding::percent_decode_str(encoded)
                .decode_utf8()
                .ok()?;
            RecordId::new(scope, Key::new(key.into_owned()).ok()?)
        }
        None => {
            let key = match secret(shared).await {
                Ok(key) => key,
                // Not knowing is not "not completed": the client asks again later.
                Err(e) => {
                    let problem = Problem::store_failed(&e, config.store_retry_after);
                    return Some(problem.into_response());
                }
            };
            let id = unseal(&key, rest)?;
            // Another principal's key: as if there were none.
            if *id.scope() != scope {
                return None;
            }
            id
        }
    };
    let record = match shared.idem.get(&id).await {
        Ok(record) => record,
        Err(e) => return Some(Problem::store_failed(&e, config.store_retry_after).into_response()),
    };
    let mut response = match record.map(|r| (r.state, r.expires_in)) {
        Some((RecordState::Completed(completion), expires_in)) => replay_response(
            config,
            Replay {
                completion,
                expires_in,
            },
        ),
        Some((
            RecordState::InProgress {
                lease_remaining, ..
            },
            _,
        )) if !lease_remaining.is_zero() => {
            let mut response = accepted(shared, None);
            response.headers_mut().remove(LOCATION);
            response
        }
        // Abandoned (its worker gone, its lease run out), released, or never there.
        _ => {
            if shared.idem.config().after_retention == AfterRetention::Refuse {
                match shared.idem.tombstone(&id).await {
                    Ok(Some(completed_at)) => {
                        return Some(Problem::key_expired(completed_at).into_response())
                    }
                    Ok(None) => {}
                    Err(e) => {
                        let problem = Problem::store_failed(&e, config.store_retry_after);
                        return Some(problem.into_response());
                    }
                }
            }
            return None;
        }
    };
    let monitor = by_key_path(&config.monitor_path, id.key().as_str());
    insert_link(response.headers_mut(), &monitor);
    Some(response)
}

/// The status monitor of one layer as a service of its own, for a router that sends it
/// the requests under [`crate::Config::monitor_path`] (the layer's services answer them too,
/// when they see them): made by [`crate::IdempotencyLayer::monitor`].
///
/// ```
/// use axum::Router;
/// use idem_core::{Idem, MemoryStore};
/// use idem_http::IdempotencyLayer;
///
/// let layer = IdempotencyLayer::new(Idem::new(MemoryStore::new()));
/// let app: Router = Router::new()
///     // ... the guarded routes, with `.layer(layer.clone())` ...
///     .route_service("/.idem/keys", layer.monitor())
///     .route_service("/.idem/keys/{*id}", layer.monitor());
/// # let _ = app;
/// ```
#[derive(Clone)]
pub struct Monitor {
    shared: std::sync::Arc<Shared>,
}

impl Monitor {
    pub(crate) fn new(shared: std::sync::Arc<Shared>) -> Self {
        Self { shared }
    }
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor")
            .field("path", &self.shared.config.monitor_path)
            .finish_non_exhaustive()
    }
}

impl<B> tower_service::Service<http::Request<B>> for Monitor {
    type Response = Response<ResponseBody>;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let shared = self.shared.clone();
        let (parts, _) = req.into_parts();
        Box::pin(async move {
            if !is_monitor(&shared, parts.uri.path()) {
                return Ok(not_found());
            }
            Ok(answer(&shared, &parts).await.unwrap_or_else(not_found))
        })
    }
}

/// The monitor's answer for a key it knows nothing of: 404 `not-completed`.
pub fn not_found() -> Response<ResponseBody> {
    Problem::not_completed().into_response()
}

/// `OPTIONS {path}`: the route's key lifetime, as JSON.
fn describe(shared: &Shared) -> Response<ResponseBody> {
    let mut response = Response::new(ResponseBody::full(Bytes::from(
        lifetime(shared).to_string(),
    )));
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(
        http::header::ALLOW,
        HeaderValue::from_static("OPTIONS, GET, HEAD"),
    );
    response
}

/// The key lifetime of a layer's route: what `OPTIONS {path}` answers.
pub(crate) fn lifetime(shared: &Shared) -> serde_json::Value {
    let engine = shared.idem.config();
    let secs = |d: Duration| serde_json::Value::from(d.as_secs_f64());
    serde_json::json!({
        "lease_secs": secs(engine.lease),
        "retention_secs": secs(engine.retention),
        "wait_ms": engine.wait.map(|w| w.as_millis() as u64),
        "max_wait_ms": shared.config.max_wait.as_millis() as u64,
        "after_retention": match engine.after_retention {
            AfterRetention::Refuse => "refuse",
            _ => "run",
        },
        "tombstone_secs": (engine.after_retention == AfterRetention::Refuse)
            .then(|| secs(engine.tombstone)),
        "monitor": shared.config.monitor_path,
    })
}

fn method_not_allowed(allow: &'static str) -> Response<ResponseBody> {
    let mut response = Problem::method_not_allowed(allow).into_response();
    response
        .headers_mut()
        .insert(http::header::ALLOW, HeaderValue::from_static(allow));
    response
}

/// The characters a key keeps percent-encoded in a by-key path.
const KEY_IN_PATH: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// `{path}/by-key/{key}`: the monitor path a client builds from its key.
pub fn by_key_path(monitor_path: &str, key: &str) -> String {
    format!(
        "{}/by-key/{}",
        monitor_path.trim_end_matches('/'),
        utf8_percent_encode(key, KEY_IN_PATH)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_opaque_id_opens_only_with_its_key_and_unaltered() {
        let key = [7u8; 32];
        let id = RecordId::new(
            Scope::new("tenant-1").unwrap(),
            Key::new("order-42").unwrap(),
        );
        let mut plain = vec![8u8];
        plain.extend_from_slice(b"tenant-1order-42");
        let sealed = Aes128Siv::new(&key.into())
            .encrypt([PURPOSE], &plain)
            .unwrap();
        let opaque = URL_SAFE_NO_PAD.encode(&sealed);
        assert!(!opaque.contains("order") && !opaque.contains("tenant"));
        assert_eq!(unseal(&key, &opaque), Some(id));
        assert_eq!(unseal(&[8u8; 32], &opaque), None);
        let mut altered = sealed.clone();
        *altered.last_mut().unwrap() ^= 1;
        assert_eq!(unseal(&key, &URL_SAFE_NO_PAD.encode(altered)), None);
        assert_eq!(unseal(&key, "not base64!"), None);
    }

    #[test]
    fn a_by_key_path_encodes_what_a_path_cannot_hold() {
        assert_eq!(
            by_key_path("/.idem/keys", "order-42"),
            "/.idem/keys/by-key/order-42"
        );
        assert_eq!(
            by_key_path("/.idem/keys", "a/b?c#d%e"),
            "/.idem/keys/by-key/a%2Fb%3Fc%23d%25e"
        );
    }
}
