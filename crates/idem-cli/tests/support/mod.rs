//! What the tests of the `idem` binary share: `idem` run to its end, a child process killed
//! when dropped, and an HTTP client that reads whole replies.
#![allow(dead_code)] // each test file uses a part

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::StatusCode;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use idem_testkit::postgres::PgServer;
use idem_testkit::redis::RedisServer;
use idem_testkit::tls::Pki;

pub const BIN: &str = env!("CARGO_BIN_EXE_idem");

/// A `redis-server` with a TLS port and a PostgreSQL with `ssl=on`, with certificates of
/// `pki`; both stopped when dropped. `None` (the test returns) when either cannot be run.
pub struct TlsServers {
    pub pki: Pki,
    _redis: RedisServer,
    redis_tls_port: u16,
    postgres: PgServer,
}

impl TlsServers {
    pub fn start() -> Option<Self> {
        if !idem_testkit::redis::available() || !idem_testkit::postgres::available() {
            return None;
        }
        let pki = Pki::new();
        let (redis, redis_tls_port) =
            RedisServer::start_tls_with(&pki).expect("start redis-server with TLS");
        let postgres = PgServer::start_tls(&pki).expect("start PostgreSQL with ssl=on");
        Some(Self {
            pki,
            _redis: redis,
            redis_tls_port,
            postgres,
        })
    }

    /// The tiered store of both over TLS with certificate verification on, Redis trusting
    /// the authority file `redis_ca`, PostgreSQL `pg_ca`.
    pub fn tiered_url(&self, redis_ca: &str, pg_ca: &str) -> String {
        format!(
            "tiered:rediss://localhost:{}/?tls_ca_file={redis_ca}|\
             postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert={pg_ca}",
            self.redis_tls_port,
            self.postgres.port()
        )
    }
}

/// `tests/upstream.py`, the upstream of the `idem proxy` tests, on `port` (0: a free one),
/// answering as `version` (`HTTP/1.1` or `HTTP/1.0`); its base URL is `Proc::printed`.
pub fn upstream_py(port: u16, version: &str) -> Proc {
    python_service("upstream.py", &[&port.to_string(), version])
}

/// `tests/handler.py`, the message handler of the `idem consume` tests, on `port` (0: a
/// free one); its base URL is `Proc::printed`.
pub fn handler_py(port: u16) -> Proc {
    python_service("handler.py", &[&port.to_string()])
}

/// One of the Python test services (`counting.py`'s), started with `args`, once it says
/// it listens.
fn python_service(script: &str, args: &[&str]) -> Proc {
    let mut command = Command::new("python3");
    let script = format!("{}/tests/{script}", env!("CARGO_MANIFEST_DIR"));
    command.arg(script).args(args);
    let mut proc = Proc::spawn(command, "listening on");
    let port = proc.printed.rsplit(' ').next().unwrap().trim().to_owned();
    proc.printed = format!("http://127.0.0.1:{port}");
    proc
}

/// `npm ci` in `example` (a directory of `examples/`, from its committed lock file), once
/// for all the tests of the binary, which installs one example: a second `npm ci` would
/// empty `node_modules` under a server started from it. `false` (or a failure with
/// `IDEM_TEST_REQUIRE_BACKENDS=1`) when node or npm is missing.
pub fn npm_ci_once(example: &'static str) -> bool {
    static INSTALLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *INSTALLED.get_or_init(|| npm_ci(example))
}

fn npm_ci(example: &str) -> bool {
    let found = |tool: &str| {
        let version = Command::new(tool).arg("--version").output();
        version.is_ok_and(|out| out.status.success())
    };
    if !idem_testkit::harness::present(
        found("node") && found("npm"),
        "Node.js 18+ with npm (`apt-get install nodejs npm`, or https://nodejs.org)",
    ) {
        return false;
    }
    // npm's complaints go to the test's own stderr.
    let ci = ["ci", "--no-audit", "--no-fund", "--ignore-scripts"];
    let npm = Command::new("npm").args(ci).current_dir(example).status();
    assert!(npm.expect("run npm ci").success(), "npm ci in {example}");
    true
}

/// `text` in a file named `name` in a directory of its own (named after `prefix`) under the
/// system's temporary directory.
pub fn temp_file(prefix: &str, name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(idem_testkit::harness::unique_name(prefix));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// `POST <proxy>/charge` as alice with `key` and `body`, the upstream (`upstream.py`) taking
/// `work` (its `x-delay-ms`).
pub fn charge(proxy: &str, key: &str, work: Duration, body: &str) -> Request {
    let delay = work.as_millis().to_string();
    let headers = [
        ("authorization", "Bearer alice"),
        ("idempotency-key", key),
        ("content-type", "application/json"),
        ("x-delay-ms", delay.as_str()),
    ];
    request("POST", &format!("{proxy}/charge"), &headers, body)
}

/// How many times `key` ran in the test service at `base` (`upstream.py`, `handler.py`: their
/// `GET /count?key=`), with which `Idempotency-Attempt`s, and the headers of its last run.
pub async fn runs(
    client: &HttpClient,
    base: &str,
    key: &str,
) -> (u64, Vec<String>, serde_json::Value) {
    let url = format!("{base}/count?key={key}");
    let doc = call(client, "GET", &url, &[], "").await.json();
    let attempts = doc["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap_or("").to_owned())
        .collect();
    (doc["runs"].as_u64().unwrap(), attempts, doc["last"].clone())
}

/// `IDEM_TEST_DATABASE_URL` and a `redis://` URL at its port, where PostgreSQL answers
/// instead of Redis; `None` (the test returns) when the variable is not set.
pub fn redis_url_at_the_postgresql_port() -> Option<(String, String)> {
    let postgres = idem_testkit::harness::database_url()?;
    let port = postgres.rsplit(':').next()?.split('/').next()?.to_owned();
    Some((format!("redis://127.0.0.1:{port}"), postgres))
}

/// Whether the PostgreSQL database at `url` has the schema `schema`.
pub async fn schema_exists(url: &str, schema: &str) -> bool {
    let pool = sqlx::PgPool::connect(url).await.unwrap();
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
        .bind(schema)
        .fetch_one(&pool)
        .await
        .unwrap()
}

/// The outbox rows in the schema of `pg`, of `key` only when given.
pub async fn outbox_rows(pg: &idemkit::postgres::PgStore, key: Option<&str>) -> i64 {
    let table = format!("{}.outbox", pg.quoted_schema());
    let sql = format!("SELECT count(*) FROM {table} WHERE $1::text IS NULL OR key = $1");
    sqlx::query_scalar(&sql)
        .bind(key)
        .fetch_one(pg.pool())
        .await
        .unwrap()
}

pub fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

pub fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// `idem <args>`, without the `IDEM_STORE`, `IDEM_PREFIX` and `IDEM_SCHEMA` of the
/// environment the tests run in.
pub fn idem(args: &[&str]) -> Command {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env_remove("IDEM_STORE")
        .env_remove("IDEM_PREFIX")
        .env_remove("IDEM_SCHEMA");
    command
}

/// `idem <args>` to its end: its exit code, stdout and stderr.
pub fn run(args: &[&str]) -> (i32, String, String) {
    run_with(args, &[])
}

/// `idem <args> <common>` to its end, for a test whose commands all take the same
/// `--store` and naming flags.
pub fn run_on<'a, const N: usize>(
    common: [&'a str; N],
) -> impl Fn(&[&str]) -> (i32, String, String) + 'a {
    move |args| run(&[args, &common[..]].concat())
}

/// `idem <args>` with the variables `env` to its end. A command still running after two
/// minutes (a `serve` that should have refused to start, a hung command) is killed and
/// reported with the code -1, so the test fails instead of hanging.
pub fn run_with(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut child = idem(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read both pipes while the command runs, so a long output never blocks it.
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            let _ = pipe.read_to_end(&mut text);
            String::from_utf8_lossy(&text).into_owned()
        })
    };
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let status = child.wait().unwrap();
    (
        status.code().unwrap_or(-1),
        stdout.join().unwrap(),
        stderr.join().unwrap(),
    )
}

/// The JSON document of `text`: stdout, or the last line of stderr (the error after the
/// log lines, all JSON with `--json`).
#[track_caller]
pub fn json(text: &str) -> serde_json::Value {
    let text = text.trim().lines().last().unwrap_or_default();
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"))
}

/// Asserts that each field of the JSON object `want` has that value in `doc` (a field
/// `doc` lacks is `null`).
#[track_caller]
pub fn assert_fields(doc: &serde_json::Value, want: serde_json::Value) {
    for (field, value) in want.as_object().expect("a JSON object") {
        assert_eq!(&doc[field], value, "{field} in {doc}");
    }
}

/// The stderr of a [`run`] that must exit with `code`.
#[track_caller]
pub fn exits(code: i32, (got, _, err): (i32, String, String)) -> String {
    assert_eq!(got, code, "{err}");
    err
}

/// The stdout of a [`run`] that must exit 0.
#[track_caller]
pub fn ok((code, out, err): (i32, String, String)) -> String {
    assert_eq!(code, 0, "{err}");
    out
}

/// The JSON stdout of a [`run`] that must exit 0.
#[track_caller]
pub fn ok_json(result: (i32, String, String)) -> serde_json::Value {
    json(&ok(result))
}

/// Sends `signal` (`TERM`, `STOP`, `CONT`) to `pid`.
pub fn signal(pid: u32, signal: &str) {
    let sent = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .is_ok_and(|s| s.success());
    assert!(sent, "kill -{signal} {pid} failed");
}

/// A child process, killed (SIGKILL) and reaped when dropped.
pub struct Proc {
    child: Option<Child>,
    /// The line it printed that [`Proc::spawn`] waited for, or the URL in it.
    pub printed: String,
}

impl Proc {
    /// Spawns `command` and waits for a line of its stdout holding `marker`.
    pub fn spawn(mut command: Command, marker: &str) -> Proc {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {command:?}: {e}"));
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let marker = marker.to_owned();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            while let Some(Ok(line)) = lines.next() {
                if line.contains(&marker) {
                    let _ = tx.send(line);
                    break;
                }
            }
            // Keep reading, so that the child never blocks on a full pipe.
            for _ in lines {}
        });
        let mut proc = Proc {
            child: Some(child),
            printed: String::new(),
        };
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(line) => proc.printed = line,
            // It stopped (say, the store could not be opened) or hangs: show why.
            Err(_) => panic!("{command:?} did not start; stderr: {}", proc.stop()),
        }
        proc
    }

    /// Spawns `command`, a server that prints `listening on http://...`; `printed` is
    /// that URL.
    pub fn listening(command: Command) -> Proc {
        let mut proc = Proc::spawn(command, "listening on http://");
        let url = proc
            .printed
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap()
            .trim_end_matches(',')
            .to_owned();
        proc.printed = url;
        proc
    }

    /// SIGKILL, as a crash (no shutdown code runs), then what it wrote on stderr.
    pub fn stop(&mut self) -> String {
        let mut child = self.child.take().expect("running");
        let _ = child.kill();
        let out = child.wait_with_output().unwrap();
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    /// SIGTERM, then its exit status (within 30 s).
    pub fn terminate(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("running");
        signal(child.id(), "TERM");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "no exit 30 s after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A reply, read whole.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| panic!("not JSON: {self:?}"))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// The problem type of an `application/problem+json` reply.
    pub fn problem_type(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        self.json()["type"].as_str().unwrap().to_owned()
    }
}

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub type Request = hyper::Request<Full<Bytes>>;

/// A client for the tests' requests.
pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// The request `method url` with `headers` and `body`.
pub fn request(method: &str, url: &str, headers: &[(&str, &str)], body: &str) -> Request {
    let mut req = hyper::Request::builder().method(method).uri(url);
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    req.body(Full::new(Bytes::from(body.to_owned()))).unwrap()
}

/// Sends `req`, for a request whose connection may break: the error as text then.
pub async fn send(client: &HttpClient, req: Request) -> Result<Reply, String> {
    let response = client.request(req).await.map_err(|e| e.to_string())?;
    let (parts, body) = response.into_parts();
    Ok(Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.map_err(|e| e.to_string())?.to_bytes(),
    })
}

/// The [`request`] sent, and its reply; the test fails if the connection breaks.
pub async fn call(
    client: &HttpClient,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    send(client, request(method, url, headers, body))
        .await
        .unwrap()
}

/// For each store named, a module of that name with a `#[tokio::test]` per case, each
/// running `case("<store>")` of the module the macro is called in, so that `cargo test
/// redis` runs one store's: `on_stores!([redis, postgres], [case_a, case_b]);`.
#[allow(unused_macros)] // as the module's functions: each test file uses a part
macro_rules! on_stores {
    ([$($store:ident),* $(,)?], $cases:tt) => {
        $($crate::support::on_stores!(@store $store, $cases);)*
    };
    (@store $store:ident, [$($case:ident),* $(,)?]) => {
        mod $store {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(stringify!($store)).await;
                }
            )*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use on_stores;
