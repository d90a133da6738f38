//! What `kmqd stats --watch` shows, as text: the full-screen table fitted to the terminal ([`render`]) and the
//! one line per queue of the plain mode ([`line()`]). Pure functions of the rows, so the tests below pin both.

use std::time::Duration;

use crate::cli::colour::Style;
pub(crate) use crate::overview::Row;

/// What the screen shows besides the rows.
pub(crate) struct Frame<'a> {
    pub(crate) rows: &'a [Row],
    pub(crate) interval: Duration,
    /// The local time of the last good poll, `None` before the first.
    pub(crate) updated: Option<&'a str>,
    /// The last poll's failure, shown until a poll succeeds again.
    pub(crate) error: Option<&'a str>,
    /// The first queue shown (up/down scroll).
    pub(crate) scroll: usize,
}

/// The table's columns: header and width. The widths add up, with the spaces between, to 79: it fits 80 columns.
/// Each number's column is as wide as its longest text ([`count`] 5, [`rate`] 6, [`lag`] 5), no wider.
const COLUMNS: [(&str, usize); 12] = [
    ("QUEUE", 10),
    ("MODE", 7),
    ("STATE", 6),
    ("READY", 5),
    ("PROC", 5),
    ("DELAY", 5),
    ("WAIT", 5),
    ("DEAD", 5),
    ("DONE/S", 6),
    ("FAIL/S", 6),
    ("LAG", 5),
    ("DMN", 3),
];

/// The screen's lines, each with its style, at most `height` of them and each at most `width` characters.
pub(crate) fn render(frame: &Frame<'_>, width: usize, height: usize) -> Vec<(Style, String)> {
    let mut lines = Vec::with_capacity(height);
    let updated = frame.updated.unwrap_or("-");
    lines.push((
        Style::Bold,
        format!(
            "kmqd stats --watch  every {}  updated {updated}  q quits, up/down scroll",
            humantime::format_duration(frame.interval)
        ),
    ));
    lines.push(match frame.error {
        Some(error) => (Style::Bad, format!("retrying: {error}")),
        None if frame.updated.is_none() => (Style::Dim, "reading the queues...".to_string()),
        None => (Style::Plain, String::new()),
    });
    let header: Vec<String> = COLUMNS
        .iter()
        .enumerate()
        .map(|(i, (title, w))| {
            if i < 3 {
                format!("{title:<w$}")
            } else {
                format!("{title:>w$}")
            }
        })
        .collect();
    lines.push((Style::Header, header.join(" ")));

    let scroll = frame.scroll.min(frame.rows.len().saturating_sub(1));
    let room = height.saturating_sub(lines.len());
    let rest = &frame.rows[scroll..];
    let needed: usize = rest.iter().map(lines_of).sum();
    // Whatever does not fit is summed up on the last line, which it needs for itself.
    let room = if needed > room {
        room.saturating_sub(1)
    } else {
        room
    };
    let mut shown = 0;
    let mut used = 0;
    for row in rest {
        if used + lines_of(row) > room {
            break;
        }
        used += lines_of(row);
        shown += 1;
        let style = if row.rates.is_some_and(|r| r.failed > 0.0) {
            Style::Bad
        } else if row.paused || row.throttled {
            Style::Warn
        } else {
            Style::Plain
        };
        lines.push((style, table_row(row)));
        if row.ready_by_level.len() > 1 {
            let levels: Vec<String> = row
                .ready_by_level
                .iter()
                .map(|(level, n)| format!("{level} {n}"))
                .collect();
            lines.push((
                Style::Dim,
                format!("  ready by level: {}", levels.join("  ")),
            ));
        }
    }
    let below = rest.len() - shown;
    if below > 0 || (scroll > 0 && lines.len() < height) {
        let above = if scroll > 0 {
            format!(", {scroll} above")
        } else {
            String::new()
        };
        lines.push((Style::Dim, format!("+{below} more{above}")));
    }
    lines.truncate(height);
    for (_, text) in &mut lines {
        fit(text, width);
    }
    lines
}

/// Screen lines a row takes: its own, and one for its levels when it has several.
fn lines_of(row: &Row) -> usize {
    if row.ready_by_level.len() > 1 { 2 } else { 1 }
}

fn table_row(row: &Row) -> String {
    let mut name = row.name.clone();
    fit(&mut name, COLUMNS[0].1);
    let (done, failed) = match row.rates {
        Some(rates) => (rate(rates.done), rate(rates.failed)),
        None => ("-".to_string(), "-".to_string()),
    };
    let cells = [
        name,
        row.mode.to_string(),
        row.state().to_string(),
        count(row.ready),
        count(row.processing),
        count(row.delayed),
        count(row.waiting),
        count(row.dead),
        done,
        failed,
        row.lag_ms.map_or("-".to_string(), lag),
        count(row.daemons as u64),
    ];
    let cells: Vec<String> = cells
        .iter()
        .zip(COLUMNS)
        .enumerate()
        .map(|(i, (cell, (_, w)))| {
            let mut cell = if i < 3 {
                format!("{cell:<w$}")
            } else {
                format!("{cell:>w$}")
            };
            fit(&mut cell, w);
            cell
        })
        .collect();
    cells.join(" ")
}

/// Cuts `text` to `width` characters, marking the cut with `~`.
fn fit(text: &mut String, width: usize) {
    if text.chars().count() > width {
        *text = text.chars().take(width.saturating_sub(1)).collect();
        if width > 0 {
            text.push('~');
        }
    }
}

/// A count in at most 5 characters: `12345`, `123k`, `1.2M`.
fn count(n: u64) -> String {
    match n {
        0..100_000 => n.to_string(),
        100_000..1_000_000 => format!("{}k", n / 1000),
        1_000_000..10_000_000 => format!("{:.1}M", n as f64 / 1e6),
        10_000_000..1_000_000_000 => format!("{}M", n / 1_000_000),
        _ => format!("{:.1}G", n as f64 / 1e9),
    }
}

/// A rate in at most 6 characters: `0.0`, `35.2`, `1234.5` below 10,000 a second, `12k` above.
fn rate(per_second: f64) -> String {
    // Below 9,999.95, since one decimal rounds 9,999.96 up to 10000.0: seven characters.
    if per_second < 9_999.95 {
        format!("{per_second:.1}")
    } else {
        format!("{}k", (per_second / 1000.0) as u64)
    }
}

/// A lag in at most 6 characters, in its largest unit: `850ms`, `12.3s`, `14m`, `5h`, `3d`.
fn lag(ms: i64) -> String {
    let ms = ms.max(0) as u64;
    match ms {
        0..1000 => format!("{ms}ms"),
        1000..60_000 => format!("{:.1}s", ms as f64 / 1000.0),
        60_000..3_600_000 => format!("{}m", ms / 60_000),
        3_600_000..86_400_000 => format!("{}h", ms / 3_600_000),
        _ => format!("{}d", ms / 86_400_000),
    }
}

/// The plain mode's line for one queue (`stats --watch` without a terminal), `key=value` words in a fixed
/// order: `at=2026-12-01T18:22:01Z queue=jobs mode=safe paused=no ready=12 ready_by_level=high:3,normal:9
/// processing=2 delayed=0 waiting=0 dead=0 done/s=35.2 failed/s=0.0 lag_ms=1200 daemons=2`. A rate is `-` at the first
/// poll, `lag_ms` is `-` when nothing is ready.
pub(crate) fn line(row: &Row, at: &str) -> String {
    let (done, failed) = match row.rates {
        Some(rates) => (format!("{:.1}", rates.done), format!("{:.1}", rates.failed)),
        None => ("-".to_string(), "-".to_string()),
    };
    let levels: Vec<String> = row
        .ready_by_level
        .iter()
        .map(|(level, n)| format!("{level}:{n}"))
        .collect();
    format!(
        "at={at} queue={} mode={} paused={} throttled={} ready={} ready_by_level={} processing={} delayed={} \
         waiting={} dead={} done/s={done} failed/s={failed} lag_ms={} daemons={}",
        row.name,
        row.mode,
        if row.paused { "yes" } else { "no" },
        if row.throttled { "yes" } else { "no" },
        row.ready,
        levels.join(","),
        row.processing,
        row.delayed,
        row.waiting,
        row.dead,
        row.lag_ms.map_or("-".to_string(), |ms| ms.to_string()),
        row.daemons,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::Rates;

    fn row(name: &str, levels: &[(&str, u64)]) -> Row {
        Row {
            name: name.to_string(),
            mode: "safe",
            paused: false,
            throttled: false,
            ready: levels.iter().map(|(_, n)| n).sum(),
            ready_by_level: levels.iter().map(|(l, n)| (l.to_string(), *n)).collect(),
            processing: 2,
            delayed: 0,
            waiting: 3,
            dead: 1,
            rates: Some(Rates {
                done: 35.25,
                failed: 0.0,
            }),
            lag_ms: Some(1234),
            daemons: 2,
            limits: None,
        }
    }

    fn frame(rows: &[Row]) -> Frame<'_> {
        Frame {
            rows,
            interval: Duration::from_secs(1),
            updated: Some("18:22:01"),
            error: None,
            scroll: 0,
        }
    }

    #[test]
    fn a_row_fits_80_columns_with_every_number() {
        let rows = [row("a-very-long-queue-name", &[("normal", 123_456_789)])];
        let lines = render(&frame(&rows), 80, 24);
        let text: Vec<&str> = lines.iter().map(|(_, t)| t.as_str()).collect();
        assert!(text.iter().all(|t| t.chars().count() <= 80), "{text:#?}");
        assert_eq!(
            text[3],
            "a-very-lo~ safe    active  123M     2     0     3     1   35.2    0.0  1.2s   2"
        );
        assert_eq!(
            text[2].trim_end(),
            text[2],
            "no trailing blanks in the header"
        );
        assert_eq!(text.len(), 4, "{text:#?}");
    }

    #[test]
    fn levels_get_a_line_and_what_does_not_fit_is_counted() {
        let rows: Vec<Row> = (0..30)
            .map(|i| row(&format!("q{i}"), &[("high", 1), ("low", 2)]))
            .collect();
        let lines = render(&frame(&rows), 80, 24);
        assert_eq!(lines.len(), 24);
        assert_eq!(lines[4].1, "  ready by level: high 1  low 2");
        // 3 lines of title, status and header; 10 queues of 2 lines; the last line sums up the 20 left.
        assert_eq!(lines[23].1, "+20 more");
        let scrolled = Frame {
            scroll: 25,
            ..frame(&rows)
        };
        let lines = render(&scrolled, 80, 24);
        assert!(lines[3].1.starts_with("q25 "), "{lines:#?}");
        assert_eq!(lines.last().unwrap().1, "+0 more, 25 above");
    }

    #[test]
    fn errors_show_and_styles_mark_paused_and_failing_queues() {
        let mut paused = row("p", &[("normal", 1)]);
        paused.paused = true;
        let mut failing = row("f", &[("normal", 1)]);
        failing.rates = Some(Rates {
            done: 0.0,
            failed: 3.0,
        });
        let rows = [paused, failing];
        let lines = render(
            &Frame {
                error: Some("redis: connection refused"),
                ..frame(&rows)
            },
            80,
            24,
        );
        assert_eq!(
            lines[1],
            (
                Style::Bad,
                "retrying: redis: connection refused".to_string()
            )
        );
        assert_eq!(lines[3].0, Style::Warn);
        assert!(lines[3].1.contains("paused"));
        assert_eq!(lines[4].0, Style::Bad);
    }

    #[test]
    fn a_tiny_terminal_gets_what_fits() {
        let rows = [row("a", &[("normal", 1)])];
        let lines = render(&frame(&rows), 10, 2);
        assert_eq!(lines.len(), 2);
        assert!(lines.iter().all(|(_, t)| t.chars().count() <= 10));
    }

    #[test]
    fn plain_lines_are_key_value_words() {
        let mut r = row("jobs", &[("high", 3), ("normal", 9)]);
        assert_eq!(
            line(&r, "2026-12-01T18:22:01Z"),
            "at=2026-12-01T18:22:01Z queue=jobs mode=safe paused=no throttled=no ready=12 \
             ready_by_level=high:3,normal:9 processing=2 delayed=0 waiting=3 dead=1 done/s=35.2 failed/s=0.0 lag_ms=1234 \
             daemons=2"
        );
        r.rates = None;
        r.lag_ms = None;
        r.paused = true;
        let text = line(&r, "x");
        assert!(
            text.contains("paused=yes") && text.contains("done/s=- failed/s=- lag_ms=-"),
            "{text}"
        );
    }

    #[test]
    fn numbers_shrink_to_their_columns() {
        assert_eq!(
            [
                count(99_999),
                count(123_456),
                count(1_234_567),
                count(u64::MAX)
            ],
            ["99999", "123k", "1.2M", "18446744073.7G"]
        );
        assert_eq!(
            [lag(850), lag(12_340), lag(14 * 60_000 + 1)],
            ["850ms", "12.3s", "14m"]
        );
        assert_eq!(
            [rate(0.0), rate(1234.56), rate(25_000.0)],
            ["0.0", "1234.6", "25k"]
        );
    }
}
