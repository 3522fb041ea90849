//! A task's state change as a position in the WAL. The SQL functions that pause, stop, alter,
//! re-copy or drop a task bump its generation and, in the same transaction, write a transactional
//! logical message naming the task and its new generation. Decoding delivers that message in
//! commit order, exactly where the change committed: a stream that reads a message with a newer
//! generation than its own stops taking the task's changes there, whatever the launcher has or
//! has not done yet. A stream started for the new generation reads the same message again later
//! (it decodes from the task's confirmed position) and goes past it.

use serde_json::{json, Value};

use crate::wal::pgoutput::Message;

/// The prefix of the logical messages this extension writes.
pub const PREFIX: &str = "pg_meili_sync";

/// The content of the message that announces `generation` of `task`.
pub fn content(task: i64, generation: i64) -> String {
    json!({"task": task, "generation": generation}).to_string()
}

/// Whether `message` ends the stream of `task` as started for `generation`: a transactional
/// message of ours that announces a newer generation of the same task. Messages of others, of
/// other tasks, or that do not parse, end nothing.
pub fn ends_stream(message: &Message, task: i64, generation: i64) -> bool {
    let Message::Emitted {
        flags,
        prefix,
        content,
        ..
    } = message
    else {
        return false;
    };
    if *prefix != PREFIX || flags & 1 == 0 {
        return false;
    }
    let Ok(announced) = serde_json::from_slice::<Value>(content) else {
        return false;
    };
    announced["task"].as_i64() == Some(task)
        && announced["generation"]
            .as_i64()
            .is_some_and(|newer| newer > generation)
}

/// The task a message of ours concerns, for routing it (None for any other message).
pub fn task_of(message: &Message) -> Option<i64> {
    let Message::Emitted {
        prefix, content, ..
    } = message
    else {
        return None;
    };
    if *prefix != PREFIX {
        return None;
    }
    serde_json::from_slice::<Value>(content).ok()?["task"].as_i64()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn emitted<'a>(flags: u8, prefix: &'a str, content: &'a [u8]) -> Message<'a> {
        Message::Emitted {
            flags,
            lsn: 100,
            prefix,
            content,
        }
    }

    #[test]
    fn a_newer_generation_of_the_same_task_ends_its_stream() {
        let announced = content(7, 12);
        let message = emitted(1, PREFIX, announced.as_bytes());
        assert!(ends_stream(&message, 7, 11));
        assert_eq!(task_of(&message), Some(7));
        // The stream started for that generation, or a later one, goes past it.
        assert!(!ends_stream(&message, 7, 12));
        assert!(!ends_stream(&message, 7, 13));
        // Another task's change is not ours.
        assert!(!ends_stream(&message, 8, 1));
    }

    #[test]
    fn messages_of_others_end_nothing() {
        let announced = content(7, 12);
        // Not transactional: it is not at a commit's position.
        assert!(!ends_stream(
            &emitted(0, PREFIX, announced.as_bytes()),
            7,
            1
        ));
        assert!(!ends_stream(
            &emitted(1, "someone_else", announced.as_bytes()),
            7,
            1
        ));
        assert_eq!(
            task_of(&emitted(1, "someone_else", announced.as_bytes())),
            None
        );
        assert!(!ends_stream(&emitted(1, PREFIX, b"not json"), 7, 1));
        assert!(!ends_stream(
            &emitted(1, PREFIX, br#"{"task": "7", "generation": 99}"#),
            7,
            1
        ));
        let commit = Message::Commit {
            flags: 0,
            commit_lsn: 1,
            end_lsn: 2,
            commit_time: 0,
        };
        assert!(!ends_stream(&commit, 7, 1));
    }
}
