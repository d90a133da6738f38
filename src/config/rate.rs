//! A queue's `rate_limit`: at most N task starts in any window of a given length, across every daemon
//! ("200/s", "20/100ms", "1000/h"; a list for several windows). Parsed here, enforced by claim.lua on Redis's
//! clock (docs/CONFIG.md, docs/PROTOCOL.md "Consuming").

use std::fmt;
use std::time::Duration;

/// The shortest window: claims are timed in whole milliseconds on Redis's clock, and a window this short already
/// asks a fetcher to claim every few milliseconds.
pub const MIN_WINDOW: Duration = Duration::from_millis(10);

/// The longest window: a log of one window's starts lives in Redis until they age out of it.
pub const MAX_WINDOW: Duration = Duration::from_secs(24 * 3600);

/// The most starts one window may allow (the log keeps about a thousand entries a window whatever the rate).
pub const MAX_STARTS: u64 = 1_000_000_000;

/// At most `starts` task starts in any window of `window`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct RateLimit {
    pub starts: u64,
    pub window: Duration,
}

impl RateLimit {
    /// The window in whole milliseconds, as claim.lua takes it.
    pub fn window_ms(&self) -> u64 {
        self.window.as_millis() as u64
    }
}

impl fmt::Debug for RateLimit {
    /// `200/1s`, as the reload's change list prints it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            self.starts,
            humantime::format_duration(self.window)
        )
    }
}

/// `N/WINDOW`: N a positive integer, WINDOW a unit (`ms` is not one alone: `100ms`), `s`, `m`, `h`, or a duration
/// (`100ms`, `10s`, `5m`). The error says what is wrong, for the config error to name the key around it.
pub fn parse(text: &str) -> Result<RateLimit, String> {
    let Some((starts, window)) = text.split_once('/') else {
        return Err(format!(
            "{text:?} is not a rate; write it as starts per window, like \"200/s\", \"20/100ms\", \"1000/h\""
        ));
    };
    let starts: u64 = starts.trim().parse().map_err(|_| {
        format!("{text:?}: {starts:?} is not a whole number of starts (like \"200/s\")")
    })?;
    if starts == 0 || starts > MAX_STARTS {
        return Err(format!(
            "{text:?}: the starts must be between 1 and {MAX_STARTS}"
        ));
    }
    let window = window.trim();
    let window = match window {
        "s" | "sec" | "second" => Duration::from_secs(1),
        "m" | "min" | "minute" => Duration::from_secs(60),
        "h" | "hour" => Duration::from_secs(3600),
        other => humantime::parse_duration(other).map_err(|_| {
            format!("{text:?}: {other:?} is not a window; write \"s\", \"m\", \"h\" or a duration like \"100ms\"")
        })?,
    };
    if window < MIN_WINDOW || window > MAX_WINDOW || window.subsec_nanos() % 1_000_000 != 0 {
        return Err(format!(
            "{text:?}: the window must be whole milliseconds between {} and {}",
            humantime::format_duration(MIN_WINDOW),
            humantime::format_duration(MAX_WINDOW)
        ));
    }
    Ok(RateLimit { starts, window })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_read_as_starts_per_window() {
        for (text, starts, ms) in [
            ("200/s", 200, 1000),
            ("20/100ms", 20, 100),
            ("5/m", 5, 60_000),
            ("1000/h", 1000, 3_600_000),
            ("7/10s", 7, 10_000),
            (" 3 / 2m ", 3, 120_000),
        ] {
            let rate = parse(text).unwrap();
            assert_eq!((rate.starts, rate.window_ms()), (starts, ms), "{text}");
        }
        assert_eq!(format!("{:?}", parse("200/s").unwrap()), "200/1s");
    }

    #[test]
    fn bad_rates_say_what_is_wrong() {
        for (text, words) in [
            ("200", "not a rate"),
            ("x/s", "not a whole number"),
            ("0/s", "between 1 and"),
            ("-1/s", "not a whole number"),
            ("5/fortnight", "not a window"),
            ("5/1ms", "between 10ms and 1day"),
            ("5/2days", "between 10ms and 1day"),
            ("5/10500us", "whole milliseconds"),
        ] {
            let error = parse(text).unwrap_err();
            assert!(error.contains(words), "{text}: {error}");
        }
    }
}
