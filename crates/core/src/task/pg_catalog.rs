//! The codes of Postgres catalogs that decide what a task may do, as enums: a relation's kind and
//! replica identity (`pg_class`) and a replication slot's WAL status (`pg_replication_slots`)
//! (pure: no pgrx).

/// `pg_class.relkind`: what a relation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelationKind {
    /// `r`: an ordinary table.
    Table,
    /// `v`: a view.
    View,
    /// `p`: a partitioned table.
    PartitionedTable,
    /// `m`: a materialized view.
    MaterializedView,
    /// `f`: a foreign table.
    ForeignTable,
    /// Any other code (a sequence, an index, a composite type, a TOAST table).
    Other(char),
}

impl RelationKind {
    pub fn from_code(code: &str) -> Self {
        match code {
            "r" => RelationKind::Table,
            "v" => RelationKind::View,
            "p" => RelationKind::PartitionedTable,
            "m" => RelationKind::MaterializedView,
            "f" => RelationKind::ForeignTable,
            other => RelationKind::Other(other.chars().next().unwrap_or('?')),
        }
    }

    /// The catalog's code, for messages.
    pub fn code(self) -> char {
        match self {
            RelationKind::Table => 'r',
            RelationKind::View => 'v',
            RelationKind::PartitionedTable => 'p',
            RelationKind::MaterializedView => 'm',
            RelationKind::ForeignTable => 'f',
            RelationKind::Other(code) => code,
        }
    }
}

/// `pg_class.relreplident`: which old columns an UPDATE or DELETE logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaIdentity {
    /// `d`: the primary key's.
    Default,
    /// `f`: every column.
    Full,
    /// `i`: those of the index marked `indisreplident`.
    Index,
    /// `n`, or a code this version does not know: none.
    Nothing,
}

impl ReplicaIdentity {
    pub fn from_code(code: &str) -> Self {
        match code {
            "d" => ReplicaIdentity::Default,
            "f" => ReplicaIdentity::Full,
            "i" => ReplicaIdentity::Index,
            _ => ReplicaIdentity::Nothing,
        }
    }
}

/// `pg_replication_slots.wal_status`: whether the slot still has the WAL it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotStatus {
    /// `reserved`: within `max_wal_size`.
    Reserved,
    /// `extended`: beyond it, kept by `wal_keep_size` or `max_slot_wal_keep_size`.
    Extended,
    /// `unreserved`: past `max_slot_wal_keep_size`; invalidated at the next checkpoint.
    Unreserved,
    /// `lost`: invalidated; the changes it kept are gone.
    Lost,
    /// NULL or a value this version does not know.
    Unknown,
}

impl SlotStatus {
    pub fn from_stored(status: Option<&str>) -> Self {
        match status {
            Some("reserved") => SlotStatus::Reserved,
            Some("extended") => SlotStatus::Extended,
            Some("unreserved") => SlotStatus::Unreserved,
            Some("lost") => SlotStatus::Lost,
            _ => SlotStatus::Unknown,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relation_kinds_read_back_as_their_codes() {
        for code in ["r", "v", "p", "m", "f", "S", "c"] {
            assert_eq!(
                RelationKind::from_code(code).code().to_string(),
                code,
                "{code}"
            );
        }
        assert_eq!(RelationKind::from_code("r"), RelationKind::Table);
        assert_eq!(RelationKind::from_code("c"), RelationKind::Other('c'));
        assert_eq!(RelationKind::from_code(""), RelationKind::Other('?'));
    }

    #[test]
    fn replica_identities_and_slot_statuses_parse_and_unknown_values_are_the_safe_ones() {
        assert_eq!(ReplicaIdentity::from_code("f"), ReplicaIdentity::Full);
        assert_eq!(ReplicaIdentity::from_code("i"), ReplicaIdentity::Index);
        assert_eq!(ReplicaIdentity::from_code("d"), ReplicaIdentity::Default);
        // An identity we do not know carries nothing we can rely on.
        assert_eq!(ReplicaIdentity::from_code("x"), ReplicaIdentity::Nothing);
        assert_eq!(SlotStatus::from_stored(Some("lost")), SlotStatus::Lost);
        assert_eq!(
            SlotStatus::from_stored(Some("unreserved")),
            SlotStatus::Unreserved
        );
        assert_eq!(SlotStatus::from_stored(None), SlotStatus::Unknown);
    }
}
