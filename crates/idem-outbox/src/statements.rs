//! The outbox's SQL, one `.sql` file per statement in `src/sql/` (each opening with its
//! contract: parameters, what it returns), with the schema spliced in once: `{outbox}` and
//! `{records}` become `"<schema>".outbox` and `"<schema>".records`.

idem_postgres::statements! {
    /// The outbox row of a completion, in the business transaction.
    record,
    /// A key's rows, before an operator evicts the key.
    evict,
    /// A relay's batch (`FOR UPDATE SKIP LOCKED`).
    claim,
    /// The rows a batch applied.
    delete,
    /// A batch's failed rows, with backoff and dead-lettering.
    fail,
    /// Backlog, dead rows, lag.
    gauges,
    /// The dead rows, for operators.
    dead,
    /// Every dead row pending again.
    retry_all,
    /// Some dead rows pending again.
    retry_ids,
}

impl Statements {
    /// The statements with `quoted_schema` (a quoted identifier, as
    /// `idem_postgres::PgStore::quoted_schema` gives it) spliced in.
    pub(crate) fn new(quoted_schema: &str) -> Self {
        let outbox = format!("{quoted_schema}.outbox");
        let records = format!("{quoted_schema}.records");
        Self::build(|sql| {
            sql.replace("{outbox}", &outbox)
                .replace("{records}", &records)
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_statement_names_its_tables_through_the_schema() {
        let sql = super::Statements::new("\"s\"");
        for statement in sql.all() {
            assert!(!statement.contains('{'), "unspliced: {statement}");
            assert!(statement.contains("\"s\".outbox"), "{statement}");
            assert!(
                statement.starts_with("-- "),
                "no contract header: {statement}"
            );
        }
    }
}
