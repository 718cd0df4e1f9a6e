//! `idem serve` started while its store is down, or on a store that persists nothing.

use super::*;

mod tiered {
    /// `idem serve` on the tiered store while its Redis is down: it starts, says so, takes
    /// payments on PostgreSQL alone, and says when Redis answers again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serve_starts_while_redis_is_down() {
        let Some(postgres) = idem_testkit::harness::database_url() else {
            return;
        };
        let Some(mut redis) = idem_testkit::redis::throwaway(&[]) else {
            return;
        };
        redis.stop();
        let store = format!("tiered:{}|{postgres}", redis.url());
        let mut served = super::serve(&store, &[]);
        let client = super::client();
        let (_, auth) = super::payer("down");
        let order = r#"{"amount": 300, "currency": "EUR"}"#;
        let pay = |key| super::pay(&client, &served, &auth, key, order);
        for replayed in [false, true] {
            let paid = pay("order-1").await;
            assert_eq!(paid.status, 201, "{:?}", paid.body);
            assert_eq!(paid.replayed(), replayed);
        }

        redis.start_again().expect("restart redis-server");
        // The server notices within its one-second probe.
        tokio::time::sleep(std::time::Duration::from_millis(2500)).await;
        let second = pay("order-2").await;
        assert_eq!(second.status, 201, "{:?}", second.body);
        assert_eq!(super::list(&client, &served, &auth).await["count"], 2);

        let log = served.stop();
        assert!(log.contains("Redis unreachable at start"), "{log}");
        assert!(log.contains("Redis reachable"), "{log}");
    }
}

mod redis_persistence {
    //! `idem serve` on throwaway `redis-server`s, one persisting nothing and one with an
    //! append-only file: only the first is warned about at start, and not when it is the
    //! Redis of a tiered store.

    use idem_testkit::redis::{self as testing, RedisServer};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serve_warns_when_redis_persists_nothing() {
        let Some(bare) = testing::throwaway(&[]) else {
            return;
        };
        let aof = RedisServer::start_with(&["--appendonly", "yes"]).expect("start redis-server");
        let mut stores = vec![(bare.url(), true), (aof.url(), false)];
        // The tiered store's Redis needs no persistence (PostgreSQL is the arbiter): no
        // warning, which would tell its user to use the store they already use.
        if let Some(postgres) = idem_testkit::harness::database_url() {
            stores.push((format!("tiered:{}|{postgres}", bare.url()), false));
        }
        let client = super::client();
        for (store, warned) in stores {
            let mut served = super::serve(&store, &[]);
            // One payment, so that every store has been used (a store may check its server
            // on first use rather than at start).
            let (_, auth) = super::payer("persist");
            let order = r#"{"amount": 1, "currency": "EUR"}"#;
            let paid = super::pay(&client, &served, &auth, "k", order).await;
            assert_eq!(paid.status, 201, "{store}");
            let log = served.stop();
            assert_eq!(
                log.contains("REDIS PERSISTS NOTHING"),
                warned,
                "{store}: {log}"
            );
        }
        // An operator's command starts no store: reading a record is no moment to warn.
        let err = super::exits(0, super::run(&["stats", "--store", &bare.url()]));
        assert!(!err.contains("REDIS PERSISTS NOTHING"), "{err}");
    }
}

mod redis_outage {
    //! `idem serve` on a plain Redis store started while that Redis is stopped: it starts,
    //! answers 503 (fail closed: no payment runs unguarded), says so in one log line, and
    //! takes payments as soon as Redis answers.

    use idem_testkit::redis as testing;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serve_starts_while_redis_is_down_and_answers_503_until_it_returns() {
        let Some(mut redis) = testing::throwaway(&[]) else {
            return;
        };
        redis.stop();
        let mut served = super::serve(&redis.url(), &[]);
        let client = super::client();
        let (_, auth) = super::payer("outage");
        let order = r#"{"amount": 300, "currency": "EUR"}"#;
        let pay = || super::pay(&client, &served, &auth, "order-1", order);
        let refused = pay().await;
        assert_eq!(refused.status, 503, "{:?}", refused.body);
        assert_eq!(super::list(&client, &served, &auth).await["count"], 0);
        // Alive, and not ready while its store does not answer.
        let get = |path: &str| {
            let url = format!("{}{path}", served.printed);
            let client = client.clone();
            async move { super::call(&client, "GET", &url, &[], "").await }
        };
        assert_eq!(get("/livez").await.status, 200);
        let not_ready = get("/readyz").await;
        assert_eq!(not_ready.status, 503, "{not_ready:?}");
        assert_eq!(
            not_ready.problem_type(),
            "urn:idem:problem:store-unavailable"
        );

        redis.start_again().expect("restart redis-server");
        // The store reconnects on its next call; allow it a few tries.
        let paid = super::retry_while(503, pay).await;
        assert_eq!(paid.status, 201, "{:?}", paid.body);
        assert_eq!(super::list(&client, &served, &auth).await["count"], 1);
        let ready = get("/readyz").await;
        assert_eq!(ready.status, 200, "{ready:?}");

        let log = served.stop();
        assert_eq!(
            log.matches("Redis unreachable at start").count(),
            1,
            "{log}"
        );
    }
}
