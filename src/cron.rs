//! Five-field cron expressions (`minute hour day-of-month month day-of-week`), evaluated in UTC.
//!
//! Written here rather than taken from a crate: the crates that parse cron (`cron`, `croner`) bring chrono and
//! proc-macros for what is 200 lines, and kmqd needs only UTC and "the next slot after t".
//!
//! Each field is `*`, a number, a range `a-b`, a step `*/n`, `a-b/n` or `a/n`, or a comma list of those. Months
//! and weekdays take names (`jan`, `mon`); weekday 0 and 7 are Sunday. `@hourly`, `@daily` (`@midnight`),
//! `@weekly`, `@monthly` and `@yearly` (`@annually`) are shorthands. As in Vixie cron, when both day-of-month
//! and day-of-week are restricted, a day matches if either does.

use std::fmt;
use std::str::FromStr;

/// A parsed cron expression.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cron {
    minutes: u64,
    hours: u32,
    days_of_month: u32,
    months: u16,
    days_of_week: u8,
    any_day_of_month: bool,
    any_day_of_week: bool,
    text: String,
}

const MONTHS: [&str; 12] = [
    "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
];
const WEEKDAYS: [&str; 7] = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"];

/// One field's range and names.
struct Field {
    name: &'static str,
    min: u32,
    max: u32,
    names: &'static [&'static str],
}

impl Field {
    fn value(&self, text: &str) -> Result<u32, String> {
        let lower = text.to_ascii_lowercase();
        if let Some(index) = self.names.iter().position(|name| *name == lower) {
            return Ok(index as u32 + self.min);
        }
        let value: u32 = text
            .parse()
            .map_err(|_| format!("{}: {text:?} is not a number", self.name))?;
        if value < self.min || value > self.max {
            return Err(format!(
                "{}: {value} is outside {}-{}",
                self.name, self.min, self.max
            ));
        }
        Ok(value)
    }

    /// The set of values a field allows, as a bit mask (bit n = value n).
    fn parse(&self, text: &str) -> Result<u64, String> {
        let mut mask = 0u64;
        for item in text.split(',') {
            let (range, step) = match item.split_once('/') {
                Some((range, step)) => {
                    let step: u32 = step
                        .parse()
                        .ok()
                        .filter(|s| *s > 0)
                        .ok_or_else(|| format!("{}: bad step in {item:?}", self.name))?;
                    (range, step)
                }
                None => (item, 1),
            };
            let (low, high) = if range == "*" {
                (self.min, self.max)
            } else if let Some((low, high)) = range.split_once('-') {
                (self.value(low)?, self.value(high)?)
            } else if item.contains('/') {
                (self.value(range)?, self.max)
            } else {
                let value = self.value(range)?;
                (value, value)
            };
            if low > high {
                return Err(format!("{}: range {item:?} runs backwards", self.name));
            }
            for value in (low..=high).step_by(step as usize) {
                mask |= 1 << value;
            }
        }
        Ok(mask)
    }
}

impl FromStr for Cron {
    type Err = String;

    fn from_str(text: &str) -> Result<Cron, String> {
        let expanded = match text.trim() {
            "@yearly" | "@annually" => "0 0 1 1 *",
            "@monthly" => "0 0 1 * *",
            "@weekly" => "0 0 * * 0",
            "@daily" | "@midnight" => "0 0 * * *",
            "@hourly" => "0 * * * *",
            other => other,
        };
        let fields: Vec<&str> = expanded.split_whitespace().collect();
        let [minute, hour, day_of_month, month, day_of_week] = fields[..] else {
            return Err(format!(
                "{text:?} has {} fields; write five: minute hour day-of-month month day-of-week (e.g. \"0 3 * * *\")",
                fields.len()
            ));
        };
        let field = |name, min, max, names| Field {
            name,
            min,
            max,
            names,
        };
        let weekdays = field("day-of-week", 0, 7, &WEEKDAYS).parse(day_of_week)?;
        Ok(Cron {
            minutes: field("minute", 0, 59, &[]).parse(minute)?,
            hours: field("hour", 0, 23, &[]).parse(hour)? as u32,
            days_of_month: field("day-of-month", 1, 31, &[]).parse(day_of_month)? as u32,
            months: field("month", 1, 12, &MONTHS).parse(month)? as u16,
            // 7 is Sunday too.
            days_of_week: ((weekdays | (weekdays >> 7)) & 0x7f) as u8,
            any_day_of_month: day_of_month == "*",
            any_day_of_week: day_of_week == "*",
            text: text.trim().to_string(),
        })
    }
}

impl fmt::Display for Cron {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

const MINUTE_MS: i64 = 60_000;
const DAY_MS: i64 = 86_400_000;

/// (year, month 1-12, day 1-31) of a day counted from 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

impl Cron {
    fn day_matches(&self, days: i64) -> bool {
        let (_, month, day) = civil_from_days(days);
        if self.months & (1 << month) == 0 {
            return false;
        }
        // 1970-01-01 was a Thursday (4).
        let weekday = (days + 4).rem_euclid(7);
        let by_month_day = self.days_of_month & (1 << day) != 0;
        let by_week_day = self.days_of_week & (1 << weekday) != 0;
        if self.any_day_of_month || self.any_day_of_week {
            by_month_day && by_week_day
        } else {
            by_month_day || by_week_day
        }
    }

    /// The first time (ms since the epoch, UTC, on a whole minute) strictly after `after_ms` that matches, looking
    /// at most ten years ahead (`None` past that: an expression like "0 0 30 2 *" never matches).
    pub fn next_after(&self, after_ms: i64) -> Option<i64> {
        let start = (after_ms.div_euclid(MINUTE_MS) + 1) * MINUTE_MS;
        let first_day = start.div_euclid(DAY_MS);
        for days in first_day..first_day + 3660 {
            if !self.day_matches(days) {
                continue;
            }
            let day_start = days * DAY_MS;
            let from_minute = if days == first_day {
                (start - day_start) / MINUTE_MS
            } else {
                0
            };
            for minute_of_day in from_minute..1440 {
                let (hour, minute) = (minute_of_day / 60, minute_of_day % 60);
                if self.hours & (1 << hour) != 0 && self.minutes & (1 << minute) != 0 {
                    return Some(day_start + minute_of_day * MINUTE_MS);
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ms since the epoch of a UTC date and time.
    fn at(year: i64, month: u32, day: u32, hour: i64, minute: i64) -> i64 {
        // Inverse of civil_from_days by search: tests only.
        let mut days = (year - 1970) * 365 + (year - 1969) / 4 - 5;
        while civil_from_days(days) != (year, month, day) {
            days += if civil_from_days(days) < (year, month, day) {
                1
            } else {
                -1
            };
        }
        days * DAY_MS + hour * 3_600_000 + minute * MINUTE_MS
    }

    #[test]
    fn calendar_conversion_matches_known_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_819), (2027, 1, 1));
    }

    #[test]
    fn next_slots() {
        let from = at(2026, 11, 29, 23, 45); // a Sunday
        let cases = [
            ("* * * * *", at(2026, 11, 29, 23, 46)),
            ("*/15 * * * *", at(2026, 11, 30, 0, 0)),
            ("0 3 * * *", at(2026, 11, 30, 3, 0)),
            ("30 23 * * *", at(2026, 11, 30, 23, 30)),
            ("0 9 * * mon-fri", at(2026, 11, 30, 9, 0)),
            ("0 9 * * sat", at(2026, 12, 5, 9, 0)),
            ("0 0 1 * *", at(2026, 12, 1, 0, 0)),
            ("0 0 1 jan *", at(2027, 1, 1, 0, 0)),
            ("0 0 29 2 *", at(2028, 2, 29, 0, 0)),
            ("0 12 13 * 5", at(2026, 12, 4, 12, 0)), // day 13 or a Friday: Friday 4 December comes first
            ("0 0 * * 7", at(2026, 12, 6, 0, 0)),    // 7 is Sunday
            ("5,10 1-2 * * *", at(2026, 11, 30, 1, 5)),
            ("@hourly", at(2026, 11, 30, 0, 0)),
            ("@weekly", at(2026, 12, 6, 0, 0)),
        ];
        for (expression, expected) in cases {
            let cron: Cron = expression.parse().unwrap();
            assert_eq!(cron.next_after(from), Some(expected), "{expression}");
        }
        let every_minute: Cron = "* * * * *".parse().unwrap();
        assert_eq!(
            every_minute.next_after(from + 1),
            Some(from + MINUTE_MS),
            "strictly after, on whole minutes"
        );
        assert_eq!("0 0 30 2 *".parse::<Cron>().unwrap().next_after(from), None);
    }

    #[test]
    fn bad_expressions_say_what_is_wrong() {
        let cases = [
            ("* * * *", "has 4 fields"),
            ("60 * * * *", "minute: 60 is outside 0-59"),
            ("* 24 * * *", "hour: 24 is outside 0-23"),
            ("* * 0 * *", "day-of-month: 0 is outside 1-31"),
            ("* * * foo *", "month: \"foo\" is not a number"),
            ("*/0 * * * *", "minute: bad step"),
            ("5-1 * * * *", "runs backwards"),
        ];
        for (expression, expected) in cases {
            let error = expression.parse::<Cron>().unwrap_err();
            assert!(error.contains(expected), "{expression}: {error}");
        }
    }
}
