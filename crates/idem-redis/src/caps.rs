//! What the servers can do: whether every primary has the compare-and-set commands, read
//! from the name and version in its `INFO server`.

use idem_core::Error;

use crate::config::Scripting;
use crate::STORE;

/// How the store makes its fenced transitions: Lua scripts, or plain commands (`SET ..
/// IFEQ`, and a release of the kind named).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Path {
    /// Lua scripts.
    Scripts = 1,
    /// `DELIFEQ key value` (Valkey 9.0+).
    DelIfEq,
    /// `DELEX key IFEQ value` (Redis 8.4+).
    DelEx,
    /// `SET key <released> IFEQ value PX 1`: a one-byte value that lives a millisecond and
    /// reads as absent (Valkey 8.1, or primaries of both kinds).
    SetReleased,
}

impl Path {
    /// The path stored as `path as u8` in the store's atomic; `None` for 0 ("not read yet").
    pub(crate) fn from_u8(n: u8) -> Option<Self> {
        let all = [Self::Scripts, Self::DelIfEq, Self::DelEx, Self::SetReleased];
        all.into_iter().find(|path| *path as u8 == n)
    }
}

/// A server's kind and version, from its `INFO server`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Server {
    valkey: bool,
    version: (u32, u32, u32),
}

impl Server {
    /// Reads `server_name` and `valkey_version` (Valkey, which reports an older
    /// `redis_version` for compatibility) or `redis_version`.
    pub(crate) fn parse(info: &str) -> Option<Self> {
        let field = |name: &str| {
            info.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        let valkey = field("server_name") == Some("valkey");
        let text = if valkey {
            field("valkey_version")?
        } else {
            field("redis_version")?
        };
        let mut parts = text.split('.').map(|p| p.parse::<u32>().ok());
        let mut next = || parts.next().flatten();
        Some(Self {
            valkey,
            version: (next()?, next().unwrap_or(0), next().unwrap_or(0)),
        })
    }

    /// The path of this server's commands; `None` when it lacks `SET .. IFEQ`.
    fn commands(self) -> Option<Path> {
        let (major, minor, _) = self.version;
        match (self.valkey, major, minor) {
            (true, 9.., _) => Some(Path::DelIfEq),
            (true, 8, 1..) => Some(Path::SetReleased),
            (false, 9.., _) | (false, 8, 4..) => Some(Path::DelEx),
            _ => None,
        }
    }
}

impl std::fmt::Display for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (major, minor, patch) = self.version;
        let name = if self.valkey { "valkey" } else { "redis" };
        write!(f, "{name} {major}.{minor}.{patch}")
    }
}

/// The path for primaries `servers` (`None` when one did not say what it is) under
/// `scripting`.
///
/// # Errors
///
/// [`Error::Backend`] with [`Scripting::NoScripts`] when a primary lacks the commands.
pub(crate) fn choose(servers: Option<&[Server]>, scripting: Scripting) -> Result<Path, Error> {
    let commands: Option<Vec<Path>> =
        servers.and_then(|all| all.iter().map(|s| s.commands()).collect());
    let path = match commands.as_deref() {
        _ if scripting == Scripting::Scripts => Path::Scripts,
        Some([first, rest @ ..]) if rest.iter().all(|path| path == first) => *first,
        // Primaries of different kinds share SET .. IFEQ alone.
        Some([_, ..]) => Path::SetReleased,
        _ => Path::Scripts,
    };
    if path == Path::Scripts && scripting == Scripting::NoScripts {
        let found = match servers {
            Some(all) => all
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            None => "a server that does not report its name and version (INFO server)".into(),
        };
        return Err(Error::backend(
            STORE,
            format!(
                "Scripting::NoScripts needs the compare-and-set commands on every primary, \
                 which Valkey 8.1 or newer (SET IFEQ; DELIFEQ from 9.0) or Redis 8.4 or newer \
                 (SET IFEQ and DELEX) have; found {found}: upgrade the servers, or allow Lua \
                 scripts with Scripting::Auto"
            ),
        ));
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(info: &str) -> Server {
        Server::parse(info).unwrap()
    }

    #[test]
    fn versions_choose_the_path() {
        let valkey91 = server(
            "# Server\r\nredis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:9.1.2\r\n",
        );
        let valkey81 = server("server_name:valkey\nvalkey_version:8.1.0\n");
        let valkey80 = server("server_name:valkey\nvalkey_version:8.0.2\n");
        let redis70 = server("redis_version:7.0.15\n");
        let redis84 = server("redis_version:8.4.0\n");
        assert_eq!(valkey91.to_string(), "valkey 9.1.2");
        use Scripting::{Auto, Scripts};
        for (servers, scripting, path) in [
            (&[valkey91][..], Auto, Path::DelIfEq),
            (&[valkey81], Auto, Path::SetReleased),
            (&[redis84], Auto, Path::DelEx),
            (&[valkey80], Auto, Path::Scripts),
            (&[redis70], Auto, Path::Scripts),
            (&[valkey91, valkey91], Auto, Path::DelIfEq),
            (&[valkey91, redis84], Auto, Path::SetReleased),
            (&[valkey91, redis70], Auto, Path::Scripts),
            (&[valkey91], Scripts, Path::Scripts),
        ] {
            let chosen = choose(Some(servers), scripting).unwrap();
            assert_eq!(chosen, path, "{servers:?} {scripting:?}");
        }
        assert_eq!(choose(None, Auto).unwrap(), Path::Scripts);
        let Err(Error::Backend { source, .. }) =
            choose(Some(&[valkey91, redis70]), Scripting::NoScripts)
        else {
            panic!("a Redis 7.0 primary accepted without scripts");
        };
        let message = source.to_string();
        assert!(message.contains("redis 7.0.15"), "{message}");
        assert!(
            message.contains("Valkey 8.1") && message.contains("Redis 8.4"),
            "{message}"
        );
        for path in [Path::Scripts, Path::DelIfEq, Path::DelEx, Path::SetReleased] {
            assert_eq!(Path::from_u8(path as u8), Some(path));
        }
        assert_eq!(Path::from_u8(0), None);
    }
}
