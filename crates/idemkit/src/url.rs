//! Store URLs: [`StoreUrl`] names a backend (parsed once, for [`crate::open`], the `idem`
//! binary and the bench), and its `Display` never shows a password. A new backend adds its
//! scheme here, in the facade: the core names no backend.

use std::fmt;

use idem_core::Error;

/// A store URL: which backend, and its connection URL(s). Parsing checks the scheme only;
/// each backend checks the rest when it connects. `Display` hides passwords.
///
/// ```
/// use idemkit::url::StoreUrl;
///
/// let url = StoreUrl::parse("tiered:redis://:secret@cache:6379|postgres://app@db/app")?;
/// assert_eq!(url.to_string(), "tiered:redis://:***@cache:6379|postgres://app@db/app");
/// assert_eq!(url.tiered(), Some(("redis://:secret@cache:6379", "postgres://app@db/app")));
/// assert!(StoreUrl::parse("mysql://db").is_err());
/// # Ok::<(), idemkit::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreUrl {
    /// `memory`: the in-memory store of this process.
    Memory,
    /// `redis://`, `rediss://`, `unix://` (one server), `redis+cluster://`,
    /// `rediss+cluster://` (Redis Cluster).
    Redis(String),
    /// `postgres://` or `postgresql://`.
    Postgres(String),
    /// `tiered:<redis URL>|<postgres URL>`: Redis first, PostgreSQL the arbiter.
    Tiered {
        /// The Redis half.
        redis: String,
        /// The PostgreSQL half.
        postgres: String,
    },
}

/// What [`StoreUrl::parse`] takes, for error messages and `--help`.
pub const SCHEMES: &str = "memory, redis://HOST:PORT, rediss://HOST:PORT, \
    redis+cluster://HOST:PORT[,HOST:PORT...], rediss+cluster://..., postgres://USER@HOST/DB \
    or tiered:REDIS_URL|POSTGRES_URL";

impl StoreUrl {
    /// Reads a store URL.
    ///
    /// # Errors
    ///
    /// [`Error::Invalid`] (without the URL's password) for an unknown scheme or a tiered URL
    /// without both halves.
    pub fn parse(url: &str) -> Result<Self, Error> {
        let url = url.trim();
        if let Some(rest) = url
            .get(.."tiered:".len())
            .filter(|head| head.eq_ignore_ascii_case("tiered:"))
            .map(|_| &url["tiered:".len()..])
        {
            let (redis, postgres) = rest.split_once('|').ok_or_else(|| {
                Error::Invalid(format!(
                    "{}: a tiered store URL is tiered:<redis URL>|<postgres URL>",
                    redact(url)
                ))
            })?;
            let halves = (Self::parse(redis)?, Self::parse(postgres)?);
            return match halves {
                (Self::Redis(redis), Self::Postgres(postgres)) => {
                    Ok(Self::Tiered { redis, postgres })
                }
                _ => Err(Error::Invalid(format!(
                    "{}: a tiered store URL is tiered:<redis URL>|<postgres URL>",
                    redact(url)
                ))),
            };
        }
        let scheme = url.split_once("://").map_or(url, |(scheme, _)| scheme);
        match scheme.to_ascii_lowercase().as_str() {
            "memory" | "memory:" | "mem" => Ok(Self::Memory),
            "redis" | "rediss" | "unix" | "redis+cluster" | "rediss+cluster" => {
                Ok(Self::Redis(url.to_owned()))
            }
            "postgres" | "postgresql" => Ok(Self::Postgres(url.to_owned())),
            _ => Err(Error::Invalid(format!(
                "unknown store {:?}: use {SCHEMES}",
                redact(url)
            ))),
        }
    }

    /// The URL as given (with its password): what a backend connects with.
    pub fn as_str(&self) -> String {
        match self {
            Self::Memory => "memory".to_owned(),
            Self::Redis(url) | Self::Postgres(url) => url.clone(),
            Self::Tiered { redis, postgres } => format!("tiered:{redis}|{postgres}"),
        }
    }

    /// The Redis and PostgreSQL halves of a tiered URL.
    pub fn tiered(&self) -> Option<(&str, &str)> {
        match self {
            Self::Tiered { redis, postgres } => Some((redis, postgres)),
            _ => None,
        }
    }

    /// `text` (an error a driver wrote) with every password of this URL replaced by `***`.
    pub fn scrub(&self, text: &str) -> String {
        scrub(text, &self.as_str())
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(&self.as_str()))
    }
}

impl fmt::Debug for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StoreUrl({self})")
    }
}

impl std::str::FromStr for StoreUrl {
    type Err = Error;

    fn from_str(url: &str) -> Result<Self, Error> {
        Self::parse(url)
    }
}

/// The parts of `scheme://userinfo@host/path`, when it has a userinfo.
fn userinfo(url: &str) -> Option<(&str, &str, &str, &str)> {
    let (scheme, rest) = url.split_once("://")?;
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(authority_end);
    let (userinfo, host) = authority.rsplit_once('@')?;
    Some((scheme, userinfo, host, path))
}

/// The URLs a store URL holds: both halves of `tiered:<redis>|<postgres>`, else itself.
fn parts(url: &str) -> Vec<&str> {
    match url.get(.."tiered:".len()) {
        Some(head) if head.eq_ignore_ascii_case("tiered:") => {
            url["tiered:".len()..].split('|').collect()
        }
        _ => vec![url],
    }
}

/// `scheme://user:secret@host/...` as `scheme://user:***@host/...`, for any store URL
/// (each half of a `tiered:<redis>|<postgres>` one).
pub fn redact(url: &str) -> String {
    let redacted: Vec<String> = parts(url).into_iter().map(redact_one).collect();
    match url.get(.."tiered:".len()) {
        Some(head) if head.eq_ignore_ascii_case("tiered:") => {
            format!("{head}{}", redacted.join("|"))
        }
        _ => redacted.concat(),
    }
}

fn redact_one(url: &str) -> String {
    match userinfo(url) {
        Some((scheme, userinfo, host, path)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}{path}"),
            None => format!("{scheme}://{userinfo}@{host}{path}"),
        },
        None => url.to_owned(),
    }
}

/// `text` with every password of `url` replaced by `***`.
pub fn scrub(text: &str, url: &str) -> String {
    let mut text = text.to_owned();
    for part in parts(url) {
        if let Some((_, password)) =
            userinfo(part).and_then(|(_, userinfo, _, _)| userinfo.split_once(':'))
        {
            if !password.is_empty() {
                text = text.replace(password, "***");
            }
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_show() {
        assert_eq!(
            redact("postgres://app:hunter2@db:5432/pay"),
            "postgres://app:***@db:5432/pay"
        );
        assert_eq!(
            redact("redis://:hunter2@127.0.0.1:6379/0"),
            "redis://:***@127.0.0.1:6379/0"
        );
        assert_eq!(
            redact("redis://127.0.0.1:6379/0"),
            "redis://127.0.0.1:6379/0"
        );
        assert_eq!(
            redact("tiered:redis://:pw1@r:6379|postgres://app:pw2@db/pay"),
            "tiered:redis://:***@r:6379|postgres://app:***@db/pay"
        );
        assert_eq!(
            redact("redis+cluster://:pw@h1:7000,h2:7001"),
            "redis+cluster://:***@h1:7000,h2:7001"
        );
        assert_eq!(
            scrub(
                "pw1 and pw2",
                "tiered:redis://:pw1@r:6379|postgres://app:pw2@db/pay"
            ),
            "*** and ***"
        );
        assert_eq!(scrub("refused", "redis://h"), "refused");
    }

    #[test]
    fn store_urls_parse_by_scheme() {
        assert_eq!(StoreUrl::parse(" memory ").unwrap(), StoreUrl::Memory);
        for url in [
            "redis://h:1",
            "rediss://h:1",
            "redis+cluster://h:1,h:2",
            "unix:///s",
        ] {
            assert_eq!(StoreUrl::parse(url).unwrap(), StoreUrl::Redis(url.into()));
        }
        let pg = StoreUrl::parse("postgresql://app:pw@db/x").unwrap();
        assert_eq!(pg.to_string(), "postgresql://app:***@db/x");
        assert!(format!("{pg:?}").contains("***"));
        for bad in [
            "mysql://root:hunter2@db/x",
            "tiered:redis://h:1",
            "tiered:postgres://a@b/c|redis://h:1",
            "tiered:redis://h|redis://h",
        ] {
            let Err(Error::Invalid(msg)) = StoreUrl::parse(bad) else {
                panic!("{bad} parsed")
            };
            assert!(!msg.contains("hunter2"), "{msg}");
        }
        let tiered: StoreUrl = "TIERED:redis://h:1|postgres://a@b/c".parse().unwrap();
        assert_eq!(tiered.tiered(), Some(("redis://h:1", "postgres://a@b/c")));
    }
}
