//! Request and message fingerprints: SHA-256 over chosen parts, with JSON in its RFC 8785
//! canonical form.
//!
//! ## Version
//!
//! Every digest starts with the version tag `idem-fp-v2`, so that two ways of hashing never
//! agree by accident. Its canonical JSON is RFC 8785 (JCS): numbers as IEEE 754 doubles in
//! their shortest round-trip form (ECMAScript `Number.prototype.toString`, so `1250`,
//! `1250.0` and `1.25e3` agree), keys sorted by UTF-16 code units, strings escaped per JCS.
//! A change of the tag would change every fingerprint: a retry of a request recorded under
//! the previous one would answer [`crate::Begin::Mismatch`] until that record expires (its
//! retention).

mod canonical;

use std::fmt;

use serde_json::Value;
use sha2::{Digest, Sha256};

/// The version tag every digest starts with (see the [module](self)).
const VERSION: &[u8] = b"idem-fp-v2";

/// The SHA-256 digest of a request or message, stored with its record. A retry with the
/// same key but a different fingerprint is answered with a mismatch.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Wraps a digest computed elsewhere.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The digest.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The fingerprint of raw bytes alone (no parts, no canonicalisation).
    pub fn of_bytes(bytes: &[u8]) -> Self {
        FingerprintBuilder::new().bytes("body", bytes).finish()
    }

    /// Starts a fingerprint from several parts.
    pub fn builder() -> FingerprintBuilder {
        FingerprintBuilder::new()
    }

    /// Lower-case hex.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..16])
    }
}

/// The body handed to [`FingerprintBuilder::json`] is not JSON.
#[derive(Debug, thiserror::Error)]
#[error("body is not valid JSON: {0}")]
pub struct JsonError(#[from] serde_json::Error);

/// Which fields of a JSON document take part in a fingerprint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum JsonSelection {
    /// The whole document (the default).
    #[default]
    All,
    /// Only the values at these JSON pointers (RFC 6901, such as `/order/id`); a pointer that
    /// names nothing counts as absent, which is different from `null`.
    Only(Vec<String>),
    /// Everything but the values at these JSON pointers: volatile fields such as
    /// `/sent_at` or `/delivery_id`.
    Except(Vec<String>),
}

/// Builds a [`Fingerprint`] from named parts. Each part is framed with its name and length,
/// so no two different sequences of parts hash alike.
///
/// ```
/// use idem_core::{Fingerprint, JsonSelection};
/// let a = Fingerprint::builder()
///     .text("method", "POST")
///     .text("path", "/payments")
///     .json("body", br#"{"amount": 1250, "currency": "EUR"}"#, &JsonSelection::All)
///     .unwrap()
///     .finish();
/// let b = Fingerprint::builder()
///     .text("method", "POST")
///     .text("path", "/payments")
///     .json("body", br#"{"currency":"EUR","amount":1250}"#, &JsonSelection::All)
///     .unwrap()
///     .finish();
/// assert_eq!(a, b); // key order and whitespace do not matter
/// ```
#[derive(Debug, Clone)]
pub struct FingerprintBuilder {
    hasher: Sha256,
}

impl Default for FingerprintBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl FingerprintBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        let mut hasher = Sha256::new();
        hasher.update(VERSION);
        Self { hasher }
    }

    /// Adds a part of raw bytes.
    pub fn bytes(mut self, name: &str, value: &[u8]) -> Self {
        self.frame(name, value);
        self
    }

    /// Adds a part of text (a method, a path, a header value).
    pub fn text(self, name: &str, value: &str) -> Self {
        self.bytes(name, value.as_bytes())
    }

    /// Adds a JSON document in its RFC 8785 canonical form, restricted to the selected
    /// fields: object keys sorted by UTF-16 code units, no insignificant whitespace, every
    /// number written as the IEEE 754 double it denotes in its shortest round-trip form (so
    /// `1250`, `1250.0` and `1.25e3` agree, and integers beyond 2^53 round as JavaScript
    /// rounds them), strings with only the escapes JCS prescribes.
    ///
    /// # Errors
    ///
    /// [`JsonError`] when `body` is not JSON (including a number too large for a double,
    /// such as `1e400`, and invalid UTF-8). Nothing falls back to the raw bytes: a caller
    /// that wants that (as the HTTP layer does for a body it only believed to be JSON)
    /// uses [`FingerprintBuilder::bytes`] on the error.
    pub fn json(
        mut self,
        name: &str,
        body: &[u8],
        selection: &JsonSelection,
    ) -> Result<Self, JsonError> {
        if *selection == JsonSelection::All {
            // The common case, streamed: no `Value` tree is built.
            let canonical = canonical::canonicalize(body)?;
            self.frame(name, &canonical);
            return Ok(self);
        }
        let value: Value = serde_json::from_slice(body)?;
        Ok(self.json_value(name, &value, selection))
    }

    /// Adds an already-parsed JSON value, canonicalised as in [`FingerprintBuilder::json`].
    pub fn json_value(mut self, name: &str, value: &Value, selection: &JsonSelection) -> Self {
        let mut canonical = Vec::new();
        match selection {
            JsonSelection::All => canonical::canonicalize_value(value, &mut canonical),
            JsonSelection::Only(pointers) => {
                // Each selected pointer is framed with its value, or a marker for "absent".
                for pointer in pointers {
                    canonical.extend_from_slice(&(pointer.len() as u64).to_be_bytes());
                    canonical.extend_from_slice(pointer.as_bytes());
                    match value.pointer(pointer) {
                        Some(v) => {
                            canonical.push(1);
                            canonical::canonicalize_value(v, &mut canonical);
                        }
                        None => canonical.push(0),
                    }
                }
            }
            JsonSelection::Except(pointers) => {
                let mut pruned = value.clone();
                for pointer in pointers {
                    remove_pointer(&mut pruned, pointer);
                }
                canonical::canonicalize_value(&pruned, &mut canonical);
            }
        }
        self.frame(name, &canonical);
        self
    }

    /// The digest of everything added.
    pub fn finish(self) -> Fingerprint {
        Fingerprint(self.hasher.finalize().into())
    }

    fn frame(&mut self, name: &str, value: &[u8]) {
        self.hasher.update((name.len() as u64).to_be_bytes());
        self.hasher.update(name.as_bytes());
        self.hasher.update((value.len() as u64).to_be_bytes());
        self.hasher.update(value);
    }
}

/// Removes the value at an RFC 6901 pointer, if there is one: what
/// [`JsonSelection::Except`] leaves out, for a caller that prunes a document before it
/// fingerprints it.
///
/// ```
/// let mut doc = serde_json::json!({"params": {"key": "k1", "amount": 5}, "list": [1, 2]});
/// idem_core::remove_pointer(&mut doc, "/params/key");
/// idem_core::remove_pointer(&mut doc, "/list/0");
/// assert_eq!(doc, serde_json::json!({"params": {"amount": 5}, "list": [2]}));
/// ```
pub fn remove_pointer(value: &mut Value, pointer: &str) {
    let Some((parent, last)) = pointer.rsplit_once('/') else {
        return;
    };
    let last = last.replace("~1", "/").replace("~0", "~");
    let target = if parent.is_empty() {
        Some(value)
    } else {
        value.pointer_mut(parent)
    };
    match target {
        Some(Value::Object(map)) => {
            map.remove(&last);
        }
        Some(Value::Array(items)) => {
            if let Ok(i) = last.parse::<usize>() {
                if i < items.len() {
                    items.remove(i);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PINNED: &str = "bde6d71252ef0c81ad6e3df9894e139b9b808f5217ed8226f26e51b890c29d3f";

    fn fp(body: &str, sel: &JsonSelection) -> Fingerprint {
        Fingerprint::builder()
            .json("body", body.as_bytes(), sel)
            .unwrap()
            .finish()
    }

    #[test]
    fn canonical_json_ignores_order_and_whitespace() {
        let all = JsonSelection::All;
        assert_eq!(
            fp(r#"{"a":1,"b":{"y":[1,2],"x":"s"}}"#, &all),
            fp(" { \"b\" : {\"x\":\"s\", \"y\": [1, 2]}, \"a\": 1 } ", &all)
        );
        assert_ne!(fp(r#"{"a":1}"#, &all), fp(r#"{"a":2}"#, &all));
        assert_ne!(fp(r#"[1,2]"#, &all), fp(r#"[2,1]"#, &all));
    }

    #[test]
    fn selection_leaves_volatile_fields_out() {
        let except = JsonSelection::Except(vec!["/sent_at".into(), "/meta/id".into()]);
        assert_eq!(
            fp(r#"{"o":1,"sent_at":"t1","meta":{"id":1,"k":2}}"#, &except),
            fp(r#"{"o":1,"sent_at":"t2","meta":{"id":9,"k":2}}"#, &except)
        );
        assert_ne!(
            fp(r#"{"o":1,"meta":{"k":2}}"#, &except),
            fp(r#"{"o":1,"meta":{"k":3}}"#, &except)
        );
        let only = JsonSelection::Only(vec!["/order".into()]);
        assert_eq!(
            fp(r#"{"order":7,"ts":1}"#, &only),
            fp(r#"{"order":7,"ts":2}"#, &only)
        );
        assert_ne!(fp(r#"{"order":null}"#, &only), fp(r#"{}"#, &only));
    }

    /// One exact digest, so that no optimisation of the canonical form can change the
    /// fingerprints of records already stored. Version 2's value was checked by hand:
    /// SHA-256 of `idem-fp-v2`, then each part framed (name length, name, value length,
    /// value; lengths as big-endian u64), the body being
    /// `{"a":"x\"y","m":{"k":[]},"z":[1,2.5,-300,true,null,{"a":{},"b":"é\n"}]}`.
    #[test]
    fn digest_is_pinned() {
        let body =
            r#"{"z":[1,2.5,-3e2,true,null,{"b":"\u00e9\n","a":{}}],"a":"x\"y","m":{"k":[]}}"#;
        let f = Fingerprint::builder()
            .text("method", "POST")
            .json("body", body.as_bytes(), &JsonSelection::All)
            .unwrap()
            .finish();
        assert_eq!(f.to_hex(), PINNED);
    }

    /// Fingerprints are stored with their records: these were computed before the canonical
    /// writer last changed, and no change may alter them.
    #[test]
    fn fingerprints_are_fixed() {
        let all = JsonSelection::All;
        let only = JsonSelection::Only(vec!["/o/id".into(), "/missing".into()]);
        let except = JsonSelection::Except(vec!["/sent_at".into()]);
        let cases: [(&str, &JsonSelection, &str); 6] = [
            (
                r#"{"amount": 1250, "currency": "EUR"}"#,
                &all,
                "eaf16fd4b52ef1e7a11cb287131539fd781b23b36e9004d336fdf56a92c56e5e",
            ),
            (
                r#"{"z":[1e30,4.50,-0,9007199254740993,0.000001,-3e-7],"\u20ac":"€","\ud83d\ude00":1,"\ufb33":2,"a":{"b":"x\ty\u007f","a":null}}"#,
                &all,
                "689348be0b2e89a14262e205cdbd00938d97e8ccfc6ce065a9e2cedb9042c970",
            ),
            (
                r#"[true,false,null,"\u001f\/",{"a":1,"a":2},[],{}]"#,
                &all,
                "abd55e4de52e6dd16f49dfe5259f7d30337078b22051a3391d95fdbe5f1a1923",
            ),
            (
                r#"{"o":{"id":7,"k":[1.0]},"sent_at":"t","n":1.5}"#,
                &except,
                "7254ac5ad8e600d2d2e4861a3e2ae974a2fdf4ec98fd4ec488694b7ce101ac97",
            ),
            (
                r#"{"o":{"id":7,"k":[1.0]},"sent_at":"t","n":1.5}"#,
                &only,
                "38d319a1ef8fecd74599b0e4a1044f3a7053c92c524835399eb5289c53a36df4",
            ),
            (
                "18446744073709551615",
                &all,
                "f15dc5d9292ba09d68f4c3eaeb638d84a925abf81b7dbbfde8447b4689c96ac0",
            ),
        ];
        let mut got: Vec<String> = cases
            .iter()
            .map(|(body, selection, _)| {
                Fingerprint::builder()
                    .text("method", "POST")
                    .text("path", "/payments")
                    .json("body", body.as_bytes(), selection)
                    .unwrap()
                    .finish()
                    .to_hex()
            })
            .collect();
        got.push(Fingerprint::of_bytes(b"raw \xff bytes").to_hex());
        let mut expected: Vec<&str> = cases.iter().map(|(_, _, hex)| *hex).collect();
        expected.push("5e183fe0585fe0e5beeb8cdd1b69e2c895733881d4a8248151882ae87f554452");
        assert_eq!(got, expected);
    }

    /// The canonical form by the streaming path, checked against the `Value` path.
    fn canonical(json: &str) -> String {
        let streamed = canonical::canonicalize(json.as_bytes()).unwrap();
        let value: Value = serde_json::from_str(json).unwrap();
        let mut out = Vec::new();
        canonical::canonicalize_value(&value, &mut out);
        assert_eq!(streamed, out, "{json}");
        String::from_utf8(out).unwrap()
    }

    /// RFC 8785, appendix B: IEEE 754 doubles and their canonical text (NaN and the
    /// infinities, the table's error rows, cannot be held by a `serde_json::Value`).
    #[test]
    fn rfc8785_numbers() {
        let table: [(u64, &str); 25] = [
            (0x0000000000000000, "0"),
            (0x8000000000000000, "0"),
            (0x0000000000000001, "5e-324"),
            (0x8000000000000001, "-5e-324"),
            (0x7fefffffffffffff, "1.7976931348623157e+308"),
            (0xffefffffffffffff, "-1.7976931348623157e+308"),
            (0x4340000000000000, "9007199254740992"),
            (0xc340000000000000, "-9007199254740992"),
            (0x4430000000000000, "295147905179352830000"),
            (0x44b52d02c7e14af5, "9.999999999999997e+22"),
            (0x44b52d02c7e14af6, "1e+23"),
            (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
            (0x444b1ae4d6e2ef4e, "999999999999999700000"),
            (0x444b1ae4d6e2ef4f, "999999999999999900000"),
            (0x444b1ae4d6e2ef50, "1e+21"),
            (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
            (0x3eb0c6f7a0b5ed8d, "0.000001"),
            (0x41b3de4355555553, "333333333.3333332"),
            (0x41b3de4355555554, "333333333.33333325"),
            (0x41b3de4355555555, "333333333.3333333"),
            (0x41b3de4355555556, "333333333.3333334"),
            (0x41b3de4355555557, "333333333.33333343"),
            (0xbecbf647612f3696, "-0.0000033333333333333333"),
            (0x43143ff3c1cb0959, "1424953923781206.2"),
            (0x3ff0000000000000, "1"),
        ];
        for (bits, expected) in table {
            let value = Value::from(f64::from_bits(bits));
            let mut out = Vec::new();
            canonical::canonicalize_value(&value, &mut out);
            assert_eq!(String::from_utf8(out).unwrap(), expected, "{bits:#018x}");
            // The canonical text parses back to the same double, and is its own canonical form.
            assert_eq!(canonical(expected), expected, "{bits:#018x}");
        }
        // Integers are doubles too: beyond 2^53 they round as JavaScript rounds them.
        assert_eq!(canonical("9007199254740993"), "9007199254740992");
        assert_eq!(canonical("-0"), "0");
        assert_eq!(
            canonical("[1250, 1250.0, 1.25e3, 12500e-1]"),
            "[1250,1250,1250,1250]"
        );
    }

    /// RFC 8785, section 3.2.2: the whole-document example (numbers, escapes, literals).
    #[test]
    fn rfc8785_example() {
        let input = r#"{
            "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
            "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
            "literals": [null, true, false]
        }"#;
        let expected = r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#;
        assert_eq!(canonical(input), expected);
    }

    /// RFC 8785, section 3.2.3: keys sorted by UTF-16 code units, so the emoji (a surrogate
    /// pair, 0xD83D...) comes before U+FB33, which it follows in UTF-8 and code points.
    #[test]
    fn rfc8785_key_sorting() {
        let input = r#"{
            "\u20ac": "Euro Sign",
            "\r": "Carriage Return",
            "\ufb33": "Hebrew Letter Dalet With Dagesh",
            "1": "One",
            "\ud83d\ude00": "Emoji: Grinning Face",
            "\u0080": "Control",
            "\u00f6": "Latin Small Letter O With Diaeresis"
        }"#;
        let sorted = [
            ("\\r", "Carriage Return"),
            ("1", "One"),
            ("\u{80}", "Control"),
            ("\u{f6}", "Latin Small Letter O With Diaeresis"),
            ("\u{20ac}", "Euro Sign"),
            ("\u{1f600}", "Emoji: Grinning Face"),
            ("\u{fb33}", "Hebrew Letter Dalet With Dagesh"),
        ];
        let members: Vec<String> = sorted
            .iter()
            .map(|(k, v)| format!("\"{k}\":\"{v}\""))
            .collect();
        assert_eq!(canonical(input), format!("{{{}}}", members.join(",")));
        // Only the control characters are escaped (lower-case hex), the rest is literal UTF-8.
        assert_eq!(
            canonical(r#""\u001f\u007f\u00e9\t""#),
            "\"\\u001f\u{7f}é\\t\""
        );
    }

    #[test]
    fn equal_numbers_fingerprint_alike() {
        let all = JsonSelection::All;
        let a = fp(r#"{"amount": 1250, "currency": "EUR"}"#, &all);
        assert_eq!(a, fp(r#"{"currency":"EUR","amount":1250.0}"#, &all));
        assert_eq!(a, fp(r#"{"amount":1.25e3,"currency":"EUR"}"#, &all));
        assert_ne!(a, fp(r#"{"amount":1250.5,"currency":"EUR"}"#, &all));
        // Selections canonicalise the values they keep in the same way.
        let only = JsonSelection::Only(vec!["/amount".into()]);
        assert_eq!(
            fp(r#"{"amount":1250,"x":1}"#, &only),
            fp(r#"{"amount":125e1,"x":2}"#, &only)
        );
        let except = JsonSelection::Except(vec!["/at".into()]);
        assert_eq!(
            fp(r#"{"amount":[1250],"at":1}"#, &except),
            fp(r#"{"amount":[1250.00],"at":2}"#, &except)
        );
    }

    #[test]
    fn parts_are_framed() {
        let a = Fingerprint::builder().text("a", "bc").finish();
        let b = Fingerprint::builder().text("ab", "c").finish();
        assert_ne!(a, b);
        assert!(Fingerprint::builder()
            .json("b", b"{nope", &JsonSelection::All)
            .is_err());
        // Out of a double's range: refused, not rounded to infinity.
        assert!(Fingerprint::builder()
            .json("b", b"[1e400]", &JsonSelection::All)
            .is_err());
    }

    fn streamed(body: &[u8]) -> Result<Vec<u8>, String> {
        canonical::canonicalize(body).map_err(|e| e.to_string())
    }

    /// What `serde_json` makes of `body`: nothing, or its error message.
    fn parsed(body: &[u8]) -> Result<(), String> {
        serde_json::from_slice::<Value>(body)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    /// `value` with every number replaced by the double it denotes.
    fn as_doubles(value: &Value) -> Value {
        match value {
            Value::Number(n) => Value::from(n.as_f64().unwrap_or_default()),
            Value::Array(items) => Value::Array(items.iter().map(as_doubles).collect()),
            Value::Object(map) => Value::Object(
                map.iter()
                    .map(|(k, v)| (k.clone(), as_doubles(v)))
                    .collect(),
            ),
            other => other.clone(),
        }
    }

    /// A JSON text as a client may write it: duplicate keys, escapes or none, any number
    /// notation, whitespace or none.
    #[derive(Debug, Clone)]
    enum Text {
        Null,
        Bool(bool),
        Number(String),
        String(String, bool),
        Array(Vec<Text>, bool),
        Object(Vec<(String, bool, Text)>, bool),
    }

    impl Text {
        /// The same document written another way: escapes and whitespace the other way
        /// round, numbers in exponent notation, and the members of an object in reverse
        /// order when no key is given twice (else the last one given would change).
        fn rewritten(&self) -> Text {
            match self {
                Text::Number(n) => Text::Number(format!("{:e}", n.parse::<f64>().unwrap())),
                Text::String(s, escaped) => Text::String(s.clone(), !escaped),
                Text::Array(items, spaced) => {
                    Text::Array(items.iter().map(Text::rewritten).collect(), !spaced)
                }
                Text::Object(members, spaced) => {
                    let mut members: Vec<_> = members
                        .iter()
                        .map(|(k, escaped, v)| (k.clone(), !escaped, v.rewritten()))
                        .collect();
                    let keys: std::collections::HashSet<_> =
                        members.iter().map(|(k, _, _)| k).collect();
                    if keys.len() == members.len() {
                        members.reverse();
                    }
                    Text::Object(members, !spaced)
                }
                other => other.clone(),
            }
        }

        fn write(&self, out: &mut String) {
            match self {
                Text::Null => out.push_str("null"),
                Text::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
                Text::Number(n) => out.push_str(n),
                Text::String(s, escaped) => write_string(s, *escaped, out),
                Text::Array(items, spaced) => {
                    out.push('[');
                    for (i, item) in items.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        if *spaced {
                            out.push_str("\n  ");
                        }
                        item.write(out);
                    }
                    out.push(']');
                }
                Text::Object(members, spaced) => {
                    out.push('{');
                    for (i, (key, escaped, value)) in members.iter().enumerate() {
                        if i > 0 {
                            out.push(',');
                        }
                        if *spaced {
                            out.push_str(" \t");
                        }
                        write_string(key, *escaped, out);
                        out.push_str(if *spaced { " : " } else { ":" });
                        value.write(out);
                    }
                    out.push('}');
                }
            }
        }
    }

    /// A string with serde_json's minimal escapes, or every character as `\uXXXX`.
    fn write_string(s: &str, escaped: bool, out: &mut String) {
        if !escaped {
            out.push_str(&serde_json::to_string(s).unwrap());
            return;
        }
        out.push('"');
        for unit in s.encode_utf16() {
            out.push_str(&format!("\\u{unit:04X}"));
        }
        out.push('"');
    }

    mod random {
        use proptest::prelude::*;

        use super::*;

        /// Characters where the canonical form has its corner cases: escapes, controls,
        /// U+E000..=U+FFFF against the supplementary planes (UTF-16 order differs there).
        fn chars() -> impl Strategy<Value = char> {
            prop_oneof![
                prop::char::range('a', 'e'),
                prop::sample::select(vec![
                    '"',
                    '\\',
                    '/',
                    '\n',
                    '\u{0}',
                    '\u{1f}',
                    '\u{7f}',
                    'é',
                    '\u{ff}',
                    '\u{d7ff}',
                    '\u{e000}',
                    '\u{fb33}',
                    '\u{ffff}',
                    '\u{10000}',
                    '\u{1f600}',
                    '\u{10ffff}',
                ]),
                any::<char>(),
            ]
        }

        fn strings() -> impl Strategy<Value = String> {
            prop::collection::vec(chars(), 0..6).prop_map(|c| c.into_iter().collect())
        }

        fn numbers() -> impl Strategy<Value = String> {
            prop_oneof![
                any::<i64>().prop_map(|n| n.to_string()),
                any::<u64>().prop_map(|n| n.to_string()),
                // Integers around 2^53, where they stop being written digit for digit.
                (-(1i64 << 54)..(1i64 << 54)).prop_map(|n| n.to_string()),
                (-(1i64 << 20)..(1i64 << 20)).prop_map(|n| n.to_string()),
                any::<f64>()
                    .prop_filter("finite", |f| f.is_finite())
                    .prop_map(|f| format!("{f:?}")),
                any::<f64>()
                    .prop_filter("finite", |f| f.is_finite())
                    .prop_map(|f| format!("{f:e}")),
                (any::<i32>(), -30i32..30).prop_map(|(m, e)| format!("{m}E{e}")),
                prop::sample::select(vec![
                    "-0",
                    "0.0",
                    "-0.0",
                    "1250.00",
                    "12500e-1",
                    "9007199254740993",
                    "9007199254740992",
                    "9007199254740991",
                    "-9007199254740992",
                    "-9007199254740993",
                    "9007199254740995",
                    "18446744073709551615",
                    "-9223372036854775808",
                    "1e-400",
                    "1.7976931348623157e308",
                    "5e-324",
                    "123456789012345678901234567890",
                ])
                .prop_map(String::from),
            ]
        }

        fn texts() -> impl Strategy<Value = Text> {
            let leaf = prop_oneof![
                Just(Text::Null),
                any::<bool>().prop_map(Text::Bool),
                numbers().prop_map(Text::Number),
                (strings(), any::<bool>()).prop_map(|(s, e)| Text::String(s, e)),
            ];
            leaf.prop_recursive(5, 48, 6, |inner| {
                // Keys from a few short strings too, so that duplicates are common.
                let key = prop_oneof![
                    prop::sample::select(vec!["a", "b", "ab", "", "\u{e000}", "\u{1f600}", "é"])
                        .prop_map(String::from),
                    strings(),
                ];
                prop_oneof![
                    (prop::collection::vec(inner.clone(), 0..6), any::<bool>())
                        .prop_map(|(items, s)| Text::Array(items, s)),
                    (
                        prop::collection::vec((key, any::<bool>(), inner), 0..7),
                        any::<bool>()
                    )
                        .prop_map(|(members, s)| Text::Object(members, s)),
                ]
            })
        }

        fn text_of(t: &Text) -> String {
            let mut out = String::new();
            t.write(&mut out);
            out
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(4096))]

            /// Member order, whitespace, escapes and number notation change nothing: the
            /// canonical form depends only on what the document means.
            #[test]
            fn only_the_meaning_counts(t in texts()) {
                let text = text_of(&t);
                let c = streamed(text.as_bytes());
                prop_assert!(c.is_ok(), "{text}: {c:?}");
                let other = text_of(&t.rewritten());
                prop_assert_eq!(streamed(other.as_bytes()), c, "{} against {}", text, other);
            }

            /// The canonical form is valid JSON holding the same document (every number the
            /// double it denotes), and its own canonical form; a parsed `Value` gives it too.
            #[test]
            fn the_canonical_form_keeps_the_document(t in texts()) {
                let text = text_of(&t);
                let c = streamed(text.as_bytes()).unwrap();
                let value: Value = serde_json::from_str(&text).unwrap();
                let back: Value = serde_json::from_slice(&c).unwrap();
                prop_assert_eq!(as_doubles(&back), as_doubles(&value), "{}", text);
                prop_assert_eq!(streamed(&c), Ok(c.clone()));
                let mut out = Vec::new();
                canonical::canonicalize_value(&value, &mut out);
                prop_assert_eq!(out, c);
            }

            /// Broken documents (bytes replaced, cut short, extended) get the parser's own
            /// answer: accepted when it accepts them, else its error.
            #[test]
            fn broken_documents_get_the_parsers_errors(
                t in texts(),
                edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
                cut in any::<prop::sample::Index>(),
                how in 0u8..3,
            ) {
                let mut bytes = text_of(&t).into_bytes();
                for (at, byte) in &edits {
                    let i = at.index(bytes.len());
                    bytes[i] = *byte;
                }
                match how {
                    0 => bytes.truncate(cut.index(bytes.len() + 1)),
                    1 => bytes.extend_from_slice(b" x"),
                    _ => {}
                }
                prop_assert_eq!(streamed(&bytes).map(drop), parsed(&bytes));
            }

            #[test]
            fn utf16_order_without_transcoding(a in strings(), b in strings()) {
                prop_assert_eq!(
                    canonical::cmp_utf16(&a, &b),
                    a.encode_utf16().cmp(b.encode_utf16())
                );
            }
        }
    }

    /// Nesting is bounded by the parser's recursion limit, as before: deep documents get an
    /// error, never a stack overflow, and the limit is where it was.
    #[test]
    fn deep_nesting_is_refused_not_overflowed() {
        for depth in [1, 100, 127, 128, 129, 200, 100_000] {
            let arrays = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
            assert_eq!(
                streamed(arrays.as_bytes()).map(drop),
                parsed(arrays.as_bytes())
            );
            let objects = format!("{}1{}", r#"{"a":"#.repeat(depth), "}".repeat(depth));
            assert_eq!(
                streamed(objects.as_bytes()).map(drop),
                parsed(objects.as_bytes())
            );
        }
        let deep = "[".repeat(100_000);
        assert!(streamed(deep.as_bytes())
            .unwrap_err()
            .contains("recursion limit"));
        assert!(streamed(b"[[[1]]]").is_ok());
    }

    /// Every kind of invalid document answers serde_json's own error, message included.
    #[test]
    fn invalid_documents_give_the_parsers_errors() {
        let cases: [&[u8]; 14] = [
            b"",
            b"{nope",
            b"[1e400]",
            b"[1,]",
            b"{\"a\":1,}",
            b"{1:2}",
            b"\"\\ud800\"",
            b"{\"\\udc00\":1}",
            b"\"\xff\"",
            b"[1] 2",
            b"{\"a\" 1}",
            b"nul",
            b"[\"a\x01\"]",
            b"{\"a\":1,\"a\":}",
        ];
        for body in cases {
            let expected = parsed(body);
            assert!(expected.is_err(), "{body:?}");
            assert_eq!(streamed(body).map(drop), expected, "{body:?}");
        }
    }

    /// Of a key given twice the last member counts, as `serde_json::Value` kept it.
    #[test]
    fn duplicate_keys_keep_the_last_member() {
        assert_eq!(canonical(r#"{"b":1,"a":2,"b":3}"#), r#"{"a":2,"b":3}"#);
        assert_eq!(canonical(r#"{"a":1,"a":{"x":[2]}}"#), r#"{"a":{"x":[2]}}"#);
        assert_eq!(
            canonical(r#"{"\u0061":1,"a":2,"b":{"d":1,"c":2,"d":3}}"#),
            r#"{"a":2,"b":{"c":2,"d":3}}"#
        );
    }
}
