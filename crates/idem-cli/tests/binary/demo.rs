//! The payments demo `idem serve` runs, as a client sees it.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_serve_runs_the_payments_demo_and_stops_on_sigterm() {
    let mut served = serve("memory", &[]);
    let client = client();
    let payments = format!("{}/payments", served.printed);
    let alice = "Bearer alice";
    let order = r#"{"amount": 1250, "currency": "EUR"}"#;

    // The three-call tour: first call, replay, mismatch.
    let order_1 = payment(alice, "order-1", &[]);
    let first = call(&client, "POST", &payments, &order_1, order).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let payment_json = first.json();
    assert_eq!(payment_json["amount"], 1250);
    assert_eq!(payment_json["currency"], "EUR");
    let id = payment_json["id"].as_str().unwrap().to_owned();
    assert_eq!(first.headers["location"], format!("/payments/{id}"));

    let replay = call(&client, "POST", &payments, &order_1, order).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert!(replay.headers.contains_key("idempotency-expires"));
    assert_eq!(replay.body, first.body);

    let other = r#"{"amount": 9999, "currency": "EUR"}"#;
    let mismatch = call(&client, "POST", &payments, &order_1, other).await;
    assert_eq!(mismatch.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(mismatch.headers["content-type"], "application/problem+json");

    // A race: eight identical slow requests, one payment.
    let race = race(&client, &[&served], alice, "race-1", 8).await;
    let count = |status: StatusCode| race.iter().filter(|r| r.status == status).count();
    let (created, conflicts) = (count(StatusCode::CREATED), count(StatusCode::CONFLICT));
    assert!(created > 0 && created + conflicts == race.len(), "{race:?}");

    // Refusals.
    let json = ("content-type", "application/json");
    let no_key = [("authorization", alice), json];
    let no_key = call(&client, "POST", &payments, &no_key, order).await;
    assert_eq!(no_key.status, StatusCode::BAD_REQUEST);
    let negative = r#"{"amount": -1, "currency": "EUR"}"#;
    let bad_1 = payment(alice, "bad-1", &[]);
    let invalid = call(&client, "POST", &payments, &bad_1, negative).await;
    assert_eq!(invalid.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(invalid.json()["type"], "urn:idem:demo:invalid-payment");
    let anonymous = [json, ("idempotency-key", "anon-1")];
    let anonymous = call(&client, "POST", &payments, &anonymous, order).await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        anonymous.problem_type(),
        "urn:idem:problem:principal-missing"
    );

    // The side effect ran once per key: two payments for alice, none for bob.
    assert_eq!(list(&client, &served, alice).await["count"], 2);
    let one = format!("{payments}/{id}");
    let alices = call(&client, "GET", &one, &[("authorization", alice)], "").await;
    assert_eq!(alices.json()["id"], id.as_str());
    assert_eq!(list(&client, &served, "Bearer bob").await["count"], 0);
    let bob = ("authorization", "Bearer bob");
    let not_bobs = call(&client, "GET", &one, &[bob], "").await;
    assert_eq!(not_bobs.status, StatusCode::NOT_FOUND);

    let metrics = format!("{}/metrics", served.printed);
    let metrics = call(&client, "GET", &metrics, &[], "").await;
    let text = String::from_utf8(metrics.body.to_vec()).unwrap();
    let metric = |outcome: &str| -> u64 {
        let prefix = format!("idem_http_requests_total{{outcome=\"{outcome}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("no {outcome} in {text}"))
            .parse()
            .unwrap()
    };
    // executed: order-1, race-1 and bad-1 (a stored 422); anon-1 was refused before the
    // handler, as was the request without a key.
    assert_eq!(metric("executed"), 3, "{text}");
    assert_eq!(
        metric("replayed") as usize,
        1 + (8 - 1 - conflicts),
        "{text}"
    );
    assert_eq!(metric("in_flight") as usize, conflicts, "{text}");
    assert_eq!(metric("mismatch"), 1, "{text}");
    assert_eq!(metric("rejected"), 2, "{text}");
    assert!(
        text.contains("idem_demo_payments_created_total 2"),
        "{text}"
    );

    // SIGTERM: a clean stop.
    let exit = tokio::task::spawn_blocking(move || served.terminate())
        .await
        .unwrap();
    assert!(exit.success(), "exit status {exit}");
}

mod memory {
    //! `idem serve` on the memory store: what the demo stores under a key.

    /// Refusals that are not final for the request are not stored: a bad demo header (not
    /// part of the fingerprint) and a method the path does not take; the 405 is
    /// problem+json like every other refusal.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_demo_stores_only_what_is_final_for_the_request() {
        let served = super::serve("memory", &[]);
        let client = super::client();
        let (_, auth) = super::payer("final");
        let url = format!("{}/payments", served.printed);
        let order = r#"{"amount": 300, "currency": "EUR"}"#;

        let bad = super::payment(&auth, "order-1", &[("x-demo-delay-ms", "soon")]);
        let refused = super::call(&client, "POST", &url, &bad, order).await;
        assert_eq!(refused.status, 400, "{:?}", refused.body);
        assert_eq!(refused.headers["content-type"], "application/problem+json");
        // The header fixed: the payment runs, rather than the 400 being replayed.
        let paid = super::pay(&client, &served, &auth, "order-1", order).await;
        assert_eq!(paid.status, 201, "{:?}", paid.body);
        assert!(!paid.replayed());

        let one = format!("{url}/pay_0000000000000000");
        let patch = super::payment(&auth, "order-2", &[]);
        let not_allowed = super::call(&client, "PATCH", &one, &patch, order).await;
        assert_eq!(not_allowed.status, 405);
        let problem = Some("application/problem+json");
        assert_eq!(not_allowed.header("content-type"), problem);
        assert!(not_allowed.headers.contains_key("allow"));
        assert_eq!(not_allowed.json()["status"], 405);
        // The same key on the right route runs: no 405 was stored under it (that would
        // answer 422, another request under the same key).
        let paid = super::call(&client, "POST", &url, &patch, order).await;
        assert_eq!(paid.status, 201, "{:?}", paid.body);
        assert_eq!(super::list(&client, &served, &auth).await["count"], 2);
    }
}
