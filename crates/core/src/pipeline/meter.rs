//! Live measures for the status view (pure: no pgrx): the age of the oldest commit Meilisearch
//! has not confirmed yet, and documents per second over the last minute.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Commits decoded but not yet confirmed, oldest first, as (end LSN, commit time).
#[derive(Default)]
pub struct CommitAges {
    pending: VecDeque<(u64, i64)>,
}

/// Past this many pending commits, new ones are folded into the newest entry: the oldest commit
/// (the one the lag is about) is always kept exactly, and memory stays bounded.
const MAX_PENDING: usize = 100_000;

impl CommitAges {
    pub fn committed(&mut self, end_lsn: u64, commit_time: i64) {
        if self.pending.len() >= MAX_PENDING {
            if let Some(newest) = self.pending.back_mut() {
                newest.0 = end_lsn;
                return;
            }
        }
        self.pending.push_back((end_lsn, commit_time));
    }

    /// Meilisearch confirmed everything up to `lsn`.
    pub fn confirmed(&mut self, lsn: u64) {
        while self.pending.front().is_some_and(|(end, _)| *end <= lsn) {
            self.pending.pop_front();
        }
    }

    /// Commit time of the oldest unconfirmed commit, in the clock the commits carry.
    pub fn oldest(&self) -> Option<i64> {
        self.pending.front().map(|(_, time)| *time)
    }
}

/// A running total sampled about once a second; the rate is taken over the last minute, up to
/// the newest value (so that a burst shows at once, not at the next whole-second sample).
pub struct RateWindow {
    samples: VecDeque<(Instant, u64)>,
    latest: Option<(Instant, u64)>,
    window: Duration,
}

impl Default for RateWindow {
    fn default() -> Self {
        RateWindow {
            samples: VecDeque::new(),
            latest: None,
            window: Duration::from_secs(60),
        }
    }
}

impl RateWindow {
    pub fn sample(&mut self, now: Instant, total: u64) {
        self.latest = Some((now, total));
        if self
            .samples
            .back()
            .is_some_and(|(at, _)| now.duration_since(*at) < Duration::from_secs(1))
        {
            return;
        }
        self.samples.push_back((now, total));
        // Keep one sample at or beyond the window's start, so the rate spans the whole minute.
        while self.samples.len() > 2
            && self
                .samples
                .get(1)
                .is_some_and(|(at, _)| now.duration_since(*at) >= self.window)
        {
            self.samples.pop_front();
        }
    }

    /// Units per second from the oldest sample to the newest value; 0 until they are a second
    /// apart (a shorter span would give wild figures).
    pub fn per_second(&self) -> f64 {
        match (self.samples.front(), self.latest) {
            (Some((first_at, first)), Some((last_at, last)))
                if last_at.duration_since(*first_at) >= Duration::from_secs(1) =>
            {
                last.saturating_sub(*first) as f64 / last_at.duration_since(*first_at).as_secs_f64()
            }
            _ => 0.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_unconfirmed_commit_is_tracked_until_confirmed() {
        let mut ages = CommitAges::default();
        assert_eq!(ages.oldest(), None);
        ages.committed(100, 1_000);
        ages.committed(200, 2_000);
        ages.committed(300, 3_000);
        assert_eq!(ages.oldest(), Some(1_000));
        ages.confirmed(99);
        assert_eq!(ages.oldest(), Some(1_000));
        ages.confirmed(200);
        assert_eq!(ages.oldest(), Some(3_000));
        ages.confirmed(300);
        assert_eq!(ages.oldest(), None);
    }

    #[test]
    fn a_flood_of_commits_keeps_the_oldest_exact_and_memory_bounded() {
        let mut ages = CommitAges::default();
        for i in 0..(MAX_PENDING as u64 + 500) {
            ages.committed(10 + i, 5 + i as i64);
        }
        assert_eq!(ages.pending.len(), MAX_PENDING);
        assert_eq!(ages.oldest(), Some(5));
        let newest = 10 + MAX_PENDING as u64 + 499;
        ages.confirmed(newest - 1);
        assert!(
            ages.oldest().is_some(),
            "the folded tail is not confirmed yet"
        );
        ages.confirmed(newest);
        assert_eq!(ages.oldest(), None);
    }

    #[test]
    fn the_rate_spans_the_last_minute() {
        let start = Instant::now();
        let mut rate = RateWindow::default();
        assert_eq!(rate.per_second(), 0.0);
        // 100 units a second for two minutes, then 10 a second for half a minute.
        let mut total = 0;
        for second in 0..=120u64 {
            rate.sample(start + Duration::from_secs(second), total);
            total += 100;
        }
        assert!(
            (rate.per_second() - 100.0).abs() < 1e-9,
            "{}",
            rate.per_second()
        );
        for second in 121..=150u64 {
            total += 10;
            rate.sample(start + Duration::from_secs(second), total);
        }
        // The last 60 s: 30 s at 100/s and 30 s at 10/s.
        let expected = (30.0 * 100.0 + 30.0 * 10.0) / 60.0;
        assert!(
            (rate.per_second() - expected).abs() < 2.0,
            "{}",
            rate.per_second()
        );
        assert!(rate.samples.len() <= 62);
    }

    #[test]
    fn samples_closer_than_a_second_are_skipped() {
        let start = Instant::now();
        let mut rate = RateWindow::default();
        rate.sample(start, 0);
        rate.sample(start + Duration::from_millis(10), 1_000_000);
        assert_eq!(rate.per_second(), 0.0);
        rate.sample(start + Duration::from_secs(2), 200);
        assert!((rate.per_second() - 100.0).abs() < 1e-9);
    }

    #[test]
    fn a_burst_between_samples_shows_at_once() {
        let start = Instant::now();
        let mut rate = RateWindow::default();
        rate.sample(start, 1000);
        rate.sample(start + Duration::from_secs(4), 1000);
        assert_eq!(rate.per_second(), 0.0);
        // 400 confirmed 100 ms after the last whole-second sample.
        rate.sample(start + Duration::from_millis(4100), 1400);
        assert!(
            (rate.per_second() - 400.0 / 4.1).abs() < 1e-9,
            "{}",
            rate.per_second()
        );
    }
}
