//! Push rates: `kmqd push` and `Client` batches, and single pushes, one round trip each.

use super::*;

pub(crate) fn push_rates(bench: &Bench) -> Result<Vec<Figure>, String> {
    let config = bench.config("push", "safe", None)?;
    let client = bench.client(&config)?;
    let n = bench.options.tasks;
    let single_n = n.min(20_000);
    let (mut single, mut stdin, mut batch) = (Vec::new(), Vec::new(), Vec::new());
    let one = kmqd::task::data_from_str("1").expect("1 is JSON");
    for _ in 0..bench.options.runs {
        bench.flush()?;
        let start = Instant::now();
        for _ in 0..single_n {
            client
                .push("q", NewTask::with_data("test", one.clone()))
                .map_err(|e| e.to_string())?;
        }
        single.push(single_n as f64 / start.elapsed().as_secs_f64());

        bench.flush()?;
        let start = Instant::now();
        bench.fill(&client, n)?;
        batch.push(n as f64 / start.elapsed().as_secs_f64());

        bench.flush()?;
        let lines = "1\n".repeat(n);
        let start = Instant::now();
        let mut child = Command::new(&bench.kmqd)
            .arg("--config")
            .arg(&config)
            .args(["push", "q", "test", "--stdin"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        child
            .stdin
            .take()
            .expect("piped")
            .write_all(lines.as_bytes())
            .map_err(|e| e.to_string())?;
        let status = child.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("kmqd push --stdin failed: {status}"));
        }
        stdin.push(n as f64 / start.elapsed().as_secs_f64());
    }
    Ok(vec![
        figure(
            "push",
            "Client::push, one task per round trip",
            "tasks/s",
            single,
            vec![],
        ),
        figure(
            "push",
            format!("kmqd push --stdin ({n} lines, process start included)"),
            "tasks/s",
            stdin,
            vec![],
        ),
        figure("push", "Client::push_batch", "tasks/s", batch, vec![]),
    ])
}

/// `Client::push`, one task per round trip (5,000 of them), on `target`.
pub(crate) fn single_pushes(bench: &Bench, target: &Target<'_>) -> Result<Figure, String> {
    let config = bench.config_on(
        &target.section,
        "single-pushes",
        "safe",
        None,
        bench.shape(),
    )?;
    let client = bench.client(&config)?;
    let one = kmqd::task::data_from_str("1").expect("1 is JSON");
    let mut rates = Vec::new();
    for _ in 0..bench.options.runs {
        target.flush()?;
        let start = Instant::now();
        for _ in 0..5_000 {
            client
                .push("q", NewTask::with_data("test", one.clone()))
                .map_err(|e| e.to_string())?;
        }
        rates.push(5_000.0 / start.elapsed().as_secs_f64());
    }
    Ok(figure(
        "deployments",
        format!(
            "{}: Client::push, one task per round trip",
            target.label.as_deref().unwrap_or("one Redis")
        ),
        "tasks/s",
        rates,
        vec![],
    ))
}
