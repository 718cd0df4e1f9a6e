//! The Lua scripts of `lua/redis/`, for servers without the compare-and-set commands
//! ([`crate::Scripting`]): each loaded once per process as a [`Script`] and sent through
//! its `invoke_async` (`EVALSHA`, loaded again on `NOSCRIPT` after a restart, a failover or
//! `SCRIPT FLUSH`).

use std::sync::LazyLock;

use redis::Script;

/// `lua/redis/set_if.lua`: `SET .. IFEQ .. GET`, waking the record's waiters.
pub(crate) static SET_IF: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/set_if.lua")));
/// `lua/redis/end_if.lua`: a compare-and-delete or compare-and-expire.
pub(crate) static END_IF: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../lua/end_if.lua")));

#[cfg(test)]
mod tests {
    /// Every script declares itself with a shebang, so Redis 7 applies its flags (without
    /// `allow-oom` a script counts as a writer and is refused under OOM before it runs), and
    /// opens with its contract; it touches no key but `KEYS[1]`.
    #[test]
    fn scripts_open_with_shebang_and_contract() {
        for source in [
            include_str!("../lua/set_if.lua"),
            include_str!("../lua/end_if.lua"),
        ] {
            assert!(source.starts_with("#!lua"));
            for part in ["KEYS[1]", "ARGV[1]", "Returns"] {
                assert!(source.contains(part), "{source} does not document {part}");
            }
            assert!(!source.contains("KEYS[2]"));
        }
    }
}
