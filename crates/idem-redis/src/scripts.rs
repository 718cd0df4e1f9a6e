//! The Lua scripts of `lua/redis/`, loaded once per process.
//!
//! Each is sent as `EVALSHA`, and on `NOSCRIPT` loaded (`SCRIPT LOAD`) and sent again, so a
//! server that lost its script cache (a restart, a failover, `SCRIPT FLUSH`) is reloaded on
//! the fly. The command is built once, straight into a [`Cmd`] ([`evalsha`]), rather than
//! through redis-rs's `ScriptInvocation`, which copies every argument (the body included)
//! into a vector of its own and then again into the command it sends; the reload is the
//! same as its `invoke_async`.

use std::sync::LazyLock;

use idem_core::Error;
use redis::{Cmd, ErrorKind, Script, ServerErrorKind, Value};

use crate::connection::Conn;
use crate::error::classify;

/// How many times a script is loaded and sent again when the server's script cache is
/// flushed between the load and the next `EVALSHA`.
const RELOADS: usize = 3;

/// `EVALSHA <script's hash> 1 <key>`: the caller adds `args` arguments of about `bytes`
/// bytes in all (the command is sized for them, so it never grows).
pub(crate) fn evalsha(script: &Script, key: &str, args: usize, bytes: usize) -> Cmd {
    let mut cmd = Cmd::with_capacity(4 + args, 7 + 40 + 1 + key.len() + bytes);
    cmd.arg("EVALSHA").arg(script.get_hash()).arg(1).arg(key);
    cmd
}

/// Sends `cmd` (made by [`evalsha`] for `script`); on `NOSCRIPT`, loads the script and sends
/// it again, up to [`RELOADS`] times (a `SCRIPT FLUSH` or a failover may race the load).
pub(crate) async fn run(script: &Script, cmd: &Cmd, conn: &mut Conn) -> Result<Value, Error> {
    let mut reloads = 0;
    loop {
        let e = match cmd.query_async::<Value>(conn).await {
            Ok(answer) => return Ok(answer),
            Err(e) => e,
        };
        if !reloaded(script, &e, &mut reloads, conn).await? {
            return Err(classify(e));
        }
    }
}

/// Sends `pipe`, two commands in one round trip: an `EVALSHA` of `script` (made by
/// [`evalsha`]), then a plain command; with [`run`]'s handling of `NOSCRIPT`. The script's
/// answer and the command's.
pub(crate) async fn run_then(
    script: &Script,
    pipe: &redis::Pipeline,
    conn: &mut Conn,
) -> Result<(Value, Value), Error> {
    use redis::aio::ConnectionLike as _;
    let mut reloads = 0;
    loop {
        let mut replies = conn
            .req_packed_commands(pipe, 0, 2)
            .await
            .map_err(classify)?
            .into_iter();
        let (Some(answer), Some(after)) = (replies.next(), replies.next()) else {
            return Err(Error::backend(crate::STORE, "a reply is missing"));
        };
        // The script's answer decides; the command's, even an error, is the caller's to read.
        let e = match answer.extract_error() {
            Ok(answer) => return Ok((answer, after)),
            Err(e) => e,
        };
        if !reloaded(script, &e, &mut reloads, conn).await? {
            return Err(classify(e));
        }
    }
}

/// After `e`, an `EVALSHA`'s error: when it is `NOSCRIPT` and fewer than [`RELOADS`] loads
/// were made, loads the script and answers `true` (send it again); otherwise `false`.
async fn reloaded(
    script: &Script,
    e: &redis::RedisError,
    reloads: &mut usize,
    conn: &mut Conn,
) -> Result<bool, Error> {
    if e.kind() != ErrorKind::Server(ServerErrorKind::NoScript) || *reloads >= RELOADS {
        return Ok(false);
    }
    *reloads += 1;
    script.load_async(conn).await.map_err(classify)?;
    Ok(true)
}

/// `lua/redis/prelude.lua`: the lease check that `complete`, `release`, `extend` and
/// `apply` share, `carried` (what a completion takes over from the in-progress record), and
/// `wake`, which tells waiters.
const PRELUDE: &str = include_str!("../lua/prelude.lua");

/// Where a script wants the prelude, when not right after its shebang: a line of its own,
/// after a common path that needs none of the prelude's functions (so that the path does
/// not pay for making them).
const PRELUDE_HERE: &str = "\n--@prelude\n";

/// A script with the prelude placed after its shebang line (which must stay first: Redis
/// reads the script's flags from it), or at its [`PRELUDE_HERE`] line, for one server or,
/// `sharded`, for Redis Cluster: the prelude's `wake` reads `SHARDED` (defined right after
/// the shebang), so that each write counts one kind of subscriber only (a `redis.call`
/// costs about half a microsecond of the server's time).
pub(crate) fn with_prelude(source: &str, sharded: bool) -> String {
    let (shebang, body) = source.split_once('\n').unwrap_or((source, ""));
    match body.split_once(PRELUDE_HERE) {
        Some((before, after)) => {
            format!("{shebang}\nlocal SHARDED = {sharded}\n{before}\n{PRELUDE}{after}")
        }
        None => format!("{shebang}\nlocal SHARDED = {sharded}\n{PRELUDE}{body}"),
    }
}

/// A script with the prelude in its two forms (see [`with_prelude`]).
pub(crate) struct Variants {
    one: Script,
    sharded: Script,
}

impl Variants {
    fn new(source: &str) -> Self {
        Self {
            one: Script::new(&with_prelude(source, false)),
            sharded: Script::new(&with_prelude(source, true)),
        }
    }

    /// The form for a store on Redis Cluster (`cluster`) or on one server.
    pub(crate) fn on(&self, cluster: bool) -> &Script {
        if cluster {
            &self.sharded
        } else {
            &self.one
        }
    }
}

/// `lua/redis/begin.lua`.
pub(crate) static BEGIN: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/begin.lua")));
/// `lua/redis/complete.lua`, with the prelude.
pub(crate) static COMPLETE: LazyLock<Variants> =
    LazyLock::new(|| Variants::new(include_str!("../lua/complete.lua")));
/// `lua/redis/release.lua`, with the prelude.
pub(crate) static RELEASE: LazyLock<Variants> =
    LazyLock::new(|| Variants::new(include_str!("../lua/release.lua")));
/// `lua/redis/extend.lua`, with the prelude (it wakes nobody: one form serves both).
pub(crate) static EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(&with_prelude(include_str!("../lua/extend.lua"), false)));
/// `lua/redis/apply.lua`, with the prelude.
pub(crate) static APPLY: LazyLock<Variants> =
    LazyLock::new(|| Variants::new(include_str!("../lua/apply.lua")));
/// `lua/redis/get.lua`.
pub(crate) static GET: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/get.lua")));

/// A script as the store sends it to one server (`complete`, `release`, `extend` and
/// `apply` with the prelude), for tests that call it directly.
#[cfg(feature = "testing")]
pub(crate) fn source(name: &str) -> Option<String> {
    let raw = match name {
        "begin" => return Some(include_str!("../lua/begin.lua").to_owned()),
        "get" => return Some(include_str!("../lua/get.lua").to_owned()),
        "complete" => include_str!("../lua/complete.lua"),
        "release" => include_str!("../lua/release.lua"),
        "extend" => include_str!("../lua/extend.lua"),
        "apply" => include_str!("../lua/apply.lua"),
        _ => return None,
    };
    Some(with_prelude(raw, false))
}

#[cfg(test)]
mod tests {
    /// Every script declares itself with a shebang, so Redis 7 applies its flags: without
    /// `no-writes` a script counts as a writer and is refused under OOM before it runs.
    #[test]
    fn scripts_open_with_shebang_and_contract() {
        for (name, source) in [
            ("begin", include_str!("../lua/begin.lua")),
            ("complete", include_str!("../lua/complete.lua")),
            ("release", include_str!("../lua/release.lua")),
            ("extend", include_str!("../lua/extend.lua")),
            ("get", include_str!("../lua/get.lua")),
            ("apply", include_str!("../lua/apply.lua")),
        ] {
            let mut lines = source.lines();
            assert!(lines.next().unwrap().starts_with("#!lua"), "{name}");
            for part in ["KEYS[1]", "Returns"] {
                assert!(source.contains(part), "{name} does not document {part}");
            }
            // Keys are never built inside a script: only KEYS[1] is ever touched.
            assert!(!source.contains("KEYS[2]"), "{name}");
        }
        // The shared lease check goes after the shebang, never before it.
        let assembled = super::with_prelude(include_str!("../lua/complete.lua"), true);
        assert!(assembled.starts_with("#!lua"));
        assert!(assembled.contains("local function lease_head"));
        assert!(!include_str!("../lua/prelude.lua").contains("#!lua"));
        // complete.lua's common path comes before the prelude, which replaces its marker.
        let prelude_at = assembled.find("local function lease_head").unwrap();
        assert!(assembled.find("local written").unwrap() < prelude_at);
        assert!(!assembled.contains(super::PRELUDE_HERE));
        for source in [
            include_str!("../lua/release.lua"),
            include_str!("../lua/extend.lua"),
            include_str!("../lua/apply.lua"),
        ] {
            // The others have it right after the shebang.
            let assembled = super::with_prelude(source, false);
            let after_shebang = assembled.split_once('\n').unwrap().1;
            let expected = format!("local SHARDED = false\n{}", super::PRELUDE);
            assert!(after_shebang.starts_with(&expected));
        }
    }
}
