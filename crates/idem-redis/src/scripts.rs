//! The Lua scripts of `lua/`, loaded once per process.
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

/// `lua/begin.lua`.
pub(crate) static BEGIN: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/begin.lua")));
/// `lua/complete.lua`.
pub(crate) static COMPLETE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/complete.lua")));
/// `lua/release.lua`.
pub(crate) static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/release.lua")));
/// `lua/extend.lua`.
pub(crate) static EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/extend.lua")));
/// `lua/apply.lua`.
pub(crate) static APPLY: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/apply.lua")));
/// `lua/get.lua`.
pub(crate) static GET: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/get.lua")));

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
    }
}
