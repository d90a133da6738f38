//! Setting kmqd's figures beside the peers': reads the `summary.csv` that `../shared/bench/peers/run.sh` writes
//! (median per configuration) and prints one table with the ratios, so every change can be checked against the
//! same yardstick. The peers must have run in the same session, on the same machine: `scripts/bench-peers`
//! does both.

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;

use super::Figure;

/// One row of the peers' summary.csv.
#[derive(Clone, Debug, Serialize)]
pub struct PeerRow {
    pub peer: String,
    pub version: String,
    pub config: String,
    /// Drain rate, tasks per second (peer rows).
    pub drain: Option<f64>,
    pub worker_cpu_pct: Option<f64>,
    pub redis_cpu_pct: Option<f64>,
    pub worker_rss_mb: Option<f64>,
    /// Commands per second (redis-benchmark rows).
    pub ops: Option<f64>,
}

/// Splits one CSV line: fields separated by commas, double-quoted when they hold commas, `""` for a quote.
fn fields(line: &str) -> Vec<String> {
    let (mut fields, mut field, mut quoted) = (Vec::new(), String::new(), false);
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => fields.push(std::mem::take(&mut field)),
            (c, _) => field.push(c),
        }
    }
    fields.push(field);
    fields
}

/// Reads `DIR/summary.csv`.
pub fn load(dir: &Path) -> Result<Vec<PeerRow>, String> {
    let path = dir.join("summary.csv");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut lines = text.lines();
    let header = fields(
        lines
            .next()
            .ok_or_else(|| format!("{}: empty", path.display()))?,
    );
    let column = |name: &str| {
        header
            .iter()
            .position(|h| h == name)
            .ok_or_else(|| format!("{}: no column {name}", path.display()))
    };
    let (peer, version, mode) = (column("peer")?, column("version")?, column("mode")?);
    let (drain, worker, redis, rss, ops) = (
        column("process_jobs_per_s")?,
        column("worker_cpu_pct")?,
        column("redis_cpu_pct")?,
        column("worker_peak_rss_mb")?,
        column("ops_per_s")?,
    );
    Ok(lines
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let row = fields(line);
            let text = |i: usize| row.get(i).cloned().unwrap_or_default();
            let number = |i: usize| row.get(i).and_then(|v| v.parse::<f64>().ok());
            PeerRow {
                peer: text(peer),
                version: text(version),
                config: text(mode),
                drain: number(drain),
                worker_cpu_pct: number(worker),
                redis_cpu_pct: number(redis),
                worker_rss_mb: number(rss),
                ops: number(ops),
            }
        })
        .collect())
}

/// CPU per task, µs, from a CPU percentage of one core over a drain at `rate` tasks/s.
fn per_task(cpu_pct: Option<f64>, rate: f64) -> Option<f64> {
    cpu_pct.map(|pct| pct / 100.0 * 1e6 / rate)
}

fn fmt(value: Option<f64>) -> String {
    match value {
        Some(v) if v >= 100.0 => format!("{v:.0}"),
        Some(v) => format!("{v:.2}"),
        None => "-".to_string(),
    }
}

fn extra(figure: &Figure, name: &str) -> Option<f64> {
    figure
        .extra
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| *v)
}

/// Peers that, like kmqd's default mode, lose a task in flight when their process dies: Sidekiq OSS fetches with
/// `BRPOP` (the peers' README). Their like-for-like comparison is kmqd's default mode, in a table of its own.
const AT_MOST_ONCE: [&str; 1] = ["sidekiq"];

/// A kmqd drain figure as a table row's first six cells.
fn kmqd_cells(figure: &Figure) -> String {
    format!(
        "| **kmqd** | {} | **{}** | {} | {} | {} |",
        figure.name,
        fmt(Some(figure.median)),
        fmt(extra(figure, "daemon CPU µs/task")),
        fmt(extra(figure, "redis CPU µs/task")),
        fmt(extra(figure, "peak daemon RSS MB")),
    )
}

/// A peer's drain row as a table row's first six cells.
fn peer_cells(row: &PeerRow, rate: f64) -> String {
    format!(
        "| {} {} | {} | {} | {} | {} | {} |",
        row.peer,
        row.version.split_whitespace().next().unwrap_or(""),
        row.config,
        fmt(Some(rate)),
        fmt(per_task(row.worker_cpu_pct, rate)),
        fmt(per_task(row.redis_cpu_pct, rate)),
        fmt(row.worker_rss_mb),
    )
}

/// The side-by-side table: kmqd's drain figures, every peer's, and Redis's own ceilings, with ratios; then kmqd's
/// default mode beside the at-most-once peers ([`AT_MOST_ONCE`]), when the peers' results have them.
pub fn render(figures: &[Figure], peers: &[PeerRow]) -> String {
    let drains: Vec<&Figure> = figures.iter().filter(|f| f.scenario == "drain").collect();
    // None when this run measured no drain of that mode (`--only` left it out): its ratios then read "—".
    let best = |mode: &str| {
        drains
            .iter()
            .filter(|f| f.name.starts_with(mode))
            .map(|f| f.median)
            .max_by(f64::total_cmp)
    };
    let ratio = |best: Option<f64>, rate: f64, digits: usize| {
        best.map_or("—".to_string(), |best| {
            format!("{:.digits$}×", best / rate)
        })
    };
    let (best_safe, best_default) = (best("safe"), best("default"));
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n## Drain of no-op tasks: kmqd and the peers, this session\n"
    );
    let _ = writeln!(
        out,
        "| system | configuration | drain tasks/s | worker CPU µs/task | Redis CPU µs/task | worker peak RSS MB | kmqd safe ÷ this | kmqd default ÷ this |\n|---|---|---:|---:|---:|---:|---:|---:|"
    );
    for figure in &drains {
        let _ = writeln!(out, "{} | |", kmqd_cells(figure));
    }
    for row in peers.iter().filter(|row| row.drain.is_some()) {
        let rate = row.drain.unwrap_or(f64::NAN);
        let _ = writeln!(
            out,
            "{} {} | {} |",
            peer_cells(row, rate),
            ratio(best_safe, rate, 1),
            ratio(best_default, rate, 1),
        );
    }
    let at_most_once: Vec<&PeerRow> = peers
        .iter()
        .filter(|row| row.drain.is_some() && AT_MOST_ONCE.contains(&row.peer.as_str()))
        .collect();
    if !at_most_once.is_empty() {
        let _ = writeln!(
            out,
            "\n## At-most-once: kmqd default mode and {}, this session\n",
            AT_MOST_ONCE.join(", ")
        );
        let _ = writeln!(
            out,
            "| system | configuration | drain tasks/s | worker CPU µs/task | Redis CPU µs/task | worker peak RSS MB | kmqd default ÷ this |\n|---|---|---:|---:|---:|---:|---:|"
        );
        for figure in drains.iter().filter(|f| f.name.starts_with("default")) {
            let _ = writeln!(out, "{} |", kmqd_cells(figure));
        }
        for row in at_most_once {
            let rate = row.drain.unwrap_or(f64::NAN);
            let _ = writeln!(
                out,
                "{} {} |",
                peer_cells(row, rate),
                ratio(best_default, rate, 1)
            );
        }
    }
    let ceilings: Vec<&PeerRow> = peers.iter().filter(|row| row.ops.is_some()).collect();
    if !ceilings.is_empty() {
        let _ = writeln!(out, "\n## Redis alone (redis-benchmark), this session\n");
        let _ = writeln!(
            out,
            "| command | ops/s | kmqd safe ÷ this | kmqd default ÷ this |\n|---|---:|---:|---:|"
        );
        for row in ceilings {
            let ops = row.ops.unwrap_or(f64::NAN);
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} |",
                row.config,
                fmt(Some(ops)),
                ratio(best_safe, ops, 2),
                ratio(best_default, ops, 2)
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_csv_fields_keep_their_commas() {
        assert_eq!(
            fields(r#"bullmq,"6.7.0 (ioredis 6.0.0, node)","a, b; ""c""",250000,,1.5"#),
            [
                "bullmq",
                "6.7.0 (ioredis 6.0.0, node)",
                r#"a, b; "c""#,
                "250000",
                "",
                "1.5"
            ]
        );
    }

    #[test]
    fn reads_the_recorded_peer_results() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("summary.csv"),
            "peer,version,mode,N,runs,enqueue_jobs_per_s,process_jobs_per_s,worker_peak_rss_mb,worker_peak_pss_mb,worker_cpu_pct,redis_cpu_pct,redis_cmds_per_job,handler_calls,failed,startup_s,ops_per_s\n\
             redis-benchmark,redis-server 7.0.15,RPOP -P 32 -c 50,2000000,2,,,,,100,99,,,,,1940000\n\
             bee-queue,\"2.0.0 (node_redis 3, node v20)\",\"process(50), 2 processes\",300000,2,152020,46080,172,130,120,47,9,300000,0,0.1,\n\
             sidekiq,\"6.4.1 (redis-rb 4.8.0, ruby 3.1.2)\",\"sidekiq -c 10, 2 processes\",180000,2,187700,31906.5,105.5,91.3,136.5,39.0,1.0,180000,0,0.1,\n",
        )
        .unwrap();
        let rows = load(dir.path()).unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!((rows[0].ops, rows[0].drain), (Some(1_940_000.0), None));
        assert_eq!(
            (
                rows[1].config.as_str(),
                rows[1].drain,
                rows[1].redis_cpu_pct
            ),
            ("process(50), 2 processes", Some(46_080.0), Some(47.0))
        );
        let table = render(&[], &rows);
        assert!(
            table.contains(
                "| bee-queue 2.0.0 | process(50), 2 processes | 46080 | 26.04 | 10.20 | 172 |"
            ),
            "{table}"
        );
        assert!(table.contains("| RPOP -P 32 -c 50 | 1940000 |"), "{table}");
        // No kmqd figures: no ratios to speak of, but Sidekiq's own table is there.
        assert!(
            table.contains("## At-most-once: kmqd default mode and sidekiq"),
            "{table}"
        );
    }

    #[test]
    fn kmqd_default_mode_stands_beside_sidekiq() {
        let rows = vec![
            PeerRow {
                peer: "sidekiq".into(),
                version: "6.4.1 (redis-rb 4.8.0)".into(),
                config: "sidekiq -c 10, 2 processes".into(),
                drain: Some(32_000.0),
                worker_cpu_pct: Some(136.0),
                redis_cpu_pct: Some(40.0),
                worker_rss_mb: Some(105.0),
                ops: None,
            },
            PeerRow {
                peer: "bee-queue".into(),
                version: "2.0.0".into(),
                config: "process(50), 2 processes".into(),
                drain: Some(40_000.0),
                worker_cpu_pct: None,
                redis_cpu_pct: None,
                worker_rss_mb: None,
                ops: None,
            },
        ];
        let drain = |name: &str, median: f64| Figure {
            scenario: "drain".into(),
            name: name.into(),
            unit: "tasks/s".into(),
            median,
            runs: vec![median],
            extra: vec![("daemon CPU µs/task".into(), 1.5)],
        };
        let figures = [
            drain("safe mode, 1 daemon(s)", 400_000.0),
            drain("default mode, 1 daemon(s)", 800_000.0),
            drain("default mode, 2 daemon(s)", 960_000.0),
        ];
        let table = render(&figures, &rows);
        let (_, at_most_once) = table
            .split_once("## At-most-once: kmqd default mode and sidekiq, this session")
            .expect(&table);
        // kmqd's default-mode drains and Sidekiq only, the ratio against kmqd's best default-mode figure.
        assert_eq!(
            at_most_once.trim().lines().skip(2).collect::<Vec<_>>(),
            [
                "| **kmqd** | default mode, 1 daemon(s) | **800000** | 1.50 | - | - | |",
                "| **kmqd** | default mode, 2 daemon(s) | **960000** | 1.50 | - | - | |",
                "| sidekiq 6.4.1 | sidekiq -c 10, 2 processes | 32000 | 42.50 | 12.50 | 105 | 30.0× |",
            ],
            "{table}"
        );
    }
}
