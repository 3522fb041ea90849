//! How long a worker naps between rounds while Meilisearch works on its requests, and how often
//! it looks at something that changes slowly (pure: no pgrx).

use std::time::{Duration, Instant};

/// Short right after a round that moved something, doubling up to a cap while rounds move
/// nothing: a long indexing run is not polled hundreds of times a second, and a worker with many
/// tasks does not pay for all of them on every idle round.
pub struct BusyNap {
    shortest: Duration,
    longest: Duration,
    current: Duration,
}

impl BusyNap {
    pub fn new(shortest: Duration, longest: Duration) -> Self {
        BusyNap {
            shortest,
            longest: longest.max(shortest),
            current: shortest,
        }
    }

    /// The nap after a round; `moved` when it read changes or Meilisearch finished a request.
    pub fn after_round(&mut self, moved: bool) -> Duration {
        self.current = if moved {
            self.shortest
        } else {
            (self.current * 2).min(self.longest)
        };
        self.current
    }
}

/// Lets a look at something slow to change (a catalog row, an index) happen at most once per
/// interval, the first one at once.
pub struct Throttle {
    interval: Duration,
    last: Option<Instant>,
}

impl Throttle {
    pub fn new(interval: Duration) -> Self {
        Throttle {
            interval,
            last: None,
        }
    }

    /// True when a look is due at `now`, which then counts as the last one.
    pub fn due(&mut self, now: Instant) -> bool {
        if self
            .last
            .is_some_and(|last| now.saturating_duration_since(last) < self.interval)
        {
            return false;
        }
        self.last = Some(now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn naps_double_while_nothing_moves_and_start_over_when_something_does() {
        let mut nap = BusyNap::new(Duration::from_millis(5), Duration::from_millis(40));
        let naps: Vec<u128> = [false, false, false, false, true, false]
            .into_iter()
            .map(|moved| nap.after_round(moved).as_millis())
            .collect();
        assert_eq!(naps, [10, 20, 40, 40, 5, 10]);
    }

    #[test]
    fn a_cap_below_the_floor_is_the_floor() {
        let mut nap = BusyNap::new(Duration::from_millis(5), Duration::from_millis(1));
        assert_eq!(nap.after_round(false), Duration::from_millis(5));
    }

    #[test]
    fn a_throttle_lets_the_first_look_through_then_one_per_interval() {
        let mut throttle = Throttle::new(Duration::from_millis(100));
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let looks: Vec<bool> = [0, 50, 99, 100, 150, 250]
            .into_iter()
            .map(|ms| throttle.due(at(ms)))
            .collect();
        assert_eq!(looks, [true, false, false, true, false, true]);
    }
}
