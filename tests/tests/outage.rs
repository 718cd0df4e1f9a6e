//! A short outage of a real server: a Redis paused with `SIGSTOP` while begins time out.
//! The begins it runs when it resumes claim keys whose callers already got an error; the
//! engine gives those claims back, so the keys answer within seconds of the resume instead
//! of `InFlight` for a whole lease.

mod common;

mod redis {
    use std::time::Duration;

    use idem_core::{Begin, Config, Fingerprint, Idem, Key, RecordId, Response, Scope};
    use idem_redis::RedisStore;
    use idem_testkit::redis::{self as testing, RedisServer};
    use tokio::time::Instant;

    use crate::common::{redis_pid, Stopped};

    const KEYS: usize = 20;
    const LEASE: Duration = Duration::from_secs(30);
    const PAUSE: Duration = Duration::from_secs(5);
    /// How soon after the resume every key must be free again: seconds, not the lease.
    const FREE_WITHIN: Duration = Duration::from_secs(5);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn keys_claimed_by_timed_out_begins_are_free_soon_after_the_resume() {
        if !testing::available() {
            return;
        }
        let server = RedisServer::start().expect("start redis-server");
        let store = RedisStore::connect(server.url()).await.expect("connect");
        let idem = Idem::new(store).with_config(
            Config::default()
                .with_lease(LEASE)
                .with_store_timeout(Duration::from_secs(1)),
        );
        let scope = Scope::new("outage").unwrap();
        let ids: Vec<RecordId> = (0..KEYS)
            .map(|i| RecordId::new(scope.clone(), Key::new(format!("k{i}")).unwrap()))
            .collect();
        let fp = Fingerprint::of_bytes(b"payment");
        // The connection is up and the scripts loaded before the pause.
        let warm = RecordId::new(scope.clone(), Key::new("warm").unwrap());
        let Begin::Acquired(lease) = idem.begin(&warm, fp).await.unwrap() else {
            panic!("warm-up key not acquired")
        };
        idem.complete(&lease, Response::new(200, "ok"))
            .await
            .unwrap();

        let stopped = Stopped::stop(redis_pid(&server));
        let paused = Instant::now();
        // Every begin times out: its caller sees Unavailable (a 503 over HTTP), while the
        // command waits in the server's socket to run at the resume.
        let mut begins = tokio::task::JoinSet::new();
        for id in ids.clone() {
            let idem = idem.clone();
            begins.spawn(async move { idem.begin(&id, fp).await });
        }
        while let Some(answer) = begins.join_next().await {
            let err = answer
                .unwrap()
                .expect_err("a begin answered while the server was paused");
            assert!(err.is_retryable(), "{err}");
        }
        tokio::time::sleep(PAUSE.saturating_sub(paused.elapsed())).await;
        stopped.resume();
        let resumed = Instant::now();

        // Retries of every key, as clients would send them: each must be acquired (no
        // handler ever ran for it), within seconds of the resume.
        let mut in_flight = 0;
        for id in &ids {
            loop {
                match idem.begin(id, fp).await {
                    Ok(Begin::Acquired(_)) => break,
                    Ok(Begin::InFlight { .. }) | Err(_) => {
                        in_flight += 1;
                        assert!(
                            resumed.elapsed() < FREE_WITHIN,
                            "{id} still blocked {:?} after the resume (the lease is {LEASE:?})",
                            resumed.elapsed()
                        );
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Ok(other) => panic!("{id}: {other:?}"),
                }
            }
        }
        eprintln!(
            "every key acquired {:?} after the resume ({in_flight} retries found one busy)",
            resumed.elapsed()
        );
    }
}
