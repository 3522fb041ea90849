//! The one error type of the SQL API: each kind maps to a SQLSTATE, a message and a hint.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{PgLogLevel, PgSqlErrorCode};

use pg_meili_sync_core::meili::client::MeiliError;
use pg_meili_sync_core::task::failure::{Failure, FailureKind};

/// What went wrong, in terms the caller can act on; `raise` turns it into a Postgres ERROR.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ErrorKind {
    NullArgument,
    InvalidParameter,
    UndefinedTable,
    UndefinedColumn,
    UndefinedTask,
    NoKey,
    UnsupportedType,
    DuplicateTask,
    Prerequisite,
    Privilege,
    Limit,
    Meilisearch,
    Internal,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncError {
    pub kind: ErrorKind,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
}

impl SyncError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        SyncError {
            kind,
            message: message.into(),
            detail: None,
            hint: None,
        }
    }

    pub fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    /// The message, after what the caller was doing.
    pub fn context(mut self, what: &str) -> Self {
        self.message = format!("{what}: {}", self.message);
        self
    }

    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    pub fn sqlstate(&self) -> PgSqlErrorCode {
        match self.kind {
            ErrorKind::NullArgument => PgSqlErrorCode::ERRCODE_NULL_VALUE_NOT_ALLOWED,
            ErrorKind::InvalidParameter => PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            ErrorKind::UndefinedTable => PgSqlErrorCode::ERRCODE_UNDEFINED_TABLE,
            ErrorKind::UndefinedColumn => PgSqlErrorCode::ERRCODE_UNDEFINED_COLUMN,
            ErrorKind::UndefinedTask => PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT,
            ErrorKind::NoKey => PgSqlErrorCode::ERRCODE_INVALID_TABLE_DEFINITION,
            ErrorKind::UnsupportedType => PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
            ErrorKind::DuplicateTask => PgSqlErrorCode::ERRCODE_DUPLICATE_OBJECT,
            ErrorKind::Prerequisite => PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            ErrorKind::Privilege => PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            ErrorKind::Limit => PgSqlErrorCode::ERRCODE_CONFIGURATION_LIMIT_EXCEEDED,
            ErrorKind::Meilisearch => PgSqlErrorCode::ERRCODE_CONNECTION_FAILURE,
            ErrorKind::Internal => PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
        }
    }

    /// Raises this as a Postgres ERROR; never returns.
    pub fn raise(self) -> ! {
        let mut report = ErrorReport::new(self.sqlstate(), self.message, "pg_meili_sync");
        if let Some(detail) = self.detail {
            report = report.set_detail(detail);
        }
        if let Some(hint) = self.hint {
            report = report.set_hint(hint);
        }
        report.report(PgLogLevel::ERROR);
        unreachable!("ereport(ERROR) returned")
    }
}

impl std::fmt::Display for SyncError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Meilisearch's refusal or failure, with a SQLSTATE that fits: a refused key `42501`, a missing
/// index or document `42704`, a server failing or out of reach `08006`, and any other refusal
/// (of a parameter, a setting, a document) `22023`. Callers add what they were doing (`context`)
/// and a hint of their own where they know better than the generic one.
impl From<MeiliError> for SyncError {
    fn from(error: MeiliError) -> Self {
        let MeiliError::Http {
            status,
            body: Some(body),
        } = &error
        else {
            return SyncError::new(ErrorKind::Meilisearch, error.to_string())
                .hint("Check that Meilisearch is up and reachable at the task's url.");
        };
        let kind = if error.is_auth() {
            ErrorKind::Privilege
        } else if *status == 404 {
            ErrorKind::UndefinedTask
        } else if *status >= 500 {
            ErrorKind::Meilisearch
        } else {
            ErrorKind::InvalidParameter
        };
        let hint = match kind {
            ErrorKind::Privilege => "Check the task's api_key: it must be allowed to do this.",
            ErrorKind::UndefinedTask => {
                "The index does not exist (yet): a task creates it when it starts."
            }
            ErrorKind::Meilisearch => "Meilisearch failed; try again.",
            _ => "Meilisearch refused the request as its message says.",
        };
        SyncError::new(
            kind,
            format!("Meilisearch: {} ({})", body.message, body.code),
        )
        .detail(format!(
            "HTTP {status}, error type {}, {}",
            body.kind, body.link
        ))
        .hint(hint)
    }
}

impl From<pg_meili_sync_core::task::options::InvalidOption> for SyncError {
    fn from(error: pg_meili_sync_core::task::options::InvalidOption) -> Self {
        SyncError::new(ErrorKind::InvalidParameter, error.message).hint(error.hint)
    }
}

impl From<pgrx::spi::SpiError> for SyncError {
    fn from(error: pgrx::spi::SpiError) -> Self {
        SyncError::new(
            ErrorKind::Internal,
            format!("pg_meili_sync catalog access failed: {error}"),
        )
    }
}

/// The message of an ERROR (or a panic) caught around a worker's or the launcher's work.
pub fn caught_message(error: &pgrx::pg_sys::panic::CaughtError) -> String {
    use pgrx::pg_sys::panic::CaughtError;
    match error {
        CaughtError::PostgresError(report)
        | CaughtError::ErrorReport(report)
        | CaughtError::RustPanic {
            ereport: report, ..
        } => report.message().to_owned(),
    }
}

/// Unwraps a result or raises its error as a Postgres ERROR.
pub trait OrRaise<T> {
    fn or_raise(self) -> T;
}

impl<T> OrRaise<T> for Result<T, SyncError> {
    fn or_raise(self) -> T {
        match self {
            Ok(value) => value,
            Err(error) => error.raise(),
        }
    }
}

impl From<SyncError> for Failure {
    /// A catalog or input error met by a worker: the task stops with the message, and the hint
    /// when there is one.
    fn from(error: SyncError) -> Self {
        let kind = match error.kind {
            ErrorKind::Internal => FailureKind::Internal,
            ErrorKind::Meilisearch => FailureKind::Meilisearch,
            _ => FailureKind::Source,
        };
        let failure = Failure::new(kind, error.message);
        match error.hint {
            Some(hint) => failure.hint(hint),
            None => failure,
        }
    }
}
