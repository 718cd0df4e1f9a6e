//! Stores opened by URL (`idemkit::open`) purge their expired records in the
//! background, so a long-running service on PostgreSQL does not grow forever.

mod postgres {
    use std::time::Duration;

    use idem_core::{Begin, BeginRequest, FencingToken, Fingerprint, Key, RecordId, Scope};
    use idem_testkit::harness;
    use idemkit::OpenOptions;
    use tokio::time::Instant;

    const RECORDS: usize = 5;
    /// Long enough that the rows are still there when counted on a loaded machine (any
    /// purge, this store's or another test's, may delete them once expired); short enough
    /// for a quick test.
    const LIFE: Duration = Duration::from_secs(3);

    #[tokio::test]
    async fn a_store_opened_by_url_purges_expired_records() {
        let Some(url) = harness::database_url() else {
            return;
        };
        let options = OpenOptions::default().with_purge_interval(Some(Duration::from_millis(200)));
        let opened = idemkit::open(&url, &options).await.unwrap();
        let store = opened.store();
        let scope = Scope::new(harness::unique_name("purge")).unwrap();
        for i in 0..RECORDS {
            let id = RecordId::new(scope.clone(), Key::new(format!("k{i}")).unwrap());
            let req = BeginRequest {
                id: &id,
                fingerprint: Fingerprint::of_bytes(b"req"),
                token: FencingToken::random(),
                lease: LIFE,
                retention: LIFE,
            };
            assert!(matches!(store.begin(req).await, Ok(Begin::Acquired(_))));
        }
        // The rows themselves, not what the store answers: expired records already behave
        // as absent, and only the purge deletes them.
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        let count = || async {
            let sql = format!(
                "SELECT count(*) FROM {}.records WHERE scope = $1",
                idem_postgres::DEFAULT_SCHEMA
            );
            sqlx::query_scalar::<_, i64>(&sql)
                .bind(scope.as_str().as_bytes())
                .fetch_one(&pool)
                .await
                .unwrap()
        };
        assert_eq!(count().await, RECORDS as i64);
        let started = Instant::now();
        while count().await > 0 {
            assert!(
                started.elapsed() < LIFE + Duration::from_secs(10),
                "{} expired records still there after {:?}",
                count().await,
                started.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        drop((store, opened));
    }
}
