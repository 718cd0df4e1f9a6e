//! Redis keys: `<prefix>{<tag>}<encoded id>`.
//!
//! - `<encoded id>` is [`RecordId::encoded`], injective over (scope, key).
//! - `<tag>` is the first 4 bytes of SHA-256 of the encoded id, in hex. Redis Cluster hashes
//!   only what is between the first `{` and the next `}`, so the slot depends on this tag
//!   alone: a record's keys share a slot, and braces in a client's key or scope cannot pin
//!   keys to one slot.
//! - `<prefix>` may not hold `{` or `}`, so the tag's braces are the first ones.
//!
//! With a fixed prefix and a fixed-width tag, the encoded id is what follows the tag, so two
//! different records never share a key.
//!
//! A record's stream (a streamed response recorded while its lease runs) has a key of its
//! own per holder: `<prefix>{<tag>}s<token, 32 hex digits><encoded id>`. It shares the
//! record's tag (one slot, so a pipeline of both goes to one node), and never equals a
//! record's key: an encoded id starts with a digit, a stream's part after the tag with `s`.

use idem_core::{Error, FencingToken, RecordId};
use sha2::{Digest, Sha256};

/// Hex digits in the hash tag: 32 bits spread the keys evenly over the 16384 slots.
const TAG_HEX: usize = 8;

/// Checks a key prefix.
pub(crate) fn check_prefix(prefix: &str) -> Result<(), Error> {
    if prefix.contains(['{', '}']) {
        return Err(Error::Invalid(format!(
            "redis key prefix {prefix:?} holds a brace; braces would change the keys' hash slot"
        )));
    }
    Ok(())
}

/// The Redis key of a record.
pub(crate) fn record_key(prefix: &str, id: &RecordId) -> String {
    let encoded = id.encoded();
    let mut out = String::with_capacity(prefix.len() + TAG_HEX + 2 + encoded.len());
    out.push_str(prefix);
    out.push('{');
    push_hex(&mut out, &Sha256::digest(&encoded)[..TAG_HEX / 2]);
    out.push('}');
    out.push_str(&encoded);
    out
}

/// The key of the stream that `token`'s lease writes for the record whose key is
/// `record_key` (made with `prefix`).
pub(crate) fn stream_key(prefix: &str, record_key: &str, token: FencingToken) -> String {
    let tagged = prefix.len() + TAG_HEX + 2;
    let (head, encoded) = record_key.split_at(tagged.min(record_key.len()));
    let mut out = String::with_capacity(record_key.len() + 33);
    out.push_str(head);
    out.push('s');
    push_hex(&mut out, token.as_bytes());
    out.push_str(encoded);
    out
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for byte in bytes {
        out.push(char::from(HEX[usize::from(byte >> 4)]));
        out.push(char::from(HEX[usize::from(byte & 0xf)]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::{Key, Scope};
    use proptest::prelude::*;

    #[test]
    fn a_stream_shares_its_records_slot_and_never_its_key() {
        let record = record_key("idem:", &id("tenant", "order-1"));
        let token = FencingToken::random();
        let stream = stream_key("idem:", &record, token);
        assert_eq!(hash_tag(&stream), hash_tag(&record));
        assert_ne!(stream, record);
        let tail = &stream["idem:".len() + TAG_HEX + 2..];
        assert!(tail.starts_with('s'), "{stream}");
        assert!(tail.ends_with(id("tenant", "order-1").encoded().as_str()));
        // After the tag, a record's key starts with a digit (the scope's length).
        assert!(record["idem:".len() + TAG_HEX + 2..].starts_with(|c: char| c.is_ascii_digit()));
        assert_ne!(stream_key("idem:", &record, FencingToken::random()), stream);
    }

    /// Whether `scope` is one of idem's own (a leading U+0001), which `Scope::new` refuses.
    fn is_reserved(scope: &str) -> bool {
        scope.starts_with('\u{1}')
    }

    fn id(scope: &str, key: &str) -> RecordId {
        RecordId::new(Scope::new(scope).unwrap(), Key::new(key).unwrap())
    }

    /// What Redis Cluster hashes for a key's slot: the text between its first `{` and the
    /// next `}` when that is not empty, else the whole key (the cluster spec's rule; redis-rs
    /// computes the slot from it the same way).
    fn hash_tag(key: &str) -> &str {
        key.find('{')
            .and_then(|open| {
                let rest = &key[open + 1..];
                rest.find('}')
                    .filter(|&len| len > 0)
                    .map(|len| &rest[..len])
            })
            .unwrap_or(key)
    }

    #[test]
    fn prefix_braces_are_refused() {
        assert!(check_prefix("idem:").is_ok());
        assert!(check_prefix("a{b").is_err());
        assert!(check_prefix("a}b").is_err());
    }

    #[test]
    fn braces_in_keys_do_not_pin_the_slot() {
        // A client that puts the same hash tag in all its keys still spreads over slots.
        let tags: std::collections::HashSet<String> = (0..200)
            .map(|i| {
                hash_tag(&record_key("idem:", &id("{t}", &format!("{{same}}-{i}")))).to_owned()
            })
            .collect();
        assert_eq!(tags.len(), 200, "the hashed tags must all differ");
        assert!(tags.iter().all(|t| t.len() == TAG_HEX), "{tags:?}");
    }

    proptest! {
        #[test]
        fn different_records_never_share_a_key(
            s1 in "(.|[{}:])*", k1 in "[!-~]{1,24}",
            s2 in "(.|[{}:])*", k2 in "[!-~]{1,24}",
            prefix in "[^{}]{0,8}",
        ) {
            let (s1, s2) = (s1.chars().take(20).collect::<String>(), s2.chars().take(20).collect::<String>());
            prop_assume!(!is_reserved(&s1) && !is_reserved(&s2));
            let a = id(&s1, &k1);
            let b = id(&s2, &k2);
            prop_assert_eq!(a == b, record_key(&prefix, &a) == record_key(&prefix, &b));
        }

        /// A tiny alphabet of braces, colons and digits: equal pairs come up often, and so
        /// do pairs whose scope and key join into the same text.
        #[test]
        fn small_alphabet_pairs_collide_only_when_equal(
            s1 in "[{}:1a]{0,4}", k1 in "[{}:1a]{1,4}",
            s2 in "[{}:1a]{0,4}", k2 in "[{}:1a]{1,4}",
        ) {
            let (a, b) = (id(&s1, &k1), id(&s2, &k2));
            prop_assert_eq!(a == b, record_key("idem:", &a) == record_key("idem:", &b));
        }

        #[test]
        fn keys_that_differ_in_one_part_differ(
            scope in "(.|[{}:0-9])*", k1 in "[!-~]{1,16}", k2 in "[!-~]{1,16}",
        ) {
            let scope: String = scope.chars().take(16).collect();
            prop_assume!(!is_reserved(&scope));
            // The same bytes split differently between scope and key never collide.
            let joined = format!("{scope}{k1}");
            if let (Ok(s), Ok(k)) = (Scope::new(joined), Key::new(k2.clone())) {
                let a = RecordId::new(s, k);
                let b = id(&scope, &format!("{k1}{k2}"));
                prop_assert_ne!(record_key("p:", &a), record_key("p:", &b));
            }
            prop_assert_eq!(k1 == k2, record_key("p:", &id(&scope, &k1)) == record_key("p:", &id(&scope, &k2)));
        }

        #[test]
        fn the_slot_is_the_tags(
            scope in "(.|[{}])*", key in "[!-~]{1,24}", prefix in "[^{}]{0,8}",
        ) {
            let scope: String = scope.chars().take(20).collect();
            prop_assume!(!is_reserved(&scope));
            let k = record_key(&prefix, &id(&scope, &key));
            let open = prefix.len();
            prop_assert_eq!(&k[open..open + 1], "{");
            prop_assert_eq!(&k[open + 1 + TAG_HEX..open + 2 + TAG_HEX], "}");
            prop_assert_eq!(hash_tag(&k), &k[open + 1..open + 1 + TAG_HEX]);
        }
    }
}
