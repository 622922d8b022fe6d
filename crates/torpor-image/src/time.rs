//! RFC 3339 timestamps in UTC, without a date-time dependency.

use std::time::{SystemTime, UNIX_EPOCH};

const SECONDS_PER_DAY: i64 = 86_400;

/// `t` as an RFC 3339 UTC timestamp with second precision, e.g. `2026-05-01T12:34:56Z`.
pub fn format_rfc3339_utc(t: SystemTime) -> String {
    let seconds: i64 = match t.duration_since(UNIX_EPOCH) {
        Ok(after) => i64::try_from(after.as_secs()).unwrap_or(i64::MAX),
        // Before 1970: round towards the past, so 0.5 s before the epoch is 23:59:59.
        Err(before) => {
            let d = before.duration();
            let whole = i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
            -whole - i64::from(d.subsec_nanos() > 0)
        }
    };
    format_unix_seconds(seconds)
}

/// The current time as an RFC 3339 UTC timestamp.
pub fn now_rfc3339_utc() -> String {
    format_rfc3339_utc(SystemTime::now())
}

fn format_unix_seconds(seconds: i64) -> String {
    let days = seconds.div_euclid(SECONDS_PER_DAY);
    let second_of_day = seconds.rem_euclid(SECONDS_PER_DAY);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        second_of_day / 3600,
        second_of_day / 60 % 60,
        second_of_day % 60
    )
}

/// The proleptic Gregorian (year, month, day) of a count of days since 1970-01-01.
///
/// Howard Hinnant's `civil_from_days`: days are counted in 400-year eras (146 097 days each)
/// starting on 0000-03-01, so that the leap day is the last day of each shifted year.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468; // days since 0000-03-01
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097); // [0, 146096]
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365; // [0, 399]
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100); // [0, 365]
    let month_from_march = (5 * day_of_year + 2) / 153; // [0, 11]
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1; // [1, 31]
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    }; // [1, 12]
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    // Both are in range by construction, so the casts cannot truncate.
    (year, month as u32, day as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(seconds: i64) -> String {
        format_unix_seconds(seconds)
    }

    #[test]
    fn known_instants() {
        let table = [
            (0, "1970-01-01T00:00:00Z"),
            (1, "1970-01-01T00:00:01Z"),
            (-1, "1969-12-31T23:59:59Z"),
            (86_399, "1970-01-01T23:59:59Z"),
            (951_782_400, "2000-02-29T00:00:00Z"),
            (951_868_800, "2000-03-01T00:00:00Z"),
            (1_709_164_800, "2024-02-29T00:00:00Z"),
            (1_234_567_890, "2009-02-13T23:31:30Z"),
            (4_107_542_400, "2100-03-01T00:00:00Z"), // 2100 is not a leap year
            (253_402_300_799, "9999-12-31T23:59:59Z"),
            (-2_208_988_800, "1900-01-01T00:00:00Z"),
            (-62_135_596_800, "0001-01-01T00:00:00Z"),
        ];
        for (seconds, expected) in table {
            assert_eq!(at(seconds), expected, "{seconds}");
        }
    }

    #[test]
    fn every_day_from_1600_to_2400_follows_the_calendar() {
        fn is_leap(y: i64) -> bool {
            (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
        }
        fn month_len(y: i64, m: u32) -> u32 {
            match m {
                2 if is_leap(y) => 29,
                2 => 28,
                4 | 6 | 9 | 11 => 30,
                _ => 31,
            }
        }
        // Day count of 1600-01-01 relative to 1970-01-01.
        let mut days: i64 = -135_140;
        let (mut y, mut m, mut d) = (1600_i64, 1_u32, 1_u32);
        assert_eq!(civil_from_days(days), (y, m, d));
        while y < 2400 {
            assert_eq!(civil_from_days(days), (y, m, d), "day {days}");
            days += 1;
            d += 1;
            if d > month_len(y, m) {
                d = 1;
                m += 1;
                if m > 12 {
                    m = 1;
                    y += 1;
                }
            }
        }
    }

    #[test]
    fn system_time_conversion() {
        let t = UNIX_EPOCH + Duration::from_millis(1_709_164_800_999);
        assert_eq!(format_rfc3339_utc(t), "2024-02-29T00:00:00Z");
        let before = UNIX_EPOCH - Duration::from_millis(500);
        assert_eq!(format_rfc3339_utc(before), "1969-12-31T23:59:59Z");
        let before = UNIX_EPOCH - Duration::from_secs(86_400);
        assert_eq!(format_rfc3339_utc(before), "1969-12-31T00:00:00Z");
        let now = now_rfc3339_utc();
        assert_eq!(now.len(), 20, "{now}");
        assert!(now.ends_with('Z') && now.as_bytes()[10] == b'T', "{now}");
    }
}
