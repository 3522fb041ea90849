//! Date and duration formatting as Meilisearch prints them (no date crate).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// RFC 3339 in UTC with nanoseconds, trailing zeros trimmed: `2026-11-30T00:00:17.20550389Z`.
pub(crate) fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, day) = civil_from_days(days);
    let mut out = format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    );
    let nanos = d.subsec_nanos();
    if nanos != 0 {
        let frac = format!("{nanos:09}");
        out.push('.');
        out.push_str(frac.trim_end_matches('0'));
    }
    out.push('Z');
    out
}

/// Howard Hinnant's days-to-civil algorithm.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// ISO 8601 duration the way Meilisearch serializes task durations: `PT0.036969750S`.
pub(crate) fn iso_duration(d: Duration) -> String {
    let days = d.as_secs() / 86_400;
    let secs = d.as_secs() % 86_400;
    let nanos = d.subsec_nanos();
    let mut out = String::from("P");
    if days != 0 {
        out.push_str(&format!("{days}D"));
    }
    if secs != 0 || nanos != 0 || days == 0 {
        if nanos == 0 {
            out.push_str(&format!("T{secs}S"));
        } else if nanos.is_multiple_of(1_000_000) {
            out.push_str(&format!("T{secs}.{:03}S", nanos / 1_000_000));
        } else if nanos.is_multiple_of(1_000) {
            out.push_str(&format!("T{secs}.{:06}S", nanos / 1_000));
        } else {
            out.push_str(&format!("T{secs}.{nanos:09}S"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_dates() {
        let t = UNIX_EPOCH + Duration::new(1_795_996_817, 205_503_890);
        assert_eq!(rfc3339(t), "2026-11-30T00:00:17.20550389Z");
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00Z"
        );
    }

    #[test]
    fn formats_durations() {
        assert_eq!(iso_duration(Duration::new(0, 36_969_750)), "PT0.036969750S");
        assert_eq!(iso_duration(Duration::new(1, 0)), "PT1S");
        assert_eq!(iso_duration(Duration::from_millis(1500)), "PT1.500S");
        assert_eq!(iso_duration(Duration::ZERO), "PT0S");
        assert_eq!(iso_duration(Duration::from_secs(86_400)), "P1D");
    }
}
