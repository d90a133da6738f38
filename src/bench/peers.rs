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

/// The side-by-side table: kmqd's drain figures, every peer's, and Redis's own ceilings, with ratios.
pub fn render(figures: &[Figure], peers: &[PeerRow]) -> String {
    let drains: Vec<&Figure> = figures.iter().filter(|f| f.scenario == "drain").collect();
    let best = |mode: &str| {
        drains
            .iter()
            .filter(|f| f.name.starts_with(mode))
            .map(|f| f.median)
            .fold(0.0, f64::max)
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
        let _ = writeln!(
            out,
            "| **kmqd** | {} | **{}** | {} | {} | {} | | |",
            figure.name,
            fmt(Some(figure.median)),
            fmt(extra(figure, "daemon CPU µs/task")),
            fmt(extra(figure, "redis CPU µs/task")),
            fmt(extra(figure, "peak daemon RSS MB")),
        );
    }
    for row in peers.iter().filter(|row| row.drain.is_some()) {
        let rate = row.drain.unwrap_or(f64::NAN);
        let _ = writeln!(
            out,
            "| {} {} | {} | {} | {} | {} | {} | {:.1}× | {:.1}× |",
            row.peer,
            row.version.split_whitespace().next().unwrap_or(""),
            row.config,
            fmt(Some(rate)),
            fmt(per_task(row.worker_cpu_pct, rate)),
            fmt(per_task(row.redis_cpu_pct, rate)),
            fmt(row.worker_rss_mb),
            best_safe / rate,
            best_default / rate,
        );
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
                "| {} | {} | {:.2}× | {:.2}× |",
                row.config,
                fmt(Some(ops)),
                best_safe / ops,
                best_default / ops
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
             bee-queue,\"2.0.0 (node_redis 3, node v20)\",\"process(50), 2 processes\",300000,2,152020,46080,172,130,120,47,9,300000,0,0.1,\n",
        )
        .unwrap();
        let rows = load(dir.path()).unwrap();
        assert_eq!(rows.len(), 2);
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
    }
}
