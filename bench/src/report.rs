//! What a run reports: one figure per scenario and row, their medians and percentiles, and the text table.

use super::*;

/// One reported figure.
#[derive(Clone, Debug, Serialize)]
pub struct Figure {
    pub scenario: String,
    pub name: String,
    pub unit: String,
    pub median: f64,
    pub runs: Vec<f64>,
    /// Extra figures measured in the same runs (medians), e.g. CPU per task.
    pub extra: Vec<(String, f64)>,
}

/// Everything one `kmqd-bench` measured.
#[derive(Debug, Serialize)]
pub struct Report {
    pub redis_version: String,
    pub host: String,
    pub tasks: usize,
    pub runs: usize,
    pub workers: usize,
    pub batch: usize,
    pub prefetch: usize,
    pub figures: Vec<Figure>,
    /// The peers' figures from the same session, when given.
    pub peers: Vec<peers::PeerRow>,
}

pub(crate) fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The `p`-th percentile (0..=100) of `values`, nearest rank.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

pub(crate) fn figure(
    scenario: &str,
    name: impl Into<String>,
    unit: &str,
    runs: Vec<f64>,
    extra: Vec<(String, Vec<f64>)>,
) -> Figure {
    Figure {
        scenario: scenario.to_string(),
        name: name.into(),
        unit: unit.to_string(),
        median: median(&runs),
        runs,
        extra: extra
            .into_iter()
            .map(|(name, values)| (name, median(&values)))
            .collect(),
    }
}

/// The report as a text table.
pub fn render(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "kmqd-bench: redis-server {} on 127.0.0.1, {}; {} tasks per drain run; workers {}, batch {}, prefetch {}; \
         median of {} run(s)\n",
        report.redis_version,
        report.host,
        report.tasks,
        report.workers,
        report.batch,
        report.prefetch,
        report.runs
    );
    let _ = writeln!(
        out,
        "| scenario | what | median | runs | also measured (medians) |\n|---|---|---:|---|---|"
    );
    for f in &report.figures {
        let fmt = |v: f64| {
            if v >= 100.0 {
                format!("{v:.0}")
            } else {
                format!("{v:.2}")
            }
        };
        let runs: Vec<String> = f.runs.iter().map(|v| fmt(*v)).collect();
        let extra: Vec<String> = f
            .extra
            .iter()
            .map(|(name, v)| format!("{name}: {}", fmt(*v)))
            .collect();
        let _ = writeln!(
            out,
            "| {} | {} | **{} {}** | {} | {} |",
            f.scenario,
            f.name,
            fmt(f.median),
            f.unit,
            runs.join(" / "),
            extra.join(", ")
        );
    }
    if !report.peers.is_empty() {
        out.push_str(&peers::render(&report.figures, &report.peers));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_medians() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(
            (
                percentile(&values, 50.0),
                percentile(&values, 99.0),
                percentile(&values, 100.0)
            ),
            (50.0, 99.0, 100.0)
        );
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}
