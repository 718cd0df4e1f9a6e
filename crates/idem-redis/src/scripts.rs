//! The Lua scripts of `lua/redis/`, loaded once per process.
//!
//! Each is called through [`redis::Script`]'s invocation (`EVALSHA`, and on `NOSCRIPT` a
//! `SCRIPT LOAD` and a second try), so a server that lost its script cache (a restart, a
//! failover, `SCRIPT FLUSH`) is reloaded on the fly.

use std::sync::LazyLock;

use idem_core::Error;
use redis::{ErrorKind, Script, ScriptInvocation, ServerErrorKind, Value};

use crate::connection::Conn;
use crate::error::classify;

/// How many times a script is sent again when the server's script cache is flushed between
/// redis-rs's reload and its second `EVALSHA`.
const RELOADS: usize = 3;

/// Runs a script: `EVALSHA`, and on `NOSCRIPT` a `SCRIPT LOAD` and `EVALSHA` again
/// (redis-rs's invocation); if the cache was emptied once more in between (a `SCRIPT FLUSH`
/// or a failover racing the reload), the whole invocation is repeated a few times.
pub(crate) async fn invoke(
    invocation: &ScriptInvocation<'_>,
    conn: &mut Conn,
) -> Result<Value, Error> {
    let mut reloads = 0;
    loop {
        match invocation.invoke_async(conn).await {
            Err(e)
                if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
                    && reloads < RELOADS =>
            {
                reloads += 1;
            }
            result => return result.map_err(classify),
        }
    }
}

/// `lua/redis/prelude.lua`: the lease check that `complete`, `release`, `extend` and
/// `apply` share.
const PRELUDE: &str = include_str!("../lua/prelude.lua");

/// A script with the prelude placed after its shebang line (which must stay first: Redis
/// reads the script's flags from it).
pub(crate) fn with_prelude(source: &str) -> String {
    let (shebang, body) = source.split_once('\n').unwrap_or((source, ""));
    format!("{shebang}\n{PRELUDE}{body}")
}

/// `lua/redis/begin.lua`.
pub(crate) static BEGIN: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/begin.lua")));
/// `lua/redis/complete.lua`, with the prelude.
pub(crate) static COMPLETE: LazyLock<Script> =
    LazyLock::new(|| Script::new(&with_prelude(include_str!("../lua/complete.lua"))));
/// `lua/redis/release.lua`, with the prelude.
pub(crate) static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(&with_prelude(include_str!("../lua/release.lua"))));
/// `lua/redis/extend.lua`, with the prelude.
pub(crate) static EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(&with_prelude(include_str!("../lua/extend.lua"))));
/// `lua/redis/apply.lua`, with the prelude.
pub(crate) static APPLY: LazyLock<Script> =
    LazyLock::new(|| Script::new(&with_prelude(include_str!("../lua/apply.lua"))));
/// `lua/redis/get.lua`.
pub(crate) static GET: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/get.lua")));

/// A script as the store sends it (`complete`, `release`, `extend` and `apply` with the
/// prelude), for tests that call it directly.
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
    Some(with_prelude(raw))
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
        let assembled = super::with_prelude(include_str!("../lua/complete.lua"));
        assert!(assembled.starts_with("#!lua"));
        assert!(assembled.contains("local function lease_head"));
        assert!(!include_str!("../lua/prelude.lua").contains("#!lua"));
    }
}
