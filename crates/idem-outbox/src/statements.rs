//! The outbox's SQL, one `.sql` file per statement in `src/sql/` (each opening with its
//! contract: parameters, what it returns), with the schema spliced in once: `{outbox}` and
//! `{records}` become `"<schema>".outbox` and `"<schema>".records`.

/// The statements for one schema.
#[derive(Debug)]
pub(crate) struct Statements {
    /// `sql/record.sql`: the outbox row of a completion, in the business transaction.
    pub(crate) record: String,
    /// `sql/evict.sql`: a key's rows, before an operator evicts the key.
    pub(crate) evict: String,
    /// `sql/claim.sql`: a relay's batch (`FOR UPDATE SKIP LOCKED`).
    pub(crate) claim: String,
    /// `sql/delete.sql`: the rows a batch applied.
    pub(crate) delete: String,
    /// `sql/fail.sql`: a batch's failed rows, with backoff and dead-lettering.
    pub(crate) fail: String,
    /// `sql/gauges.sql`: backlog, dead rows, lag.
    pub(crate) gauges: String,
    /// `sql/dead.sql`: the dead rows, for operators.
    pub(crate) dead: String,
    /// `sql/retry_all.sql`: every dead row pending again.
    pub(crate) retry_all: String,
    /// `sql/retry_ids.sql`: some dead rows pending again.
    pub(crate) retry_ids: String,
}

impl Statements {
    /// The statements with `quoted_schema` (a quoted identifier, as
    /// `idem_postgres::PgStore::quoted_schema` gives it) spliced in.
    pub(crate) fn new(quoted_schema: &str) -> Self {
        let outbox = format!("{quoted_schema}.outbox");
        let records = format!("{quoted_schema}.records");
        let build = |sql: &str| {
            sql.replace("{outbox}", &outbox)
                .replace("{records}", &records)
        };
        Self {
            record: build(include_str!("sql/record.sql")),
            evict: build(include_str!("sql/evict.sql")),
            claim: build(include_str!("sql/claim.sql")),
            delete: build(include_str!("sql/delete.sql")),
            fail: build(include_str!("sql/fail.sql")),
            gauges: build(include_str!("sql/gauges.sql")),
            dead: build(include_str!("sql/dead.sql")),
            retry_all: build(include_str!("sql/retry_all.sql")),
            retry_ids: build(include_str!("sql/retry_ids.sql")),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_statement_names_its_tables_through_the_schema() {
        let sql = super::Statements::new("\"s\"");
        for statement in [
            &sql.record,
            &sql.evict,
            &sql.claim,
            &sql.delete,
            &sql.fail,
            &sql.gauges,
            &sql.dead,
            &sql.retry_all,
            &sql.retry_ids,
        ] {
            assert!(!statement.contains('{'), "unspliced: {statement}");
            assert!(statement.contains("\"s\".outbox"), "{statement}");
            assert!(
                statement.starts_with("-- "),
                "no contract header: {statement}"
            );
        }
    }
}
