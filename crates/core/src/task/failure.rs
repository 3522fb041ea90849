//! Why a task stopped for good, and what its owner does about it: a worker's permanent failures
//! are typed here, and become the task's `last_error` only where the task is known (pure: no
//! pgrx).

use std::fmt;

/// Where a permanent failure comes from; it decides the advice when the failure gives none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Meilisearch refused a request or failed a task of ours, and trying again cannot help.
    Meilisearch,
    /// The index no longer is the one the task filled (deleted, re-created, another key).
    Index,
    /// The task's replication slot lost changes (invalidated or missing).
    Slot,
    /// The task's table or view, its options, a privilege or a catalog step.
    Source,
    /// A change in the WAL could not be read.
    Decoding,
    /// A state that pg_meili_sync itself should never reach.
    Internal,
}

impl FailureKind {
    /// The word the server log shows.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Meilisearch => "meilisearch",
            FailureKind::Index => "index",
            FailureKind::Slot => "slot",
            FailureKind::Source => "source",
            FailureKind::Decoding => "decoding",
            FailureKind::Internal => "internal",
        }
    }

    fn default_advice(self) -> Advice {
        match self {
            FailureKind::Meilisearch | FailureKind::Source => Advice::FixThenResume,
            FailureKind::Index | FailureKind::Slot => Advice::Snapshot,
            FailureKind::Decoding => Advice::ResumeToDecodeAgain,
            FailureKind::Internal => Advice::Report,
        }
    }
}

/// What the task's owner does about a failure; `last_error` says it with the task's id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Advice {
    /// Fix what the message names, then resume: the task goes on where it stopped.
    FixThenResume,
    /// The index no longer holds every row: copy the source again.
    Snapshot,
    /// Resume: the task decodes again from its last confirmed position.
    ResumeToDecodeAgain,
    /// Do what this says (change a replica identity, say), then copy the source again.
    FixThenSnapshot(String),
    /// A bug of ours: report it, then copy the source again.
    Report,
    /// Said in full by whoever failed (a GRANT to run, a Postgres HINT).
    Said(String),
}

impl Advice {
    /// The advice for task `task`, or in general (`None`: the shared decoder, no one task).
    fn render(&self, task: Option<i64>) -> String {
        let task = task.map_or_else(|| "task".to_owned(), |id| id.to_string());
        match self {
            Advice::FixThenResume => format!("fix the cause, then run SELECT meili_sync_resume({task})"),
            Advice::Snapshot => {
                format!("run SELECT meili_sync_snapshot({task}) to copy the source again")
            }
            Advice::FixThenSnapshot(fix) => format!(
                "{fix}, then run SELECT meili_sync_snapshot({task}) to copy the source again"
            ),
            Advice::ResumeToDecodeAgain => format!(
                "run SELECT meili_sync_resume({task}) to decode again from the last confirmed position; if it fails again, report it with the server log"
            ),
            Advice::Report => format!(
                "this is a bug in pg_meili_sync: report it with the server log, then run SELECT meili_sync_snapshot({task})"
            ),
            Advice::Said(text) => text.clone(),
        }
    }
}

/// A permanent failure: what happened, of which kind, and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub kind: FailureKind,
    pub message: String,
    pub advice: Advice,
}

impl Failure {
    /// A failure with its kind's advice.
    pub fn new(kind: FailureKind, message: impl Into<String>) -> Self {
        Failure {
            kind,
            message: message.into(),
            advice: kind.default_advice(),
        }
    }

    pub fn advice(mut self, advice: Advice) -> Self {
        self.advice = advice;
        self
    }

    /// The advice in full words, in place of the kind's.
    pub fn hint(self, hint: impl Into<String>) -> Self {
        self.advice(Advice::Said(hint.into()))
    }

    /// The message, after what the worker was doing.
    pub fn context(mut self, what: &str) -> Self {
        self.message = format!("{what}: {}", self.message);
        self
    }

    /// The `last_error` of task `task` (or of the shared decoder, with `None`): the message,
    /// then what to do.
    pub fn last_error(&self, task: Option<i64>) -> String {
        format!("{}; {}", self.message, self.advice.render(task))
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.last_error(None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_last_error_says_what_happened_and_what_to_do_with_the_task_id() {
        let failure = Failure::new(FailureKind::Index, "index \"movies\" was deleted");
        assert_eq!(
            failure.last_error(Some(7)),
            "index \"movies\" was deleted; run SELECT meili_sync_snapshot(7) to copy the source again"
        );
        assert_eq!(
            Failure::new(FailureKind::Source, "reading rows: permission denied")
                .last_error(Some(3)),
            "reading rows: permission denied; fix the cause, then run SELECT meili_sync_resume(3)"
        );
    }

    #[test]
    fn every_kind_has_advice_that_names_a_function_to_run() {
        for kind in [
            FailureKind::Meilisearch,
            FailureKind::Index,
            FailureKind::Slot,
            FailureKind::Source,
            FailureKind::Decoding,
            FailureKind::Internal,
        ] {
            let text = Failure::new(kind, "x").last_error(Some(12));
            assert!(text.contains("SELECT meili_sync_"), "{kind:?}: {text}");
            assert!(text.contains("(12)"), "{kind:?}: {text}");
        }
    }

    #[test]
    fn a_hint_replaces_the_kinds_advice_and_context_goes_first() {
        let failure = Failure::new(FailureKind::Source, "permission denied for table t")
            .hint("run GRANT SELECT ON t TO alice")
            .context("reading rows");
        assert_eq!(
            failure.last_error(Some(1)),
            "reading rows: permission denied for table t; run GRANT SELECT ON t TO alice"
        );
        assert_eq!(
            failure.to_string(),
            "reading rows: permission denied for table t; run GRANT SELECT ON t TO alice"
        );
    }

    #[test]
    fn a_fix_then_snapshot_names_the_fix_first() {
        let failure = Failure::new(FailureKind::Source, "a DELETE came without its old row")
            .advice(Advice::FixThenSnapshot(
                "run ALTER TABLE t REPLICA IDENTITY FULL".to_owned(),
            ));
        assert_eq!(
            failure.last_error(Some(4)),
            "a DELETE came without its old row; run ALTER TABLE t REPLICA IDENTITY FULL, then run SELECT meili_sync_snapshot(4) to copy the source again"
        );
    }

    #[test]
    fn without_a_task_the_advice_names_the_argument() {
        let failure = Failure::new(FailureKind::Decoding, "cannot parse a pgoutput message");
        assert!(failure
            .last_error(None)
            .contains("SELECT meili_sync_resume(task)"));
    }
}
