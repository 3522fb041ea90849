//! Exponential backoff with full jitter: the delay before retry `attempt`
//! (counting from 0) is uniform in `[0, min(cap, base · 2^attempt)]`, so
//! many workers retrying against one recovering server spread out instead of
//! arriving together.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The retry policy of the workers: the first retry of a failed Meilisearch request or
/// catalog transaction waits up to this long, each further one up to twice as long as the one
/// before, never more than [`RETRY_CAP`]. The writer threads retry their requests on it too.
pub const RETRY_BASE: Duration = Duration::from_millis(100);

/// The longest wait between two retries: also how long a recovered Meilisearch may go unnoticed.
pub const RETRY_CAP: Duration = Duration::from_secs(30);

/// Delays between retries; see the module doc.
pub struct Backoff {
    base: Duration,
    cap: Duration,
    state: u64,
}

impl Backoff {
    pub fn new(base: Duration, cap: Duration) -> Self {
        Backoff {
            base,
            cap,
            state: seed(),
        }
    }

    /// The workers' policy: [`RETRY_BASE`] doubling up to [`RETRY_CAP`].
    pub fn policy() -> Self {
        Backoff::new(RETRY_BASE, RETRY_CAP)
    }

    /// The largest delay for `attempt`: `min(cap, base · 2^attempt)`.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        // 2^31 times any useful base is beyond any useful cap.
        let factor = 1u32 << attempt.min(31);
        self.base
            .checked_mul(factor)
            .map_or(self.cap, |delay| delay.min(self.cap))
    }

    /// A delay drawn uniformly from `[0, ceiling(attempt)]`.
    pub fn delay(&mut self, attempt: u32) -> Duration {
        let ceiling = u64::try_from(self.ceiling(attempt).as_nanos()).unwrap_or(u64::MAX);
        // Multiply-shift maps a uniform u64 onto [0, ceiling] without the
        // bias of a modulo.
        let nanos = (u128::from(self.next_random()) * (u128::from(ceiling) + 1)) >> 64;
        Duration::from_nanos(nanos as u64)
    }

    /// xorshift64*: statistically fine for jitter, and no dependency.
    fn next_random(&mut self) -> u64 {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        self.state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Different for each thread and each start, so that workers started at
/// the same moment do not draw the same delays. Never zero, which would
/// make xorshift stay at zero.
fn seed() -> u64 {
    let mut hasher = DefaultHasher::new();
    std::thread::current().id().hash(&mut hasher);
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos())
        .hash(&mut hasher);
    hasher.finish() | 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceiling_doubles_up_to_the_cap() {
        let backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let ceilings: Vec<u64> = (0..8)
            .map(|attempt| backoff.ceiling(attempt).as_millis() as u64)
            .collect();
        assert_eq!(ceilings, [100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        assert_eq!(backoff.ceiling(u32::MAX), Duration::from_secs(5));
        assert_eq!(backoff.ceiling(63), Duration::from_secs(5));
    }

    #[test]
    fn huge_base_does_not_overflow() {
        let backoff = Backoff::new(Duration::MAX, Duration::from_secs(1));
        assert_eq!(backoff.ceiling(10), Duration::from_secs(1));
        let mut backoff = Backoff::new(Duration::from_secs(u64::MAX / 2), Duration::MAX);
        assert!(backoff.delay(40) <= Duration::MAX);
    }

    #[test]
    fn delays_stay_within_bounds_and_spread() {
        let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(300));
        for attempt in 0..12 {
            let ceiling = backoff.ceiling(attempt);
            let delays: Vec<Duration> = (0..500).map(|_| backoff.delay(attempt)).collect();
            assert!(delays.iter().all(|delay| *delay <= ceiling));
            // Full jitter: both halves of the range are used.
            assert!(delays.iter().any(|delay| *delay < ceiling / 2));
            assert!(delays.iter().any(|delay| *delay > ceiling / 2));
        }
    }

    #[test]
    fn zero_base_gives_zero_delay() {
        let mut backoff = Backoff::new(Duration::ZERO, Duration::from_secs(1));
        assert_eq!(backoff.delay(5), Duration::ZERO);
    }

    #[test]
    fn threads_draw_different_delays() {
        let draw = || {
            let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(1));
            (0..4).map(|_| backoff.delay(0)).collect::<Vec<_>>()
        };
        let other = std::thread::spawn(draw).join().expect("thread runs");
        assert_ne!(draw(), other);
    }

    #[test]
    fn the_policy_doubles_from_its_base_to_its_cap() {
        let policy = Backoff::policy();
        assert_eq!(policy.ceiling(0), RETRY_BASE);
        assert_eq!(policy.ceiling(1), RETRY_BASE * 2);
        assert_eq!(policy.ceiling(40), RETRY_CAP);
    }
}
