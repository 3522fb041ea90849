//! A position in the WAL that work on the index waits for: a watch of a task's stream
//! (`PartitionWatch`, `ColumnsAddedWatch`) brings the index in line only once Meilisearch has
//! everything the stream read up to it, and holds the slot's confirmation before it meanwhile.

#[derive(Debug, Default)]
pub struct Due {
    /// The position: once everything up to it is confirmed, the work is done.
    at: Option<u64>,
    /// Everything up to `at` is confirmed, at this read position (an idle stream's).
    confirmed_at: Option<u64>,
}

impl Due {
    /// The work is due once everything up to `position` is confirmed (the later of two).
    pub fn set(&mut self, position: u64) {
        self.at = Some(self.at.map_or(position, |at| at.max(position)));
    }

    pub fn is_set(&self) -> bool {
        self.at.is_some()
    }

    /// The position the slot may be confirmed to once the work is done, when everything up to
    /// `at` is confirmed (`settled`: the position the slot may be confirmed to now); None while
    /// it is not, or nothing is due.
    pub fn reached(&mut self, settled: Option<u64>) -> Option<u64> {
        let at = self.at?;
        settled
            .filter(|&position| position >= at)
            .or(self.confirmed_at.take())
    }

    /// The work was done.
    pub fn clear(&mut self) {
        self.at = None;
    }

    /// Whether an idle stream must not be confirmed to `read_position` yet: something is due
    /// before it. An idle stream past it has it done at the next settle.
    pub fn holds(&mut self, idle: bool, read_position: u64) -> bool {
        let Some(at) = self.at else {
            return false;
        };
        if idle && read_position >= at {
            self.confirmed_at = Some(read_position);
        }
        true
    }

    /// What was read is read again; what is due stays due.
    pub fn forget_read(&mut self) {
        self.confirmed_at = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_is_due_once_everything_before_it_is_confirmed() {
        let mut due = Due::default();
        assert_eq!(due.reached(Some(100)), None, "nothing is due");
        assert!(!due.holds(true, 100));
        due.set(50);
        due.set(40);
        assert_eq!(due.reached(Some(45)), None, "the later position counts");
        assert_eq!(due.reached(Some(60)), Some(60));
        // An idle stream past the position has it done at the next settle, with nothing settled.
        assert!(due.holds(true, 70));
        assert_eq!(due.reached(None), Some(70));
        assert!(due.holds(true, 70));
        due.forget_read();
        assert_eq!(
            due.reached(None),
            None,
            "read again: not confirmed any more"
        );
        due.clear();
        assert!(!due.is_set());
        assert!(!due.holds(true, 80));
    }
}
