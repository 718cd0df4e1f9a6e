//! Streamed responses behind the layer: an axum handler answering with a body of events
//! that come one by one (as Server-Sent Events do) reaches its client live, is stored when it
//! ends, and a client sees a clean end only for a response that was recorded.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use idem_core::{Idem, MemoryStore, Store};
use idem_http::{Config, OnDisconnect, Outcome, Unstored};
use idem_testkit::faults::FaultyStore;
use idem_testkit::harness::eventually;

// The harness's other parts serve the other test files.
#[allow(dead_code)]
mod support;

use support::*;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Events a handler's stream has produced, whether it ran to its end, and whether it was
/// dropped before.
#[derive(Clone, Default)]
struct Probe(Arc<ProbeState>);

#[derive(Default)]
struct ProbeState {
    sent: AtomicUsize,
    ended: AtomicBool,
    dropped_early: AtomicBool,
}

impl Probe {
    fn sent(&self) -> usize {
        self.0.sent.load(Ordering::SeqCst)
    }
    fn ended(&self) -> bool {
        self.0.ended.load(Ordering::SeqCst)
    }
    fn dropped_early(&self) -> bool {
        self.0.dropped_early.load(Ordering::SeqCst)
    }
}

/// Held by the stream: tells the probe when it is dropped before its end.
struct Guard(Probe);

impl Drop for Guard {
    fn drop(&mut self) {
        if !self.0.ended() {
            self.0 .0.dropped_early.store(true, Ordering::SeqCst);
        }
    }
}

/// The `i`th event of run `n`, `pad` bytes of padding in its data.
fn event(n: usize, i: usize, pad: usize) -> String {
    format!("id: {i}\ndata: run {n} event {i} {}\n\n", "x".repeat(pad))
}

/// Serves `POST /events`: run `n` answers 200 `text/event-stream` with `count` events (of
/// [`event`]), the first at once and each next one `gap` later; behind the layer on `store`
/// and `config`.
async fn serve_events(
    store: Arc<dyn Store>,
    config: Config,
    count: usize,
    gap: Duration,
    pad: usize,
) -> (Server, Runs, Outcomes, Probe) {
    serve_events_with(Idem::from_arc(store), config, count, gap, pad).await
}

/// [`serve_events`] on a memory store of its own with the default config, no padding.
async fn serve_plain_events(count: usize, gap: Duration) -> (Server, Runs, Outcomes, Probe) {
    serve_events(
        Arc::new(MemoryStore::new()),
        Config::default(),
        count,
        gap,
        0,
    )
    .await
}

/// [`serve_events`] on `idem`.
async fn serve_events_with(
    idem: Idem,
    config: Config,
    count: usize,
    gap: Duration,
    pad: usize,
) -> (Server, Runs, Outcomes, Probe) {
    let probe = Probe::default();
    let p = probe.clone();
    let (server, runs, outcomes) = serve_counted(idem, config, "/events", move |n, _, _| {
        let probe = p.clone();
        async move {
            let events =
                futures_util::stream::unfold((0, Guard(probe)), move |(i, guard)| async move {
                    if i == count {
                        guard.0 .0.ended.store(true, Ordering::SeqCst);
                        return None;
                    }
                    if i > 0 {
                        tokio::time::sleep(gap).await;
                    }
                    guard.0 .0.sent.store(i + 1, Ordering::SeqCst);
                    let chunk = Ok::<_, std::io::Error>(Bytes::from(event(n, i, pad)));
                    Some((chunk, (i + 1, guard)))
                });
            (
                StatusCode::OK,
                [("content-type", "text/event-stream")],
                Body::from_stream(events),
            )
                .into_response()
        }
    })
    .await;
    (server, runs, outcomes, probe)
}

/// Every event of run `n`, as sent.
fn all_events(n: usize, count: usize, pad: usize) -> Bytes {
    (0..count)
        .map(|i| event(n, i, pad))
        .collect::<String>()
        .into()
}

const KEY: (&str, &str) = ("idempotency-key", "stream-1");

/// `POST /events` with the key, its response as it comes.
async fn open(server: &Server) -> http::Response<Incoming> {
    let req = http::Request::post(format!("{}/events", server.base))
        .header(KEY.0, KEY.1)
        .body(Full::new(Bytes::new()).boxed())
        .unwrap();
    server.client.request(req).await.unwrap()
}

/// The next data of a streamed body.
async fn next_data(body: &mut Incoming) -> Bytes {
    loop {
        let frame = body.frame().await.expect("a frame").expect("no error");
        if let Ok(data) = frame.into_data() {
            return data;
        }
    }
}

#[tokio::test]
async fn the_first_event_reaches_the_client_live_and_the_retry_replays_the_stream() {
    let (server, runs, outcomes, probe) = serve_plain_events(4, ms(300)).await;

    let response = open(&server).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers().get("idempotent-replayed").is_none());
    assert!(response.headers().get("idempotency-expires").is_some());
    let mut body = response.into_body();
    let first = next_data(&mut body).await;
    assert_eq!(first, event(1, 0, 0));
    assert_eq!(
        probe.sent(),
        1,
        "the first event came only after the second was made"
    );
    let rest = body.collect().await.expect("a clean end").to_bytes();
    let whole = [first, rest].concat();
    assert_eq!(whole, all_events(1, 4, 0));
    assert_eq!(outcomes.count(Outcome::Executed), 1);

    let retry = server.post("/events", &[KEY], "").await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.status, StatusCode::OK);
    assert_eq!(retry.header("content-type"), Some("text/event-stream"));
    assert_eq!(retry.body, whole, "the replay is the stream byte for byte");
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_gets_the_whole_stream_replayed_on_retry() {
    let (server, runs, outcomes, probe) = serve_plain_events(5, ms(150)).await;

    let mut body = open(&server).await.into_body();
    assert_eq!(next_data(&mut body).await, event(1, 0, 0));
    // The client goes away: its connection closes with the body unread.
    drop(body);

    let ended = || async { probe.ended().then_some(()) };
    eventually("the stream to run to its end", ms(5000), ms(20), ended).await;
    assert!(!probe.dropped_early());
    let stored = || async { (outcomes.count(Outcome::Executed) == 1).then_some(()) };
    eventually("the stream to be stored", ms(5000), ms(20), stored).await;
    let retry = server.post("/events", &[KEY], "").await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, all_events(1, 5, 0));
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn with_cancel_a_client_that_leaves_drops_the_stream_and_releases_the_key() {
    let store = Arc::new(MemoryStore::new());
    let config = Config::default().with_on_disconnect(OnDisconnect::Cancel);
    let gap = Duration::from_millis(200);
    let (server, runs, outcomes, probe) = serve_events(store, config, 10, gap, 0).await;

    let mut body = open(&server).await.into_body();
    assert_eq!(next_data(&mut body).await, event(1, 0, 0));
    drop(body);

    let dropped = || async { probe.dropped_early().then_some(()) };
    eventually("the stream to be dropped", ms(3000), ms(20), dropped).await;
    assert!(probe.sent() < 10, "the stream ran to its end");
    let released = || async { (outcomes.count(Outcome::NotStored) == 1).then_some(()) };
    eventually("the key to be released", ms(3000), ms(20), released).await;
    // Released: the retry runs the work again.
    let mut again = open(&server).await;
    assert!(again.headers().get("idempotent-replayed").is_none());
    assert_eq!(next_data(again.body_mut()).await, event(2, 0, 0));
    assert_eq!(runs.get(), 2);
}

#[tokio::test]
async fn a_stream_whose_completion_cannot_be_stored_never_ends_cleanly() {
    let store = Arc::new(FaultyStore::new(MemoryStore::new()));
    let config = Config::default().with_store_response_within(ms(300));
    let gap = Duration::from_millis(50);
    let (server, runs, outcomes, _) = serve_events(store.clone(), config, 3, gap, 0).await;
    store.set_complete_down(true);

    let mut body = open(&server).await.into_body();
    // Every event is sent live; only the end is held back, and it never comes clean.
    let mut received = Vec::new();
    let broken = loop {
        match body.frame().await {
            Some(Ok(frame)) => received.extend_from_slice(&frame.into_data().unwrap()),
            Some(Err(e)) => break e,
            None => panic!("a clean end of an unrecorded stream"),
        }
    };
    assert_eq!(received, all_events(1, 3, 0), "{broken}");
    assert_eq!(outcomes.count(Outcome::StoreError), 1);
    // The key is still held, not released: a retry does not run the work again.
    let retry = server.post("/events", &[KEY], "").await;
    assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn a_stream_over_the_limit_is_sent_whole_and_unstored_per_policy() {
    for (unstored, runs_after) in [(Unstored::KeepLease, 1), (Unstored::Release, 2)] {
        let store = Arc::new(MemoryStore::new());
        let config = Config::default()
            .with_max_response_body(1024)
            .with_unstored(unstored);
        let gap = Duration::from_millis(20);
        let (server, runs, outcomes, _) = serve_events(store, config, 5, gap, 400).await;

        let response = open(&server).await;
        assert_eq!(response.status(), StatusCode::OK);
        let body = response.into_body().collect().await.expect("a clean end");
        assert_eq!(body.to_bytes(), all_events(1, 5, 400), "{unstored:?}");
        assert_eq!(outcomes.count(Outcome::NotStored), 1, "{unstored:?}");
        let retry = server.post("/events", &[KEY], "").await;
        assert!(!retry.replayed(), "{unstored:?}: {retry:?}");
        match unstored {
            Unstored::KeepLease => assert_eq!(retry.status, StatusCode::CONFLICT),
            _ => assert_eq!(retry.body, all_events(2, 5, 400)),
        }
        assert_eq!(runs.get(), runs_after, "{unstored:?}");
    }
}

#[tokio::test]
async fn a_stream_longer_than_the_lease_keeps_its_key() {
    let engine = idem_core::Config::default().with_lease(ms(600));
    let idem = Idem::new(MemoryStore::new()).with_config(engine);
    let gap = Duration::from_millis(250);
    let (server, runs, _, probe) = serve_events_with(idem, Config::default(), 7, gap, 0).await;

    let response = open(&server).await;
    // Well past the lease (1.5 s of events against 600 ms), the stream still holds the key:
    // a duplicate joins it, and the work is not run again.
    tokio::time::sleep(ms(1200)).await;
    let duplicate = server.post("/events", &[KEY], "").await;
    let body = response.into_body().collect().await.expect("a clean end");
    assert_eq!(body.to_bytes(), all_events(1, 7, 0));
    assert_eq!(duplicate.status, StatusCode::OK, "{duplicate:?}");
    assert!(duplicate.replayed(), "{duplicate:?}");
    assert_eq!(
        duplicate.body,
        all_events(1, 7, 0),
        "the joined stream, byte for byte"
    );
    assert!(probe.ended());
    let retry = server.post("/events", &[KEY], "").await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(runs.get(), 1);
}

/// A bare tower service answering with two data frames, 20 ms apart, then trailers.
#[derive(Clone)]
struct Trailing;

type TrailingBody = http_body_util::StreamBody<
    futures_util::stream::BoxStream<'static, Result<http_body::Frame<Bytes>, std::io::Error>>,
>;

impl tower_service::Service<http::Request<idem_http::RequestBody<Full<Bytes>>>> for Trailing {
    type Response = http::Response<TrailingBody>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: http::Request<idem_http::RequestBody<Full<Bytes>>>) -> Self::Future {
        use futures_util::StreamExt;
        let frames = futures_util::stream::unfold(0, |i| async move {
            tokio::time::sleep(ms(20)).await;
            let frame = match i {
                0 | 1 => http_body::Frame::data(Bytes::from(format!("part {i}\n"))),
                2 => {
                    let mut trailers = http::HeaderMap::new();
                    trailers.insert("x-checksum", "abc".parse().unwrap());
                    http_body::Frame::trailers(trailers)
                }
                _ => return None,
            };
            Some((Ok(frame), i + 1))
        });
        let body = http_body_util::StreamBody::new(frames.boxed());
        std::future::ready(Ok(http::Response::new(body)))
    }
}

/// The trailers of a streamed body go to its first client, held back with its end, and are
/// not stored: a replay has none, as for a buffered body.
#[tokio::test]
async fn a_streamed_bodys_trailers_reach_its_client_and_are_not_replayed() {
    use tower_layer::Layer;
    use tower_service::Service;

    let outcomes = Outcomes::default();
    let idem = Idem::new(MemoryStore::new());
    let mut svc = layer_with(idem, Config::default(), &outcomes).layer(Trailing);
    let request = || {
        http::Request::post("/x")
            .header(KEY.0, KEY.1)
            .body(Full::new(Bytes::new()))
            .unwrap()
    };

    let first = svc.call(request()).await.unwrap();
    let collected = first.into_body().collect().await.expect("a clean end");
    assert_eq!(collected.trailers().unwrap()["x-checksum"], "abc");
    assert_eq!(collected.to_bytes(), "part 0\npart 1\n");
    assert_eq!(outcomes.count(Outcome::Executed), 1);
    let replay = svc.call(request()).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let collected = replay.into_body().collect().await.unwrap();
    assert!(collected.trailers().is_none());
    assert_eq!(collected.to_bytes(), "part 0\npart 1\n");
}

/// `POST /events` with the key and `Last-Event-ID: last`, read whole.
async fn resume(server: &Server, last: &'static str) -> Reply {
    server
        .post("/events", &[KEY, ("last-event-id", last)], "")
        .await
}

/// A client that lost a stream of events resumes after the last event it received: from
/// the record once the stream is complete, and live when it joins the stream still
/// running; the work runs once.
#[tokio::test]
async fn a_dropped_client_resumes_after_its_last_event_id() {
    let (server, runs, _, _) = serve_plain_events(6, ms(200)).await;

    let mut body = open(&server).await.into_body();
    next_data(&mut body).await;
    next_data(&mut body).await;
    // Joined while it runs, after event 1: events 2 to 5, live, then the clean end.
    let joined = resume(&server, "1").await;
    assert!(joined.replayed(), "{joined:?}");
    let after =
        |from: usize| -> Bytes { (from..6).map(|i| event(1, i, 0)).collect::<String>().into() };
    assert_eq!(joined.body, after(2));
    body.collect().await.expect("a clean end");
    // From the record: after event 3, then after the last one (nothing left).
    assert_eq!(resume(&server, "3").await.body, after(4));
    assert_eq!(resume(&server, "5").await.body, "");
    // An id the stream never had: the whole stream.
    assert_eq!(
        resume(&server, "no-such-id").await.body,
        all_events(1, 6, 0)
    );
    assert_eq!(runs.get(), 1);
}

/// With `sse_ids`, the events of a service that sends no `id:` are numbered as they pass:
/// the first client, every replay and a resumed client see the same ids.
#[tokio::test]
async fn events_without_ids_are_numbered_the_same_in_every_replay() {
    let config = Config::default().with_sse_ids(true);
    let idem = Idem::new(MemoryStore::new());
    let (server, runs, _) = serve_counted(idem, config, "/events", |n, _, _| async move {
        let events = futures_util::stream::unfold(0, move |i| async move {
            if i == 4 {
                return None;
            }
            tokio::time::sleep(ms(30)).await;
            let event = Bytes::from(format!("data: run {n} token {i}\n\n"));
            Some((Ok::<_, std::io::Error>(event), i + 1))
        });
        (
            StatusCode::OK,
            [("content-type", "text/event-stream")],
            Body::from_stream(events),
        )
            .into_response()
    })
    .await;
    let numbered = |from: usize| -> Bytes {
        (from..4)
            .map(|i| format!("id: {i}\ndata: run 1 token {i}\n\n"))
            .collect::<String>()
            .into()
    };
    let first = open(&server).await.into_body().collect().await.unwrap();
    assert_eq!(first.to_bytes(), numbered(0));
    let replay = server.post("/events", &[KEY], "").await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, numbered(0));
    assert_eq!(resume(&server, "1").await.body, numbered(2));
    assert_eq!(runs.get(), 1);
}
