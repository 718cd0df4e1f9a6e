//! Streamed responses through `idem proxy`, with real processes: the Python upstream of
//! `tests/upstream.py` answering `/events` with Server-Sent Events one by one (and saying
//! how many it sent, and whether its connection was cut), the proxy in front of it.

mod support;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::StatusCode;
use idem_testkit::harness::eventually;
use support::{call, client, idem, ms, request, secs, HttpClient, Proc, Reply};

/// The Python upstream on a free port; its base URL is `Proc::printed`.
fn upstream() -> Proc {
    support::upstream_py(0, "HTTP/1.1")
}

/// `idem proxy` to `upstream` on `store`, with `routes` as its routes file; its base URL is
/// `Proc::printed`.
fn proxy(upstream: &str, store: &str, routes: &str) -> Proc {
    proxy_with(upstream, store, routes, &[])
}

/// [`proxy`] with `extra` flags (a key prefix or a schema of the test's own).
fn proxy_with(upstream: &str, store: &str, routes: &str, extra: &[String]) -> Proc {
    let file = support::temp_file("idem_stream_", "routes.toml", routes);
    let args = ["proxy", "--listen", "127.0.0.1:0", "--upstream", upstream];
    let mut command = idem(&args);
    command
        .args(["--store", store, "--config"])
        .arg(&file)
        .arg("--migrate")
        .args(extra);
    Proc::listening(command)
}

const ALICE: (&str, &str) = ("authorization", "Bearer alice");

/// `POST <proxy>/events?<query>` as alice with `key`: the response as it comes.
async fn open(
    client: &HttpClient,
    proxy: &Proc,
    key: &str,
    query: &str,
) -> hyper::Response<Incoming> {
    let url = format!("{}/events?{query}", proxy.printed);
    let req = request("POST", &url, &[ALICE, ("idempotency-key", key)], "");
    client.request(req).await.unwrap()
}

/// The same request, read whole.
async fn post(client: &HttpClient, proxy: &Proc, key: &str, query: &str) -> Reply {
    let url = format!("{}/events?{query}", proxy.printed);
    call(client, "POST", &url, &[ALICE, ("idempotency-key", key)], "").await
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

/// The upstream's account of the last `/events` run of `key`: events sent, whether it
/// ended, whether its connection was cut.
async fn status(client: &HttpClient, upstream: &Proc, key: &str) -> (u64, bool, bool) {
    let url = format!("{}/events/status?key={key}", upstream.printed);
    let doc = call(client, "GET", &url, &[], "").await.json();
    let sent = doc["sent"].as_u64().unwrap_or(0);
    (sent, doc["ended"] == true, doc["cut"] == true)
}

/// How many times `key` ran upstream.
async fn runs(client: &HttpClient, upstream: &Proc, key: &str) -> u64 {
    let url = format!("{}/count?key={key}", upstream.printed);
    call(client, "GET", &url, &[], "").await.json()["runs"]
        .as_u64()
        .unwrap()
}

/// The `count` events of the upstream's run number `serial`, as it sends them.
fn events(serial: u64, count: u64) -> Bytes {
    (0..count)
        .map(|i| format!("id: {i}\ndata: run {serial} event {i}\n\n"))
        .collect::<String>()
        .into()
}

/// One route for every path; `extra` lines under `[defaults]`.
fn routes(extra: &str) -> String {
    format!("[defaults]\n{extra}\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sse_stream_reaches_the_client_live_and_its_retry_replays_it_byte_for_byte() {
    let (up, client) = (upstream(), client());
    let p = proxy(&up.printed, "memory", &routes(""));

    let response = open(&client, &p, "live-1", "n=4&ms=400").await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut body = response.into_body();
    let first = next_data(&mut body).await;
    assert_eq!(first, "id: 0\ndata: run 1 event 0\n\n");
    // The upstream has not sent its second event yet.
    assert_eq!(status(&client, &up, "live-1").await.0, 1);
    let rest = body.collect().await.expect("a clean end").to_bytes();
    let whole = Bytes::from([first, rest].concat());
    assert_eq!(whole, events(1, 4));

    let retry = post(&client, &p, "live-1", "n=4&ms=400").await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.header("content-type"), Some("text/event-stream"));
    assert_eq!(retry.body, whole);
    assert_eq!(runs(&client, &up, "live-1").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_stream_gets_the_whole_stream_on_retry() {
    let (up, client) = (upstream(), client());
    let p = proxy(&up.printed, "memory", &routes(""));

    let mut body = open(&client, &p, "left-1", "n=6&ms=150").await.into_body();
    next_data(&mut body).await;
    drop(body);

    let ended = || async {
        let (sent, ended, cut) = status(&client, &up, "left-1").await;
        ended.then_some((sent, cut))
    };
    let (sent, cut) = eventually("the upstream to end its stream", secs(10), ms(50), ended).await;
    assert_eq!((sent, cut), (6, false));
    let replayed = || async {
        let reply = post(&client, &p, "left-1", "n=6&ms=150").await;
        (reply.status != StatusCode::CONFLICT).then_some(reply)
    };
    let retry = eventually("an answer but 409", secs(5), ms(50), replayed).await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, events(1, 6));
    assert_eq!(runs(&client, &up, "left-1").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_on_disconnect_cancel_the_upstream_is_cut_and_the_key_released() {
    let (up, client) = (upstream(), client());
    let p = proxy(&up.printed, "memory", &routes("on_disconnect = \"cancel\""));

    let mut body = open(&client, &p, "cancel-1", "n=40&ms=100")
        .await
        .into_body();
    next_data(&mut body).await;
    drop(body);

    let cut = || async {
        let (sent, ended, cut) = status(&client, &up, "cancel-1").await;
        assert!(!ended, "the upstream sent its whole stream");
        cut.then_some(sent)
    };
    let sent = eventually("the upstream connection to be cut", secs(5), ms(50), cut).await;
    assert!(sent < 40, "{sent}");
    // Released: the retry runs again, and is no replay.
    let again = || async {
        let mut response = open(&client, &p, "cancel-1", "n=2&ms=10").await;
        (response.status() == StatusCode::OK).then_some(())?;
        assert!(response.headers().get("idempotent-replayed").is_none());
        Some(next_data(response.body_mut()).await)
    };
    let first = eventually("the key to be released", secs(5), ms(50), again).await;
    assert_eq!(first, "id: 0\ndata: run 2 event 0\n\n");
    assert_eq!(runs(&client, &up, "cancel-1").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_over_the_limit_is_passed_on_whole_and_not_stored() {
    let (up, client) = (upstream(), client());
    let p = proxy(&up.printed, "memory", &routes("max_response_body = 64"));

    let first = post(&client, &p, "big-1", "n=5&ms=20").await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body, events(1, 5), "the stream is passed on whole");
    // Not stored, and the lease kept (the default): 409, and the upstream ran once.
    let retry = post(&client, &p, "big-1", "n=5&ms=20").await;
    assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
    assert_eq!(runs(&client, &up, "big-1").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_lost_before_the_end_cuts_the_stream_without_its_last_chunk() {
    let Some(mut redis) = idem_testkit::redis::throwaway(&[]) else {
        return;
    };
    let (up, client) = (upstream(), client());
    let p = proxy(&up.printed, &redis.url(), &routes(""));

    let mut body = open(&client, &p, "cut-1", "n=3&ms=300").await.into_body();
    next_data(&mut body).await;
    redis.stop();
    let mut rest = Vec::new();
    let broken = loop {
        match body.frame().await {
            Some(Ok(frame)) => rest.extend_from_slice(&frame.into_data().unwrap()),
            Some(Err(e)) => break e.to_string(),
            None => panic!("a clean end of a stream that was not recorded"),
        }
    };
    // Every event came; only the end did not.
    assert_eq!(rest, events(1, 3)[events(1, 1).len()..], "{broken}");
}

/// A store two proxies share, for one test: its `--store` URL and naming flags; `None` (the
/// test returns) when its server is missing and not required.
async fn shared_store(
    backend: &str,
) -> Option<(
    String,
    Vec<String>,
    Option<idem_testkit::redis::RedisCluster>,
)> {
    let name = idem_testkit::harness::unique_name("idem_join_");
    let redis = || idem_testkit::harness::redis_url();
    let pg = || idem_testkit::harness::database_url();
    Some(match backend {
        "redis" => (redis()?, vec!["--prefix".into(), name], None),
        "postgres" => (pg()?, vec!["--schema".into(), name], None),
        "tiered" => (
            format!("tiered:{}|{}", redis()?, pg()?),
            vec!["--prefix".into(), name.clone(), "--schema".into(), name],
            None,
        ),
        _ => {
            if !idem_testkit::redis::available() {
                return None;
            }
            let cluster =
                tokio::task::spawn_blocking(|| idem_testkit::redis::RedisCluster::start(3))
                    .await
                    .unwrap()
                    .expect("start a 3-primary cluster");
            (cluster.url(), vec![], Some(cluster))
        }
    })
}

/// Two proxies on one store: a client streams through the first, and a duplicate that comes
/// through the second while the stream runs joins it: the same status and content type, the
/// whole stream byte for byte (what came before it joined, then the rest live), and the
/// same clean end; the upstream runs once.
async fn a_duplicate_on_another_proxy_joins_the_stream(backend: &str) {
    let Some((store, flags, _cluster)) = shared_store(backend).await else {
        return;
    };
    let (up, client) = (upstream(), client());
    let start = |extra: &[String]| proxy_with(&up.printed, &store, &routes(""), extra);
    let (a, b) = (start(&flags), start(&flags));
    let key = format!("join-{}", uuid::Uuid::new_v4().simple());
    let response = open(&client, &a, &key, "n=8&ms=250").await;
    let mut body = response.into_body();
    let first = next_data(&mut body).await;
    // Events 0 and 1 have gone out before the duplicate comes.
    let second = next_data(&mut body).await;
    let joined = open(&client, &b, &key, "n=8&ms=250").await;
    assert_eq!(joined.status(), StatusCode::OK);
    assert_eq!(joined.headers()["content-type"], "text/event-stream");
    assert_eq!(joined.headers()["idempotent-replayed"], "true");
    let rest = body.collect().await.expect("a clean end").to_bytes();
    let whole = Bytes::from([first, second, rest].concat());
    assert_eq!(whole, events(1, 8));
    let joined = joined.into_body().collect().await.expect("a clean end");
    assert_eq!(joined.to_bytes(), whole, "the joined stream, byte for byte");
    // Once complete, through either proxy: the replay byte for byte, and a client that
    // resumes after event 5 gets events 6 and 7.
    for proxy in [&a, &b] {
        let replay = post(&client, proxy, &key, "n=8&ms=250").await;
        assert!(replay.replayed(), "{replay:?}");
        assert_eq!(replay.body, whole);
        let url = format!("{}/events?n=8&ms=250", proxy.printed);
        let headers = [
            ALICE,
            ("idempotency-key", key.as_str()),
            ("last-event-id", "5"),
        ];
        let resumed = call(&client, "POST", &url, &headers, "").await;
        assert_eq!(resumed.body, events(1, 8).slice(events(1, 6).len()..));
    }
    assert_eq!(runs(&client, &up, &key).await, 1);
}

/// A proxy killed (`kill -9`) while it streams: a duplicate that joined through the other
/// proxy sees its stream end with an error (not a clean end: nothing was recorded), and a
/// retry once the dead proxy's lease ran out runs the work again as attempt 2, whose
/// stream the retry gets whole.
async fn a_killed_holder_ends_a_joined_stream_with_an_error(backend: &str) {
    let Some((store, flags, _cluster)) = shared_store(backend).await else {
        return;
    };
    let (up, client) = (upstream(), client());
    let start =
        |extra: &[String]| proxy_with(&up.printed, &store, &routes("lease_secs = 2"), extra);
    let (mut a, b) = (start(&flags), start(&flags));
    let key = format!("kill-{}", uuid::Uuid::new_v4().simple());
    let mut body = open(&client, &a, &key, "n=12&ms=100").await.into_body();
    next_data(&mut body).await;
    next_data(&mut body).await;
    let joined = open(&client, &b, &key, "n=12&ms=100").await;
    assert_eq!(joined.status(), StatusCode::OK);
    let mut joined = joined.into_body();
    a.stop();
    let ended = loop {
        match tokio::time::timeout(secs(15), joined.frame()).await {
            Ok(Some(Ok(_))) => continue,
            Ok(Some(Err(e))) => break Ok(e),
            Ok(None) => break Err("a clean end of a stream whose holder died"),
            Err(_) => break Err("the joined stream never ended"),
        }
    };
    ended.expect("the joined stream ends with an error");
    // The dead proxy's lease (2 s) has run out: a retry runs the work again, attempt 2.
    let retry = post(&client, &b, &key, "n=12&ms=100").await;
    assert_eq!(retry.status, StatusCode::OK, "{retry:?}");
    assert!(!retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, events(2, 12));
    assert_eq!(runs(&client, &up, &key).await, 2);
}

support::on_stores!(
    [redis, redis_cluster, postgres, tiered],
    [
        a_duplicate_on_another_proxy_joins_the_stream,
        a_killed_holder_ends_a_joined_stream_with_an_error,
    ]
);
