//! The schema idem's tables live in, and the statements built for it.

use idem_core::Error;

/// The schema used unless [`crate::PgStore::with_schema`] says otherwise.
pub const DEFAULT_SCHEMA: &str = "idem";

/// PostgreSQL truncates identifiers longer than this (NAMEDATALEN - 1) without an error, so
/// two long names could silently meet in one schema: longer names are refused instead.
const MAX_IDENT_LEN: usize = 63;

/// A validated schema name and its quoted form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Schema {
    name: String,
    quoted: String,
}

impl Schema {
    /// Validates `name`: 1 to 63 bytes, no NUL. Any other character is allowed; the name is
    /// always quoted, so it is used exactly as given (case included).
    pub(crate) fn new(name: &str) -> Result<Self, Error> {
        if name.is_empty() {
            return Err(Error::Invalid("the schema name is empty".into()));
        }
        if name.len() > MAX_IDENT_LEN {
            return Err(Error::Invalid(format!(
                "the schema name is {} bytes long; PostgreSQL keeps at most {MAX_IDENT_LEN}",
                name.len()
            )));
        }
        if name.contains('\0') {
            return Err(Error::Invalid("the schema name holds a NUL byte".into()));
        }
        Ok(Self {
            name: name.to_owned(),
            quoted: format!("\"{}\"", name.replace('"', "\"\"")),
        })
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The name as a quoted identifier, ready to splice into SQL.
    pub(crate) fn quoted(&self) -> &str {
        &self.quoted
    }
}

/// Declares the calling module's `Statements`: a `String` field per statement, named after
/// its file in the module's `sql/` folder; `Statements::build` reads every file through a
/// splice, and `Statements::all` (in tests) lists them. For this crate and idem-outbox.
#[doc(hidden)]
#[macro_export]
macro_rules! statements {
    ($($(#[$doc:meta])* $name:ident,)+) => {
        /// The statements, with the schema spliced in.
        #[derive(Debug)]
        pub(crate) struct Statements {
            $($(#[$doc])* pub(crate) $name: String,)+
        }

        impl Statements {
            /// Every statement's file, through `splice`.
            fn build(splice: impl Fn(&str) -> String) -> Self {
                Self {
                    $($name: splice(include_str!(concat!("sql/", stringify!($name), ".sql"))),)+
                }
            }

            /// Every statement.
            #[cfg(test)]
            fn all(&self) -> Vec<&str> {
                vec![$(&self.$name),+]
            }
        }
    };
}

crate::statements! {
    claim,
    begin,
    complete,
    release,
    extend,
    get,
    evict,
    purge,
    stats,
    append,
    read_stream,
    purge_streams,
}

impl Statements {
    /// The store's statements with the schema spliced in (`{records}` and `{streams}` in
    /// the `.sql` files), and the parts `begin.sql` and `claim.sql` share (`{seen}`,
    /// `{answer}`).
    pub(crate) fn new(schema: &Schema) -> Self {
        let table = format!("{}.records", schema.quoted());
        let streams = format!("{}.streams", schema.quoted());
        Self::build(|sql| {
            sql.replace("{seen}", include_str!("sql/seen.sql"))
                .replace("{answer}", include_str!("sql/answer.sql"))
                .replace("{records}", &table)
                .replace("{streams}", &streams)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated_and_quoted() {
        assert_eq!(Schema::new("idem").unwrap().quoted(), "\"idem\"");
        assert_eq!(Schema::new("a\"b").unwrap().quoted(), "\"a\"\"b\"");
        assert_eq!(
            Schema::new("Mixed Case").unwrap().quoted(),
            "\"Mixed Case\""
        );
        assert!(matches!(Schema::new(""), Err(Error::Invalid(_))));
        assert!(matches!(Schema::new("a\0b"), Err(Error::Invalid(_))));
        assert!(Schema::new(&"s".repeat(63)).is_ok());
        assert!(matches!(
            Schema::new(&"s".repeat(64)),
            Err(Error::Invalid(_))
        ));
    }

    #[test]
    fn statements_name_the_schema() {
        let sql = Statements::new(&Schema::new("x\"y").unwrap());
        for s in sql.all() {
            assert!(s.contains("\"x\"\"y\".records"), "{s}");
            assert!(!s.contains('{'), "a part not spliced in: {s}");
        }
    }
}
