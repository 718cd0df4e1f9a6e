//! `idemkit::open` on PostgreSQL: migrating is a visible choice
//! (`OpenOptions::with_migrate`), and without it a database lacking idem's tables says what to
//! do. Runs when the facade is built with `postgres` (as the workspace's tests build it).
#![cfg(feature = "postgres")]

mod postgres {
    use idemkit::{OpenErrorKind, OpenOptions};

    #[tokio::test]
    async fn connect_migrates_only_when_asked() {
        let Some(url) = idem_testkit::harness::database_url() else {
            return;
        };
        // A database of this test's own, so that idem's schema is surely absent.
        let name = format!("idemkit_connect_{}", uuid::Uuid::new_v4().simple());
        let admin = idemkit::postgres::PgStore::connect(&url).await.unwrap();
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(admin.pool())
            .await
            .unwrap();
        let fresh = format!("{}/{name}", url.rsplit_once('/').unwrap().0);

        let check = OpenOptions::default().with_migrate(false);
        let err = idemkit::open(&fresh, &check).await.err().unwrap();
        assert_eq!(err.kind(), OpenErrorKind::Unmigrated, "{err}");
        assert!(err.to_string().contains("idem migrate"), "{err}");

        let migrated = idemkit::open(&fresh, &OpenOptions::default()).await; // migrates
        drop(migrated.unwrap());
        let opened = idemkit::open(&fresh, &check).await.unwrap();
        assert_eq!(opened.store().name(), "postgres");
        drop(opened);

        sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)"))
            .execute(admin.pool())
            .await
            .unwrap();
    }
}
