//! Idempotency keys, scopes and the record identity built from both.

use std::fmt;

/// Longest accepted idempotency key, in bytes.
pub const MAX_KEY_LEN: usize = 255;
/// Longest accepted scope, in bytes.
pub const MAX_SCOPE_LEN: usize = 255;

/// Why a key or a scope was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is the empty string.
    #[error("idempotency key is empty")]
    Empty,
    /// The key (or scope) is longer than allowed.
    #[error("{what} is {len} bytes long; at most {max} are allowed")]
    TooLong {
        /// `"idempotency key"` or `"scope"`.
        what: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// The key holds a byte outside visible ASCII (`!` to `~`).
    #[error("idempotency key holds {byte:#04x} at byte {position}; only visible ASCII (0x21..=0x7e) is allowed")]
    InvalidByte {
        /// The offending byte.
        byte: u8,
        /// Its offset in the key.
        position: usize,
    },
    /// The scope starts with U+0001, which marks idem's own records.
    #[error("a scope may not start with U+0001: that marks idem's own records (tombstones, the status monitor's key)")]
    Reserved,
}

/// A validated idempotency key: 1 to 255 bytes of visible ASCII (`0x21..=0x7e`).
///
/// ```
/// use idem_core::Key;
/// assert!(Key::new("order-42").is_ok());
/// assert!(Key::new("").is_err());
/// assert!(Key::new("has space").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(String);

impl Key {
    /// Validates `key`.
    ///
    /// # Errors
    ///
    /// [`KeyError`] when the key is empty, longer than [`MAX_KEY_LEN`] bytes or holds a byte
    /// outside visible ASCII.
    pub fn new(key: impl Into<String>) -> Result<Self, KeyError> {
        let key = key.into();
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong {
                what: "idempotency key",
                len: key.len(),
                max: MAX_KEY_LEN,
            });
        }
        if let Some((position, &byte)) = key
            .as_bytes()
            .iter()
            .enumerate()
            .find(|(_, b)| !(0x21..=0x7e).contains(*b))
        {
            return Err(KeyError::InvalidByte { byte, position });
        }
        Ok(Self(key))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// `Debug` as the quoted text and `Display` as the text itself, for the validated text
/// types [`Key`] and [`Scope`].
macro_rules! shown_as_text {
    ($($text:ty),*) => {$(
        impl fmt::Debug for $text {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }

        impl fmt::Display for $text {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    )*};
}

shown_as_text!(Key, Scope);

impl std::str::FromStr for Key {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

/// The namespace a key lives in: a tenant, a principal, a route, a consumer group, or any
/// combination. Any UTF-8 text up to [`MAX_SCOPE_LEN`] bytes, the empty scope included,
/// that does not start with U+0001: that start marks idem's own records
/// ([`Scope::reserved`]), which no caller's scope may meet.
///
/// Two requests share a record only when both their scope and their key are equal, so one
/// tenant can never be handed another tenant's stored response.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Scope(String);

/// What starts a reserved scope, and no other.
const RESERVED: char = '\u{1}';

impl Scope {
    /// Validates `scope`.
    ///
    /// # Errors
    ///
    /// [`KeyError::TooLong`] when it is longer than [`MAX_SCOPE_LEN`] bytes;
    /// [`KeyError::Reserved`] when it starts with U+0001.
    pub fn new(scope: impl Into<String>) -> Result<Self, KeyError> {
        let scope = scope.into();
        if scope.starts_with(RESERVED) {
            return Err(KeyError::Reserved);
        }
        Self::stored(scope)
    }

    /// A scope of idem's own records (a key's tombstone, the status monitor's sealing key):
    /// U+0001, `name`, U+0001, so that it never equals a scope [`Scope::new`] accepts.
    ///
    /// # Errors
    ///
    /// [`KeyError::TooLong`] when that is longer than [`MAX_SCOPE_LEN`] bytes.
    pub fn reserved(name: &str) -> Result<Self, KeyError> {
        Self::stored(format!("{RESERVED}{name}{RESERVED}"))
    }

    /// A scope as a store holds it, reserved or not.
    fn stored(scope: String) -> Result<Self, KeyError> {
        if scope.len() > MAX_SCOPE_LEN {
            return Err(KeyError::TooLong {
                what: "scope",
                len: scope.len(),
                max: MAX_SCOPE_LEN,
            });
        }
        Ok(Self(scope))
    }

    /// The empty scope, for services with a single tenant.
    pub fn global() -> Self {
        Self(String::new())
    }

    /// The scope as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The identity of one record: a scope and a key.
///
/// [`RecordId::encoded`] gives a single string with no collisions: the scope's length comes
/// first, so `("a:b", "c")` and `("a", "b:c")` can never encode alike.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordId {
    scope: Scope,
    key: Key,
}

impl RecordId {
    /// Pairs a scope with a key.
    pub fn new(scope: Scope, key: Key) -> Self {
        Self { scope, key }
    }

    /// The scope.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }

    /// The key.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// `"<scope length>:<scope><key>"`: injective, since the length says where the scope ends
    /// and the key is what follows.
    pub fn encoded(&self) -> String {
        let scope = self.scope.as_str();
        let key = self.key.as_str();
        let mut out = String::with_capacity(scope.len() + key.len() + 4);
        out.push_str(&scope.len().to_string());
        out.push(':');
        out.push_str(scope);
        out.push_str(key);
        out
    }

    /// Reverses [`RecordId::encoded`]; `None` when `encoded` was not made by it.
    pub fn decode(encoded: &str) -> Option<Self> {
        let (len, rest) = encoded.split_once(':')?;
        let len: usize = len.parse().ok()?;
        if len > rest.len() || !rest.is_char_boundary(len) {
            return None;
        }
        let (scope, key) = rest.split_at(len);
        Some(Self::new(
            Scope::stored(scope.to_owned()).ok()?,
            Key::new(key).ok()?,
        ))
    }
}

impl fmt::Debug for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}/{:?}", self.scope, self.key)
    }
}

impl fmt::Display for RecordId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.scope, self.key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn key_validation() {
        assert_eq!(Key::new(""), Err(KeyError::Empty));
        assert!(Key::new("a".repeat(255)).is_ok());
        assert!(matches!(
            Key::new("a".repeat(256)),
            Err(KeyError::TooLong { len: 256, .. })
        ));
        assert_eq!(
            Key::new("ab\ncd"),
            Err(KeyError::InvalidByte {
                byte: b'\n',
                position: 2
            })
        );
        assert!(Key::new("é").is_err());
        assert!(Key::new("~!{}:").is_ok());
        assert!(Scope::new("x".repeat(256)).is_err());
        assert_eq!(Scope::new("\u{1}tombstone:a\u{1}"), Err(KeyError::Reserved));
        let reserved = Scope::reserved("tombstone:a").unwrap();
        assert_eq!(reserved.as_str(), "\u{1}tombstone:a\u{1}");
        // A store's reserved records read back as what they are.
        let id = RecordId::new(reserved, Key::new("k").unwrap());
        assert_eq!(RecordId::decode(&id.encoded()), Some(id));
    }

    proptest! {
        #[test]
        fn encoding_is_injective(
            s1 in ".{0,12}", k1 in "[!-~]{1,12}",
            s2 in ".{0,12}", k2 in "[!-~]{1,12}",
        ) {
            let a = RecordId::new(Scope::stored(s1).unwrap(), Key::new(k1).unwrap());
            let b = RecordId::new(Scope::stored(s2).unwrap(), Key::new(k2).unwrap());
            prop_assert_eq!(a == b, a.encoded() == b.encoded());
            prop_assert_eq!(RecordId::decode(&a.encoded()), Some(a));
        }
    }
}
