//! RFC 8785 (JCS) canonical JSON, written while the document is parsed.
//!
//! [`canonicalize`] drives `serde_json`'s parser with a visitor that writes the canonical
//! form straight into one output buffer: no `serde_json::Value` tree, no allocation per
//! string, key or number (a key is borrowed from the input unless it holds an escape). An
//! object's members are written in the order they arrive, each one's span remembered with
//! its key; when the object closes, the spans are put in canonical key order if they are
//! not already in it. [`canonicalize_value`] feeds an already-parsed [`Value`] through the
//! same writer, so both entry points share one definition of the canonical form.
//!
//! Written here rather than with `serde_json_canonicalizer` (correct, but it buffers and
//! re-parses every key, which a guarded request pays for on its hot path: idem-bench's
//! `middleware` phase). Numbers are the hard part of RFC 8785 and come from
//! `ryu-js` (maintained by the Boa JavaScript engine: ECMAScript's
//! `Number.prototype.toString`, which the RFC prescribes), except integers up to 2^53,
//! whose form is their digits, written by `itoa`; strings are escaped by `serde_json`.
//! The tests hold this module to the RFC's own examples and, on random documents, to the
//! properties of a canonical form (member order, whitespace, escapes and number notation
//! change nothing; the form parses back to the same document and is its own form).
//!
//! What the parser accepts, rejects and how it reports it is `serde_json`'s own
//! (`from_slice` calls the same parser the same way): the same errors, the same recursion
//! limit (128 nested arrays and objects), so deep nesting is refused before it can
//! exhaust the stack.

use std::borrow::Cow;
use std::cmp::Ordering;
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// The canonical form of the JSON document `body`.
///
/// # Errors
///
/// `serde_json`'s error, exactly as `serde_json::from_slice::<Value>(body)` reports it,
/// when `body` is not one JSON document (trailing characters included) or holds a number
/// out of a double's range.
pub(super) fn canonicalize(body: &[u8]) -> Result<Vec<u8>, serde_json::Error> {
    let mut writer = Writer::for_document(body.len());
    let mut de = serde_json::Deserializer::from_slice(body);
    Node(&mut writer).deserialize(&mut de)?;
    de.end()?;
    Ok(writer.out)
}

/// Appends the canonical form of `value` to `out`.
pub(super) fn canonicalize_value(value: &Value, out: &mut Vec<u8>) {
    let mut writer = Writer {
        out: std::mem::take(out),
        members: Vec::new(),
    };
    writer.value(value);
    *out = writer.out;
}

/// Orders two strings by their UTF-16 code units, as RFC 8785 sorts keys.
///
/// UTF-8 byte order is code point order, and code point order is UTF-16 order except
/// between U+E000..=U+FFFF and the supplementary planes (U+10000 and above), whose UTF-16
/// surrogates (0xD800..=0xDFFF) sort below U+E000. At the first byte where two valid
/// UTF-8 strings differ, both are at the same character boundary or inside characters with
/// the same lead byte; only when both bytes are lead bytes, one of a character in
/// U+E000..=U+FFFF (0xEE, 0xEF) and the other of a supplementary one (0xF0..=0xF4), does
/// the order flip. So this compares bytes, with no UTF-16 transcoding.
pub(super) fn cmp_utf16(a: &str, b: &str) -> Ordering {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(i) => {
            let (x, y) = (a[i], b[i]);
            if x >= 0xEE && y >= 0xEE && (x >= 0xF0) != (y >= 0xF0) {
                y.cmp(&x)
            } else {
                x.cmp(&y)
            }
        }
        None => a.len().cmp(&b.len()),
    }
}

/// One member of an object still open: its key, and where its `"key":value` text starts
/// in the output (and, once the object closes, ends).
struct Member<'a> {
    key: Cow<'a, str>,
    start: usize,
    end: usize,
}

/// The canonical text written so far, and the members of every object still open
/// (innermost last), shared by all nesting levels so that one allocation serves them all.
struct Writer<'a> {
    out: Vec<u8>,
    members: Vec<Member<'a>>,
}

impl<'a> Writer<'a> {
    /// A writer for a document of `len` bytes. A hint, not a bound: room for about its
    /// canonical form and a second copy of its largest object while that object's members
    /// are put in order (a number such as `1e20` grows when written out), and for the
    /// members of a few objects.
    fn for_document(len: usize) -> Self {
        Self {
            out: Vec::with_capacity(len.saturating_mul(2)),
            members: Vec::with_capacity(8),
        }
    }

    fn null(&mut self) {
        self.out.extend_from_slice(b"null");
    }

    fn bool(&mut self, b: bool) {
        self.out
            .extend_from_slice(if b { b"true" } else { b"false" });
    }

    /// An integer, by its sign and magnitude. Up to 2^53 a double holds it exactly and
    /// ECMAScript writes its digits (no string of fewer digits denotes the same double), so
    /// `itoa` writes them: the same text as [`Writer::number`], without its float
    /// formatting. Beyond, it is the double it rounds to, as there.
    fn integer(&mut self, negative: bool, magnitude: u64) {
        if magnitude <= 1 << 53 {
            if negative && magnitude != 0 {
                self.out.push(b'-');
            }
            let mut buffer = itoa::Buffer::new();
            self.out
                .extend_from_slice(buffer.format(magnitude).as_bytes());
        } else {
            // Rounding to nearest is symmetric: this is `n as f64` for the signed `n`.
            let double = magnitude as f64;
            self.number(if negative { -double } else { double });
        }
    }

    /// Every number is the IEEE 754 double it denotes (integers beyond 2^53 round as in
    /// JavaScript), in ECMAScript's `Number.prototype.toString` form from `ryu-js`.
    fn number(&mut self, double: f64) {
        if double.is_finite() {
            let mut buffer = ryu_js::Buffer::new();
            self.out
                .extend_from_slice(buffer.format_finite(double).as_bytes());
        } else {
            // `serde_json::Value` turns a non-finite double into null; the parser never
            // produces one (it refuses `1e400`), but the two paths must agree regardless.
            self.null();
        }
    }

    /// A string with `serde_json`'s escapes, which are JCS's: `\"`, `\\`, `\b`, `\f`, `\n`,
    /// `\r`, `\t`, other control characters as lower-case `\u00xx`, the rest as UTF-8.
    fn string(&mut self, s: &str) {
        // Writing a `str` into a `Vec` cannot fail.
        let _ = serde_json::to_writer(&mut self.out, s);
    }

    /// Opens an object; returns the mark [`Writer::close_object`] takes.
    fn open_object(&mut self) -> usize {
        self.out.push(b'{');
        self.members.len()
    }

    /// Starts the member `key` of the object opened at `mark`; its value follows.
    fn key(&mut self, mark: usize, key: Cow<'a, str>) {
        if self.members.len() > mark {
            self.out.push(b',');
        }
        let start = self.out.len();
        self.string(&key);
        self.out.push(b':');
        self.members.push(Member { key, start, end: 0 });
    }

    /// Closes the object opened at `mark`, its members in canonical order: by the UTF-16
    /// code units of their keys, and of a key given twice only the last member, as
    /// `serde_json::Value` keeps it.
    fn close_object(&mut self, mark: usize) {
        let members = &mut self.members[mark..];
        let in_order = members
            .windows(2)
            .all(|w| cmp_utf16(&w[0].key, &w[1].key) == Ordering::Less);
        if !in_order {
            // Each member ends where the next one's comma is; the last at the end.
            let mut end = self.out.len();
            for member in members.iter_mut().rev() {
                member.end = end;
                end = member.start.saturating_sub(1);
            }
            let first = members[0].start;
            // Stable: of equal keys, the last one given stays last.
            members.sort_by(|a, b| cmp_utf16(&a.key, &b.key));
            // The members in order are written after the text as it came, then moved over it.
            let unordered = self.out.len();
            let mut written = false;
            for (i, member) in members.iter().enumerate() {
                if members
                    .get(i + 1)
                    .is_some_and(|next| next.key == member.key)
                {
                    continue;
                }
                if written {
                    self.out.push(b',');
                }
                written = true;
                self.out.extend_from_within(member.start..member.end);
            }
            let ordered = self.out.len() - unordered;
            self.out.copy_within(unordered.., first);
            self.out.truncate(first + ordered);
        }
        self.members.truncate(mark);
        self.out.push(b'}');
    }

    /// Writes an already-parsed value. Recursive like the `Value` it walks, which
    /// `serde_json`'s parser builds at most 128 levels deep.
    fn value(&mut self, value: &'a Value) {
        match value {
            Value::Null => self.null(),
            Value::Bool(b) => self.bool(*b),
            Value::Number(n) => match (n.as_u64(), n.as_i64()) {
                (Some(u), _) => self.integer(false, u),
                (None, Some(i)) => self.integer(i < 0, i.unsigned_abs()),
                // A `Value` never holds NaN or an infinity.
                (None, None) => self.number(n.as_f64().unwrap_or_default()),
            },
            Value::String(s) => self.string(s),
            Value::Array(items) => {
                self.out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        self.out.push(b',');
                    }
                    self.value(item);
                }
                self.out.push(b']');
            }
            Value::Object(map) => {
                let mark = self.open_object();
                for (key, item) in map {
                    self.key(mark, Cow::Borrowed(key));
                    self.value(item);
                }
                self.close_object(mark);
            }
        }
    }
}

/// One JSON value of the input, written canonically as the parser reads it.
struct Node<'w, 'a>(&'w mut Writer<'a>);

impl<'a> DeserializeSeed<'a> for Node<'_, 'a> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'a>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'a> Visitor<'a> for Node<'_, 'a> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        self.0.null();
        Ok(())
    }

    fn visit_bool<E>(self, b: bool) -> Result<(), E> {
        self.0.bool(b);
        Ok(())
    }

    // The three ways `serde_json` hands over a number, each standing for the double
    // `serde_json::Number::as_f64` gives.
    fn visit_u64<E>(self, n: u64) -> Result<(), E> {
        self.0.integer(false, n);
        Ok(())
    }

    fn visit_i64<E>(self, n: i64) -> Result<(), E> {
        self.0.integer(n < 0, n.unsigned_abs());
        Ok(())
    }

    fn visit_f64<E>(self, n: f64) -> Result<(), E> {
        self.0.number(n);
        Ok(())
    }

    fn visit_str<E>(self, s: &str) -> Result<(), E> {
        self.0.string(s);
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'a>>(self, mut items: A) -> Result<(), A::Error> {
        let writer = self.0;
        writer.out.push(b'[');
        let mut first = true;
        loop {
            // The comma goes in before the element is parsed, and out again if there is none.
            let before = writer.out.len();
            if !first {
                writer.out.push(b',');
            }
            if items.next_element_seed(Node(writer))?.is_none() {
                writer.out.truncate(before);
                break;
            }
            first = false;
        }
        writer.out.push(b']');
        Ok(())
    }

    fn visit_map<A: MapAccess<'a>>(self, mut members: A) -> Result<(), A::Error> {
        let writer = self.0;
        let mark = writer.open_object();
        while let Some(key) = members.next_key_seed(KeyOf)? {
            writer.key(mark, key);
            members.next_value_seed(Node(writer))?;
        }
        writer.close_object(mark);
        Ok(())
    }
}

/// An object's key: borrowed from the input, or owned when it held an escape.
struct KeyOf;

impl<'a> DeserializeSeed<'a> for KeyOf {
    type Value = Cow<'a, str>;

    fn deserialize<D: de::Deserializer<'a>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'a> Visitor<'a> for KeyOf {
    type Value = Cow<'a, str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object key")
    }

    fn visit_borrowed_str<E>(self, s: &'a str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(s))
    }

    fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(s.to_owned()))
    }
}
