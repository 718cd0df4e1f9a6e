//! Store URLs without their secrets, for logs and error messages.

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
}
