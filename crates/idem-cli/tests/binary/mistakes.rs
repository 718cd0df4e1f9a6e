//! Mistakes a user makes (wrong ports, schemes, passwords, values) and what `idem` says of
//! them: the cause and the fix, as JSON with `--json`, with the exit code of their kind.

use super::*;

mod redis_password {
    //! A Redis that refuses the password: that refusal is the one thing said.

    use idem_testkit::redis as testing;

    #[test]
    fn a_wrong_password_is_said_without_a_maxmemory_warning_first() {
        let Some(server) = testing::throwaway(&[]) else {
            return;
        };
        // The password set once the server is up (its readiness check needs none).
        let set = server.cli(&["CONFIG", "SET", "requirepass", "right"]);
        assert_eq!(set.expect("redis-cli").trim(), "OK", "set a password");
        let url = server.url().replacen("redis://", "redis://:wrong@", 1);
        let err = super::exits(3, super::run(&["stats", "--store", &url]));
        assert!(!err.contains("maxmemory"), "{err}");
        assert!(err.to_lowercase().contains("pass"), "{err}");
        assert!(!err.contains(":wrong@"), "{err}");
    }
}

mod errors {
    //! Errors that name the cause and the fix; `--json` errors as JSON.

    use super::{assert_fields, json};

    #[test]
    fn wrong_ports_and_schemes_say_what_to_do() {
        let Some((redis, postgres)) = super::both_urls() else {
            return;
        };
        let port = |url: &str| {
            let after_colon = url.rsplit(':').next().unwrap();
            after_colon.split('/').next().unwrap().to_owned()
        };
        let (redis_port, pg_port) = (port(&redis), port(&postgres));

        let closed = idem_testkit::harness::refused_port();
        for url in [
            format!("postgres://postgres@127.0.0.1:{closed}/test"),
            format!("redis://127.0.0.1:{closed}"),
        ] {
            let err = super::exits(3, super::run(&["stats", "--store", &url, "--json"]));
            let doc = super::json(&err);
            assert_fields(&doc["error"], json!({"kind": "open", "exit_code": 3}));
            let message = doc["error"]["message"].as_str().unwrap();
            assert!(message.contains("connection refused"), "{message}");
            assert!(message.contains("start the server"), "{message}");
        }

        // Another server at the port, or one that accepts connections and never answers (a
        // timeout, said as such).
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let silent_port = silent.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for stream in silent.incoming().flatten() {
                held.push(stream);
            }
        });
        let timed_out = "answered nothing in time (timed out)";
        for (url, says) in [
            (
                format!("redis://127.0.0.1:{pg_port}"),
                "speaks PostgreSQL and this URL expects Redis: use postgres://",
            ),
            (
                format!("postgres://postgres@127.0.0.1:{redis_port}/test"),
                "speaks Redis and this URL expects PostgreSQL",
            ),
            (format!("redis://127.0.0.1:{silent_port}"), timed_out),
            (
                format!("postgres://postgres@127.0.0.1:{silent_port}/test"),
                timed_out,
            ),
        ] {
            let err = super::exits(3, super::run(&["stats", "--store", &url]));
            assert!(err.contains(says), "{url}: {err}");
        }

        // Usage errors are JSON too with --json, and exit 2.
        let (code, out, err) = super::run(&["stats", "--timeout", "soon", "--json"]);
        assert_eq!((code, out.as_str()), (2, ""), "{err}");
        let doc = super::json(&err);
        assert_eq!(doc["error"]["kind"], "usage");
        let message = doc["error"]["message"].as_str().unwrap();
        assert!(message.contains("--timeout"), "{doc}");
        let (code, _, err) = super::run(&["inspect", "k", "--json"]);
        assert_eq!(code, 2);
        assert_eq!(super::json(&err)["error"]["kind"], "unsupported");
    }

    /// `idem serve` starts while nothing answers at its Redis (it waits, answering 503), but
    /// refuses to start, as `idem stats` does, when another server answers there: a
    /// PostgreSQL port will never become a Redis.
    #[test]
    fn serve_refuses_a_redis_url_at_a_postgresql_port() {
        let Some((redis, postgres)) = super::support::redis_url_at_the_postgresql_port() else {
            return;
        };
        for store in [redis.clone(), format!("tiered:{redis}|{postgres}")] {
            let serve = ["serve", "--listen", "127.0.0.1:0", "--store", &store];
            let err = super::exits(3, super::run(&[&serve[..], &["--migrate"]].concat()));
            assert!(
                err.contains("speaks PostgreSQL and this URL expects Redis: use postgres://"),
                "{store}: {err}"
            );
            assert!(!err.contains("unreachable at start"), "{store}: {err}");
        }
    }

    /// A fake AMQP broker on a free port: it answers any greeting with AMQP's protocol
    /// header, as RabbitMQ does.
    fn fake_amqp() -> u16 {
        fake_server(b"AMQP\x00\x00\x09\x01")
    }

    /// A server on a free port that answers any greeting with `reply` and closes.
    fn fake_server(reply: &'static [u8]) -> u16 {
        use std::io::{Read as _, Write as _};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for mut stream in listener.incoming().flatten() {
                let mut greeting = [0; 64];
                let _ = stream.read(&mut greeting);
                let _ = stream.write_all(reply);
            }
        });
        port
    }

    #[test]
    fn a_new_users_mistakes_are_named_with_their_fix() {
        // A host name in --listen is resolved (the store error comes next, not --listen's).
        let serve = ["serve", "--listen", "localhost:0", "--store", "x:"];
        let err = super::exits(2, super::run(&serve));
        assert!(!err.contains("--listen"), "{err}");

        // A PostgreSQL URL at a broker's port.
        let amqp = fake_amqp();
        let url = format!("postgres://postgres@127.0.0.1:{amqp}/test");
        let err = super::exits(3, super::run(&["stats", "--store", &url]));
        assert!(
            err.contains("speaks AMQP (RabbitMQ) and this URL expects PostgreSQL"),
            "{err}"
        );
        // A Redis URL there: the explanation alone, with no driver's parse error first.
        let url = format!("redis://127.0.0.1:{amqp}");
        for command in ["stats", "serve"] {
            let err = super::exits(3, super::run(&[command, "--store", &url]));
            assert!(
                err.contains("speaks AMQP (RabbitMQ) and this URL expects Redis"),
                "{command}: {err}"
            );
            assert!(
                !err.contains("Unexpected") && !err.contains("WARN"),
                "{err}"
            );
        }
        // A web server that answers a request without a version with a bare HTML page, as
        // Python's `http.server` does.
        let web = fake_server(b"<!DOCTYPE HTML>\n<html><body>Bad request</body></html>\n");
        let url = format!("redis://127.0.0.1:{web}");
        let err = super::exits(3, super::run(&["stats", "--store", &url]));
        assert!(
            err.contains("speaks HTTP and this URL expects Redis: that is a web server"),
            "{err}"
        );

        let Some(redis) = idem_testkit::harness::redis_url() else {
            return;
        };
        // The demo keys records by caller: a key looked up in the global scope says so.
        let err = super::exits(1, super::run(&["inspect", "order-1", "--store", &redis]));
        assert!(err.contains("--scope alice"), "{err}");

        // TLS asked of a plain-text Redis.
        let plain = redis.replacen("redis://", "rediss://", 1);
        let err = super::exits(3, super::run(&["stats", "--store", &plain]));
        assert!(err.contains("without TLS"), "{err}");
        assert!(err.contains("use redis://"), "{err}");
    }

    #[test]
    fn the_store_and_its_names_come_from_the_shared_variables() {
        let Some(redis) = idem_testkit::harness::redis_url() else {
            return;
        };
        let prefix = format!("ops-env-{}:", uuid::Uuid::new_v4().simple());
        let env = [("IDEM_STORE", redis.as_str()), ("IDEM_PREFIX", &prefix)];
        let doc = super::ok_json(super::run_with(&["stats", "--json"], &env));
        assert_eq!(doc["keys_read"], 0);
        let (_, help, _) = super::run(&["stats", "--help"]);
        for var in ["IDEM_STORE", "IDEM_PREFIX", "IDEM_SCHEMA"] {
            assert!(help.contains(var), "{help}");
        }
    }
}
